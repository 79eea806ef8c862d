"""Host copies of a synchronous write go through one reused block (storage/host_staging.py): the ring's
bookkeeping, and the bytes written when copies wrap around it, outgrow it, or find it in use."""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch

from fastpersist_dist.storage import host_staging, writer
from fastpersist_dist.storage.host_staging import ALIGN, Ring, staging_block
from fastpersist_dist.tools.ranks import run_ranks
from fastpersist_dist.util.config import MiB, WriteConfig

from .faults import random_records

pytestmark = pytest.mark.engine


def test_the_ring_hands_out_regions_in_order_and_wraps_only_into_what_was_given_back():
    ring = Ring(10 * ALIGN)
    assert ring.take(3 * ALIGN) == 0
    assert ring.take(4 * ALIGN - 5) == 3 * ALIGN  # rounded up to ALIGN
    assert ring.take(4 * ALIGN) is None  # 3 left at the end, the start still held
    ring.give_back_oldest()  # 0..3 free
    assert ring.take(4 * ALIGN) is None  # neither at the end (3) nor at the start (3)
    assert ring.take(3 * ALIGN) == 7 * ALIGN  # the end first
    assert ring.take(2 * ALIGN) == 0  # then wrapped, below the oldest (3)
    assert ring.take(2 * ALIGN) is None  # 2..3 only: one free
    assert ring.take(ALIGN) == 2 * ALIGN
    ring.give_back_oldest()  # 3..7
    assert ring.take(4 * ALIGN) == 3 * ALIGN  # wrapped: between the newest (3) and the oldest (7)
    for _ in range(3):  # 7..10, 0..2, 2..3
        ring.give_back_oldest()
    assert ring.take(10 * ALIGN) is None  # one region still held (3..7)
    ring.give_back_oldest()
    assert ring.take(10 * ALIGN) == 0  # empty: from the start
    assert Ring(10 * ALIGN).take(10 * ALIGN + 1) is None  # never fits


def _slow_read(data: torch.Tensor) -> bytes:
    time.sleep(0.05)  # a checksum still reading the copy when the write has moved on
    return bytes(data.numpy())


def _read_at_once(data: torch.Tensor) -> Future:
    done: Future = Future()
    done.set_result(bytes(data.numpy()))  # checksummed before the write gets there
    return done


@pytest.mark.parametrize("slow", [True, False], ids=["checksums-behind", "checksums-ahead"])
def test_a_copy_keeps_its_region_until_both_written_and_checksummed(slow):
    lengths = [3 * ALIGN + 1, 5 * ALIGN, 2 * ALIGN, 4 * ALIGN - 7, 6 * ALIGN, ALIGN]
    items = _strided(random_records(lengths, 0))
    block = torch.zeros(8 * ALIGN, dtype=torch.uint8)  # two or three copies at once: regions are reused
    with ThreadPoolExecutor(1) as checksummer:
        read = (lambda data: checksummer.submit(_slow_read, data)) if slow else _read_at_once
        ahead = writer._HostBytesAhead(items, lambda item, data: read(data), 8 * ALIGN, block)
        for i, item in enumerate(items):
            assert bytes(ahead.get(i).numpy()) == bytes(item.data.numpy()), f"written bytes of item {i}"
        for i, (item, digest) in enumerate(zip(items, ahead.digests)):
            assert digest.result() == bytes(item.data.numpy()), f"checksummed bytes of item {i}"


def _strided(items: list[writer.WriteItem]) -> list[writer.WriteItem]:
    """The same records, each one's bytes as a strided view (every other byte of a buffer): each needs a host copy."""
    out = []
    for item in items:
        spread = torch.zeros(2 * item.data.numel(), dtype=torch.uint8)
        spread[::2] = item.data
        out.append(writer.WriteItem(item.record, spread[::2]))
        assert writer.needs_host_copy(out[-1].data) or item.data.numel() <= 1  # those are contiguous views
    return out


def _write_through_the_block(rank: int, world: int, root: str) -> None:
    # In a forked process: the aio handle and the block stay out of the pytest process.
    writer.HOST_COPY_BYTES = 10 * MiB  # so that the copies below wrap around it, and one outgrows it
    lengths = [3 * MiB + 7, 5 * MiB + 1, 0, 4 * MiB, 11 * MiB + 3, 7 * MiB, 2 * MiB + 64, 6 * MiB, 3]
    contiguous = random_records(lengths, rank)
    expected = b"".join(bytes(item.data.numpy()) for item in contiguous)
    cfg = WriteConfig(io_buffer_mb=1, checksum_block_mb=1)
    want = writer.write_rank_file(os.path.join(root, "contiguous.bin"), contiguous, cfg, rank).records
    for name, held in (("through the block", False), ("block in use elsewhere", True)):
        path = os.path.join(root, f"{name}.bin")
        if held:
            with staging_block(writer.HOST_COPY_BYTES, pinned=False) as block:
                assert block is not None
                result = writer.write_rank_file(path, _strided(contiguous), cfg, rank)
        else:
            result = writer.write_rank_file(path, _strided(contiguous), cfg, rank)
            assert host_staging._BLOCKS[os.getpid()][1].nbytes == 10 * MiB  # the copies had the block
        with open(path, "rb") as f:
            assert f.read() == expected, name
        assert [r.checksums for r in result.records] == [r.checksums for r in want], name


def test_copies_that_wrap_around_the_block_outgrow_it_or_find_it_in_use_write_the_same_bytes(tmp_path):
    run_ranks(1, _write_through_the_block, str(tmp_path))


def test_a_process_keeps_one_block_and_a_forked_child_makes_its_own():
    run_ranks(1, _one_block_per_process)


def _one_block_per_process(rank: int, world: int) -> None:
    with staging_block(MiB, pinned=False) as first:
        first.fill_(1)
    with staging_block(MiB, pinned=False) as again:
        assert again.data_ptr() == first.data_ptr()
    pid = os.fork()
    if pid == 0:  # the child writes its own block: the parent's mapping is shared with it
        with staging_block(MiB, pinned=False) as child:
            ok = child.data_ptr() != first.data_ptr()
            child.numpy()[:] = 2  # numpy: torch's thread pool does not survive a fork
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert bool((first == 1).all())
