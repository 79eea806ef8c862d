"""megatron's ``metadata.json`` of a checkpoint, as its ``save()`` writes it.

``save()`` writes it after the strategy's save, and for an async save in a
finalize step of its own, after ours. A tiered async save is committed to the
local tiers (and may become durable) before the training loop's finalize:
written with that commit too, so that a checkpoint its manifest calls local or
durable is one megatron's ``load()`` takes (``engine/tiers/save.py``).
megatron's own dataclass makes the bytes, which differ between its versions.
"""

from __future__ import annotations

import json
from dataclasses import asdict

from megatron.core.dist_checkpointing.core import CONFIG_FNAME, CheckpointingConfig


def megatron_config(backend: str, version: int) -> dict[str, bytes]:
    """``metadata.json`` (name -> bytes) naming the sharded ``backend`` and ``version`` that saved a checkpoint."""
    return {CONFIG_FNAME: json.dumps(asdict(CheckpointingConfig(backend, version))).encode()}
