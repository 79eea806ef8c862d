"""The streaming O_DIRECT reader: pieces and batches (pure), and real loads through tiny slots.

Slots of a few MiB against 1 MiB checksum blocks make every read straddle slot
boundaries; odd element counts leave unaligned file tails; an odd-length object
record saved first misaligns the elements that follow it in the file.
"""

from __future__ import annotations

import os

import pytest
import torch
from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace

from fastpersist_dist import FastPersistLoadStrategy
from fastpersist_dist.engine.index_reader import read_index
from fastpersist_dist.engine.load import Loader
from fastpersist_dist.format.layout import Extent
from fastpersist_dist.format.records import KIND_TENSOR, data_file_name
from fastpersist_dist.storage.deepspeed_ops import aio_resources
from fastpersist_dist.storage.reader import MAX_READ_GAP, ShardReader
from fastpersist_dist.storage.mounts import filesystem_type
from fastpersist_dist.storage.stream_reader import (
    ALIGN,
    BoxRead,
    StreamReader,
    into_batches,
    open_stream,
    split_into_pieces,
)
from fastpersist_dist.tools.ranks import run_ranks
from fastpersist_dist.util.config import MiB, ReadConfig
from fastpersist_dist.util.errors import CorruptCheckpointError

from .helpers import assert_same, empty_like_request, flip_bit, global_tensor, load, save, sharded

pytestmark = pytest.mark.contract

BIG = (1002, 1030)  # rows of 4120 bytes: nothing aligned
SLOT = 2 * MiB + 3 * ALIGN  # the smallest slot that fits two 1 MiB checksum blocks and alignment slack


def _record(shape: tuple[int, ...], offset: int = 0, data_offset: int = 0, length: int = 0):
    from fastpersist_dist.format.records import ShardRecord

    n = 4 * torch.Size(shape).numel()
    return ShardRecord("t", KIND_TENSOR, "float32", shape, shape, (0,) * len(shape), None, 0, None, 0,
                       "f.bin", offset, length or data_offset + n, (), data_offset)


def test_pieces_are_contiguous_bounded_and_cover_the_box():
    rec = _record((512, 1024), offset=12345, data_offset=64)  # 2 MiB of float32 rows of 4 KiB
    dest = torch.empty(512, 700)
    read = BoxRead(rec, Extent((0, 0), (512, 1024), 0), (0, 100), (512, 700), dest)
    pieces = split_into_pieces(read, MiB, MiB)
    assert sum(p.box.dest.numel() for p in pieces) == dest.numel()
    for p in pieces:
        assert p.hi - p.lo <= MiB and (p.lo - rec.offset) % MiB == 0  # whole checksum blocks of the record
    # Without checksum blocks, rows with gaps above MAX_READ_GAP become one piece each.
    wide = _record((4, 1 << 17))  # rows of 512 KiB
    gappy = BoxRead(wide, Extent((0, 0), (4, 1 << 17), 0), (0, 0), (4, 1000), torch.empty(4, 1000))
    assert MAX_READ_GAP < (1 << 19) - 4000
    assert [p.hi - p.lo for p in split_into_pieces(gappy, None, 64 * MiB)] == [4000] * 4


