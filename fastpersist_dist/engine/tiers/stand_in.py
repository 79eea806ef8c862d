"""A node's copy of a tiered checkpoint standing in for its persistent directory in megatron-core's own calls.

megatron-core's ``save()`` looks into its ``checkpoint_dir`` on rank 0 before
any strategy runs (0.19: an S3 LIST on ``msc://``) and writes ``metadata.json``
there when the save is finalized: given the persistent tier, a persistent tier
that cannot be reached fails the save before a tiered save could go on without
it. An integration that drives megatron's ``save()`` (the Megatron-LM hook)
gives it the node's copy of the checkpoint instead, registered here; the
strategy saves to the persistent directory it stands for, and writes
``metadata.json`` there itself with the local commit, or its drain once the tier
answers (``save.py``).
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
