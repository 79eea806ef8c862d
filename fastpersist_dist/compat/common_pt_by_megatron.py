"""Common state on megatron-core <= 0.18: ``save()`` writes ``common.pt`` itself, before the strategy runs.

So the strategy sees only the sharded part. megatron overwrites ``common.pt``
of a committed checkpoint before our strategy has checked anything; were the
save then refused, the old checkpoint would load the new common state with
its old tensors. Rank 0 therefore takes the bytes megatron just wrote and
commits them with the checkpoint, ``common.pt`` and a copy, both in the index:
a loader refuses a ``common.pt`` that is not the committed one, and a refused
save puts the committed one back (``commit.keep_committed_aux_files``).
"""

from __future__ import annotations

import os

from ..format.records import COMMON_FILE, aux_copy_name


def common_files(sharded_state_dict: dict, checkpoint_dir: str, rank: int, write_common_pt: bool) -> dict[str, bytes]:
    """Rank 0: the ``common.pt`` megatron's ``save()`` just wrote, and its copy (none where it wrote none)."""
    if rank != 0:
        return {}
    try:
        with open(os.path.join(checkpoint_dir, COMMON_FILE), "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return {}  # a common strategy that writes elsewhere (e.g. object storage): nothing here to guard
    return {COMMON_FILE: data, aux_copy_name(COMMON_FILE): data}


def strategy_input(sharded: dict, common: dict, rank: int) -> dict:
    """What ``save()`` hands the save strategy: the sharded part (the common state went to ``common.pt``)."""
    return sharded