def test_batches_are_aligned_fit_a_slot_and_keep_file_order():
    rec = _record((3 * MiB,), offset=1001)
    dest = torch.empty(3 * MiB)
    pieces = split_into_pieces(BoxRead(rec, Extent((0,), (3 * MiB,), 0), (0,), (3 * MiB,), dest), MiB, SLOT - 2 * ALIGN)
    batches = into_batches(pieces, SLOT, ALIGN)
    assert len(batches) > 1
    for b in batches:
        assert b.lo % ALIGN == 0 and -(-b.hi // ALIGN) * ALIGN - b.lo <= SLOT
        assert all(b.lo <= p.lo and p.hi <= b.hi for p in b.pieces)
    assert [p for b in batches for p in b.pieces] == sorted(pieces, key=lambda p: (p.lo, p.hi))


def _state(rank: int, world: int) -> dict:
    """Tensors of odd sizes behind an odd-length object, so elements sit unaligned in the file."""
    return {
        "a_obj": ShardedObject("a_obj", "x" * 37, (1,), (0,), replica_id=rank),
        "big": sharded("big", global_tensor("big", BIG), rank, world, None if world == 1 else 1),
        "bf16": sharded("bf16", global_tensor("bf16", (777, 5), torch.bfloat16), rank, world, None),
        "i8": sharded("i8", global_tensor("i8", (8, 333), torch.int8), rank, world, 0),
    }


def _save(rank: int, world: int, path: str) -> None:
    save(_state(rank, world), path, checksum_block_mb=1)


def _stream_load(rank: int, world: int, path: str, split: object) -> None:
    """Load resharded through a StreamReader with tiny slots, checking every element."""
    want = {k: v for k, v in _state(rank, world).items() if isinstance(v, ShardedTensor)}
    if split is not None:
        want["big"] = sharded("big", global_tensor("big", BIG), rank, world, split)
    request = {k: empty_like_request(v) for k, v in want.items()}
    index = read_index(path, f"rank {rank}")
    with ShardReader(path, index, True, f"rank {rank}") as reader:
        stream = StreamReader(reader, aio_resources(ReadConfig().aio), slot_bytes=SLOT)
        assert stream.fits()
        loader = Loader(index, reader, rank, False, stream)
        dict_list_map_inplace(loader.load, request)
        loader.run(1)
        assert stream.bytes_read > 0
    for k, sh in want.items():
        assert_same(request[k], sh.data, f"{k} rank {rank}")


@pytest.mark.parametrize("load_world,split", [(1, None), (2, 0), (2, 1)])
def test_stream_loads_through_small_slots(tmp_path, load_world, split):
    path = str(tmp_path / "ckpt")
    run_ranks(1, _save, path)
    run_ranks(load_world, _stream_load, path, split)


def _load_with(rank: int, world: int, path: str, direct_io: str) -> None:
    want = {k: v for k, v in _state(rank, world).items() if isinstance(v, ShardedTensor)}
    loaded = load({k: empty_like_request(v) for k, v in want.items()}, path,
                  sharded_strategy=FastPersistLoadStrategy(direct_io=direct_io))
    for k, sh in want.items():
        assert_same(loaded[k], sh.data, f"{k} rank {rank}")


@pytest.mark.parametrize("direct_io", ["on", "off"])
def test_strategy_loads_with_and_without_o_direct(tmp_path, direct_io):
    path = str(tmp_path / "ckpt")
    run_ranks(2, _save, path)
    run_ranks(2, _load_with, path, direct_io)


def _expect_corrupt(rank: int, world: int, path: str, slot: int) -> str:
    want = {"big": empty_like_request(_state(0, 1)["big"])}
    index = read_index(path, f"rank {rank}")
    with ShardReader(path, index, True, f"rank {rank}") as reader:
        loader = Loader(index, reader, rank, False, StreamReader(reader, aio_resources(ReadConfig().aio), slot))
        dict_list_map_inplace(loader.load, want)
        with pytest.raises(CorruptCheckpointError) as info:
            loader.run(1)
        # The handle was left idle and its buffer free: the next load in this process works.
        intact = {"i8": empty_like_request(_state(0, 1)["i8"])}
        loader = Loader(index, reader, rank, False, StreamReader(reader, aio_resources(ReadConfig().aio), slot))
        dict_list_map_inplace(loader.load, intact)
        loader.run(1)
        assert_same(intact["i8"], _state(0, 1)["i8"].data, "i8 after the error")
    return str(info.value)


def test_corrupt_block_in_the_middle_of_a_coalesced_read_is_caught(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(1, _save, path)
    index = read_index(path, "test")
    big = next(r for r in index.records if r.key == "big")
    victim = os.path.join(path, data_file_name(0))
    at = big.offset + 2 * MiB + 12345  # block 2 of 'big' (1 MiB blocks): neither first nor last
    flip_bit(victim, at)
    for slot in (SLOT, 64 * MiB):  # the block mid-slot in a read of many blocks, and in a small read
        msg = run_ranks(1, _expect_corrupt, path, slot)[0]
        assert victim in msg and "'big'" in msg and "rank 0" in msg, msg
        assert f"byte offset {big.offset + 2 * MiB}" in msg and "block 2 of" in msg, msg


def _choices(rank: int, world: int, path: str) -> dict:
    index = read_index(path, "test")
    out = {}
    for direct_io in ("auto", "on", "off"):
        for verify in (True, False):
            with ShardReader(path, index, verify, "test") as reader:
                stream = open_stream(reader, lambda: aio_resources(ReadConfig().aio), direct_io)
                out[(direct_io, verify)] = stream is not None
    return out


def test_stream_only_for_verified_loads_off_memory_filesystems(tmp_path, shm_dir):
    disk = str(tmp_path / "ckpt")
    run_ranks(1, _save, disk)
    assert filesystem_type(disk) not in ("tmpfs", "ramfs")
    choices = run_ranks(1, _choices, disk)[0]
    assert choices == {("auto", True): True, ("on", True): True, ("off", True): False,
                       ("auto", False): False, ("on", False): False, ("off", False): False}
    shm = f"{shm_dir}/ckpt"
    run_ranks(1, _save, shm)
    choices = run_ranks(1, _choices, shm)[0]
    assert not choices[("auto", True)]  # a pread from memory beats a bounce through the locked buffer
