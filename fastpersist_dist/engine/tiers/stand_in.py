"""A node's copy of a tiered checkpoint standing in for its persistent directory in megatron-core's own calls:
its ``save()`` lists ``checkpoint_dir`` and writes ``metadata.json`` there, which fails while the persistent tier
is down. An integration gives megatron the node's copy, registered here; the strategy maps it back.
"""

from __future__ import annotations

import os

from ...format.tiers import local_copy_dir
from ...storage.persistent import checkpoint_url
from ...util.per_process import PerProcess

_stand_ins: PerProcess[dict[str, str]] = PerProcess(dict)  # a node's copy -> the persistent directory


def stand_in(local_dir: str, checkpoint_dir: str) -> str:
    """This node's copy of ``checkpoint_dir`` in the local tier ``local_dir`` (made), registered as standing in
    for it."""
    url = checkpoint_url(checkpoint_dir)
    local = local_copy_dir(local_dir, url)
    os.makedirs(local, exist_ok=True)
    _stand_ins.get()[local] = url
    return local


def persistent_for(checkpoint_dir: str) -> str:
    """The persistent directory ``checkpoint_dir`` stands in for where it is a registered node copy; else
    ``checkpoint_dir`` itself (as a URL or absolute path)."""
    url = checkpoint_url(checkpoint_dir)
    return _stand_ins.get().get(url, url)
