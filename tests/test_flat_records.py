"""Records holding a flattened range of a shard (byte-range splits) load into any sharding.

megatron-core 0.16 rejects ShardedTensor.flattened_range, so no save through
megatron produces such records yet; the format and reader support them (the
data-parallel split of large shards writes them). Here the files are made by
hand, exactly as the README's format section describes.
"""

from __future__ import annotations

import os

import pytest
import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor

from fastpersist_dist import FastPersistLoadStrategy
from fastpersist_dist.format.records import data_file_name
from fastpersist_dist.tools.ranks import RanksFailed, run_ranks

from .helpers import assert_same, global_tensor
from .states import FLAT_SHAPE, write_flat_checkpoint

pytestmark = pytest.mark.contract


def _load(rank: int, world: int, path: str, axis: int, verify: bool) -> None:
    full = global_tensor("flat", FLAT_SHAPE, torch.float32)
    local = full.chunk(world, axis)[rank]
    req = ShardedTensor.from_rank_offsets("flat", torch.full_like(local, -1), (axis, rank, world))
    loaded = dist_checkpointing.load({"t": req}, path, sharded_strategy=FastPersistLoadStrategy(verify_checksums=verify))
    assert_same(loaded["t"], local, f"rank {rank}")


@pytest.mark.parametrize("world,axis", [(1, 0), (2, 0), (3, 0), (2, 1), (5, 1)])
@pytest.mark.parametrize("verify", [True, False])
def test_flat_records_load_in_any_sharding(tmp_path, world, axis, verify):
    path = str(tmp_path / "ckpt")
    write_flat_checkpoint(path)
    run_ranks(world, _load, path, axis, verify)


def test_flat_record_corruption_is_caught(tmp_path):
    path = str(tmp_path / "ckpt")
    write_flat_checkpoint(path)
    with open(os.path.join(path, data_file_name(1)), "r+b") as f:
        f.seek(40)
        f.write(b"\xff")
    with pytest.raises(RanksFailed, match="checksum mismatch"):
        run_ranks(1, _load, path, 0, True)
