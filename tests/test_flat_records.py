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
from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config

from fastpersist_dist import FastPersistLoadStrategy
from fastpersist_dist.checksum import BlockHasher
from fastpersist_dist.format import BACKEND, BACKEND_VERSION, INDEX_FILE, CheckpointIndex, ShardRecord, data_file_name

from .helpers import assert_same, global_tensor
from .multiproc import run_ranks

SHAPE = (6, 10)
# Two row-shards of the global tensor, each stored as flat pieces spread over two files.
PIECES = [  # (shard row offset, shard rows, flat start, flat stop, file rank)
    (0, 4, 0, 7, 0), (0, 4, 7, 33, 1), (0, 4, 33, 40, 0),
    (4, 2, 0, 20, 1),
]
BLOCK = 16  # tiny checksum blocks, so partial reads verify several blocks


def _checksums(data: bytes) -> list[str]:
    hasher = BlockHasher(BLOCK)
    hasher.update(data)
    return hasher.finish()


def write_flat_checkpoint(path: str) -> torch.Tensor:
    full = global_tensor("flat", SHAPE, torch.float32)
    os.makedirs(path, exist_ok=True)
    blobs: dict[int, bytearray] = {0: bytearray(), 1: bytearray()}
    records = []
    for row, rows, start, stop, rank in PIECES:
        data = full[row : row + rows].reshape(-1)[start:stop].numpy().tobytes()
        blob = blobs[rank]
        records.append(ShardRecord(
            key="flat", kind="tensor", dtype="float32", local_shape=(rows, SHAPE[1]), global_shape=SHAPE,
            global_offset=(row, 0), axis_fragmentations=None, prepend_axis_num=0, flattened_range=(start, stop),
            replica_id=0, file=data_file_name(rank), offset=len(blob), length=len(data),
            checksums=tuple(_checksums(data)),
        ))
        blob.extend(data)
    for rank, blob in blobs.items():
        with open(os.path.join(path, data_file_name(rank)), "wb") as f:
            f.write(blob)
    index = CheckpointIndex(world_size=2, checksum_block_bytes=BLOCK,
                            files={data_file_name(r): len(b) for r, b in blobs.items()}, records=tuple(records))
    with open(os.path.join(path, INDEX_FILE), "wb") as f:
        f.write(index.to_json_bytes())
    torch.save({}, os.path.join(path, "common.pt"))
    save_config(CheckpointingConfig(BACKEND, BACKEND_VERSION), path)
    return full


def _load(rank: int, world: int, path: str, axis: int, verify: bool) -> None:
    full = global_tensor("flat", SHAPE, torch.float32)
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
    with pytest.raises(AssertionError, match="checksum mismatch"):
        run_ranks(1, _load, path, 0, True)
