"""Common state on megatron-core 0.19+: ``save()`` hands it to the strategy as a ``common_state`` ShardedObject.

It is stored like any object; on request the strategy also commits it as
``common.pt``, which megatron-core <= 0.18 needs to load the checkpoint.
"""

from __future__ import annotations

import io

import torch
from megatron.core.dist_checkpointing.mapping import ShardedObject

from ..format.records import COMMON_FILE, COMMON_STATE_KEY


def common_files(sharded_state_dict: dict, checkpoint_dir: str, rank: int, write_common_pt: bool) -> dict[str, bytes]:
    """``common.pt`` (rank 0, when asked) holding the common state, as megatron-core <= 0.18 wrote it."""
    common = sharded_state_dict.get(COMMON_STATE_KEY)
    if not write_common_pt or rank != 0 or not isinstance(common, ShardedObject):
        return {}
    buf = io.BytesIO()
    torch.save(common.data, buf)
    return {COMMON_FILE: buf.getvalue()}


def strategy_input(sharded: dict, common: dict, rank: int) -> dict:
    """What ``save()`` hands the save strategy: the sharded part plus the common state as a ShardedObject."""
    return {**sharded, COMMON_STATE_KEY: ShardedObject(COMMON_STATE_KEY, common, (1,), (0,), replica_id=rank)}
