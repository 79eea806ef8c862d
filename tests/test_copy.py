"""A data file copied between tiers: every block checked on the way, the destination whole or absent.

The window plan is pure and checked against its definition; the copy runs on
real files, to the disk (O_DIRECT) and to tmpfs (buffered), with windows far
smaller than the default so that blocks straddle windows. A copy that follows
a file while a thread writes it is put in place only once its blocks match
the checksums. Processes of a node that fetch the same file fetch it once.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fastpersist_dist.format.checksum import BlockHasher
from fastpersist_dist.format.records import ShardRecord
from fastpersist_dist.storage.checked_read import CheckedFile, check_file
from fastpersist_dist.storage.copy import DIRECT_ALIGN, copy_checked, receive_checked, window_plan
from fastpersist_dist.storage.spans import Span, block_spans, chunk_plan
from fastpersist_dist.storage.files import TMP_SUFFIX, made_once
from fastpersist_dist.util.errors import CorruptCheckpointError, FastPersistError

pytestmark = pytest.mark.engine

BLOCK = 4096 + 48  # blocks that never line up with O_DIRECT's alignment


def _records(data: bytes, lengths: list[int]) -> list[ShardRecord]:
    """Records of ``lengths`` bytes back to back over ``data``, with their block checksums."""
    records, offset = [], 0
    for i, n in enumerate(lengths):
        hasher = BlockHasher(BLOCK)
        hasher.update(data[offset : offset + n])
        sums = tuple(hasher.finish())
        records.append(ShardRecord(f"t{i}", "tensor", "uint8", (n,), (n,), (0,), None, 0, None, 0, "f.distcp",
                                   offset, n, sums))
        offset += n
    assert offset == len(data)
    return records


def _file(directory: Path | str, lengths: list[int], seed: int = 0) -> tuple[str, bytes, list[Span]]:
    data = np.random.default_rng(seed).integers(0, 256, sum(lengths), dtype=np.uint8).tobytes()
    src = os.path.join(directory, "src.distcp")
    with open(src, "wb") as f:
        f.write(data)
    return src, data, block_spans(_records(data, lengths), BLOCK, len(data), src)


LENGTHS = [[], [1], [4095], [DIRECT_ALIGN], [3 * BLOCK + 5], [100, 70_000, 9, 33_333, 200_000, 4 * BLOCK]]


@pytest.mark.parametrize("lengths", LENGTHS)
@pytest.mark.parametrize("window", [1, 8192, 20_000, 1 << 20])
def test_the_window_plan_writes_every_byte_once_and_checks_every_block_once(tmp_path, lengths, window):
    _, data, spans = _file(tmp_path, lengths)
    windows = window_plan(spans, len(data), window)
    if not data:
        assert windows == []
        return
    step = windows[0].stop - windows[0].start
    assert windows[0].start == 0 and step % DIRECT_ALIGN in (0, len(data) % DIRECT_ALIGN)
    assert all(w.stop - w.start == step >= window and step % DIRECT_ALIGN == 0 for w in windows[:-1])
    assert windows[-1].stop - windows[-1].start <= step
    assert all(a.stop == b.start for a, b in zip(windows, windows[1:]))
    assert (windows[-1].stop if windows else 0) == len(data)
    assert [s for w in windows for s in w.spans] == spans  # each block checked once, in order
    for i, w in enumerate(windows):
        assert all(w.start <= s.start < w.stop for s in w.spans)
        assert w.read_end == max([w.stop] + [s.end for s in w.spans])
        assert w.read_end - w.stop < max(step, DIRECT_ALIGN)  # a block spills into the next window only
        if i + 1 < len(windows):  # what spills is carried: the next window starts where this one stopped
            assert w.read_end <= windows[i + 1].stop


def test_a_window_smaller_than_a_block_grows_to_hold_one(tmp_path):
    _, data, spans = _file(tmp_path, [5 * BLOCK])
    windows = window_plan(spans, len(data), 1)
    assert windows[0].stop - windows[0].start == -(-BLOCK // DIRECT_ALIGN) * DIRECT_ALIGN


@pytest.fixture(params=["disk", "tmpfs"])
def dst_dir(request, tmp_path) -> str:
    """A destination on the disk (written with O_DIRECT) or on tmpfs (buffered)."""
    if request.param == "disk":
        return str(tmp_path)
    return request.getfixturevalue("shm_dir")


@pytest.fixture(params=["disk", "tmpfs"])
def src_dir(request, tmp_path) -> str:
    """A source on the disk (read into buffers) or on tmpfs (mapped: ``storage/copy.py``'s ``_copy_windows``)."""
    if request.param == "disk":
        return str(tmp_path)
    return request.getfixturevalue("shm_dir")


@pytest.mark.parametrize("lengths", LENGTHS)
@pytest.mark.parametrize("window", [8192, 20_000, 1 << 20])
def test_a_copy_is_the_same_bytes(src_dir, dst_dir, lengths, window):
    src, data, spans = _file(src_dir, lengths)
    dst = os.path.join(dst_dir, "dst.distcp")
    copy_checked(src, dst, spans, len(data), "rank 0", window)
    with open(dst, "rb") as f:
        assert f.read() == data
    assert not [n for n in os.listdir(dst_dir) if n.endswith(TMP_SUFFIX)]


@pytest.mark.parametrize("where", [0, 20_000, 20_000 + BLOCK // 2, -1])
def test_a_flipped_byte_in_the_source_is_named_and_nothing_is_written(src_dir, dst_dir, where):
    """Wherever the damage is (first window, a block that straddles two windows, the last byte), the copy
    stops naming the file and the offset, and the destination stays as it was: absent."""
    src, data, spans = _file(src_dir, [100, 70_000, 9, 33_333, 200_000])
    offset = where % len(data)
    with open(src, "r+b") as f:
        f.seek(offset)
        f.write(bytes([data[offset] ^ 0x10]))
    dst = os.path.join(dst_dir, "dst.distcp")
    with pytest.raises(CorruptCheckpointError) as e:
        copy_checked(src, dst, spans, len(data), "rank 3", 20_000)
    block_start = max(s.start for s in spans if s.start <= offset)
    assert f"rank 3: checksum mismatch in {src} at byte offset {block_start} " in str(e.value)
    assert not [n for n in os.listdir(dst_dir) if n.startswith("dst.distcp")]


def test_a_file_checked_in_place_names_its_first_damaged_block(src_dir):
    """What an object-store client reading the file itself is given: a file whose blocks were checked (read into
    a buffer from a disk, mapped on tmpfs)."""
    src, data, spans = _file(src_dir, [100, 70_000, 9, 33_333, 200_000])
    check_file(src, spans, len(data), "rank 2")
    offset = 100 + 70_000 + 9 + 5
    with open(src, "r+b") as f:
        f.seek(offset)
        f.write(bytes([data[offset] ^ 0x01]))
    block_start = max(s.start for s in spans if s.start <= offset)
    with pytest.raises(CorruptCheckpointError, match=f"rank 2: checksum mismatch in {src} at byte offset "
                                                     f"{block_start} "):
        check_file(src, spans, len(data), "rank 2")


def test_a_checked_file_reads_back_every_byte_and_stops_at_a_damaged_block(src_dir):
    """What an upload through a client that reads a file object is given: reads of any size and position
    return the file's bytes, each block checked (read into a buffer from a disk, mapped on tmpfs); a damaged
    block fails the read that reaches it."""
    src, data, spans = _file(src_dir, [100, 70_000, 9, 33_333, 200_000])
    with CheckedFile(src, spans, len(data), "rank 1") as f:
        got = bytearray()
        while piece := f.read(7_777):
            got += piece
        assert bytes(got) == data
        f.seek(-5, os.SEEK_END)
        assert f.read() == data[-5:]
    offset = 100 + 70_000 + 9 + 33_333 + 5
    with open(src, "r+b") as f:
        f.seek(offset)
        f.write(bytes([data[offset] ^ 0x01]))
    block_start = max(s.start for s in spans if s.start <= offset)
    with CheckedFile(src, spans, len(data), "rank 1") as f:
        assert f.read(block_start) == data[:block_start]  # the blocks before the damaged one pass
        with pytest.raises(CorruptCheckpointError, match=f"rank 1: checksum mismatch in {src} at byte offset "
                                                         f"{block_start} "):
            f.read()


def test_a_source_of_the_wrong_size_or_missing_is_refused(tmp_path, dst_dir):
    src, data, spans = _file(tmp_path, [70_000])
    dst = os.path.join(dst_dir, "dst.distcp")
    with open(src, "ab") as f:
        f.write(b"x")
    with pytest.raises(CorruptCheckpointError, match=f"rank 1: {src} has {len(data) + 1} bytes, the index says "
                                                     f"{len(data)}"):
        copy_checked(src, dst, spans, len(data), "rank 1")
    os.unlink(src)
    with pytest.raises(FastPersistError, match=f"rank 1: {src} is missing"):
        copy_checked(src, dst, spans, len(data), "rank 1")
    assert not [n for n in os.listdir(dst_dir) if n.startswith("dst.distcp")]


def test_a_copy_replaces_an_older_file_whole(tmp_path, dst_dir):
    """The destination is renamed into place: a longer older file is not left with a tail of old bytes."""
    dst = os.path.join(dst_dir, "dst.distcp")
    with open(dst, "wb") as f:
        f.write(b"\xff" * 300_000)
    src, data, spans = _file(tmp_path, [70_000, 5], seed=1)
    copy_checked(src, dst, spans, len(data), "rank 0", 8192)
    with open(dst, "rb") as f:
        assert f.read() == data


def test_chunks_asked_for_at_once_are_written_in_order(tmp_path):
    """A source with latency (an object store's ranged reads): the first ``ahead`` chunks are asked for at
    once (they wait for each other here), later ones answer sooner than earlier ones, and the file still
    holds every byte in order."""
    src, data, spans = _file(tmp_path, [100, 70_000, 9, 33_333, 200_000])
    chunks = chunk_plan(spans, 20_000)
    together = threading.Barrier(4, timeout=30)

    def next_chunk(chunk: list[Span]) -> bytes:
        i = chunks.index(chunk)
        if i < 4:
            together.wait()
        time.sleep(0.01 * (len(chunks) - i) / len(chunks))
        return data[chunk[0].start : chunk[-1].end]

    assert len(chunks) > 8
    dst = tmp_path / "dst.distcp"
    receive_checked(chunks, next_chunk, str(dst), src, "rank 0", ahead=4)
    assert dst.read_bytes() == data


def test_a_damaged_chunk_received_is_named_and_nothing_is_written(tmp_path):
    src, data, spans = _file(tmp_path, [100, 70_000, 9, 33_333, 200_000])
    chunks = chunk_plan(spans, 20_000)
    bad = chunks[5]

    def next_chunk(chunk: list[Span]) -> bytes:
        piece = bytearray(data[chunk[0].start : chunk[-1].end])
        if chunk is bad:
            piece[-1] ^= 1
        return bytes(piece)

    with pytest.raises(CorruptCheckpointError, match=f"rank 2: checksum mismatch in s3://b/f at byte offset "
                                                     f"{bad[-1].start} "):
        receive_checked(chunks, next_chunk, str(tmp_path / "dst.distcp"), "s3://b/f", "rank 2", ahead=4)
    assert not [n for n in os.listdir(tmp_path) if n.startswith("dst.distcp")]


def _make_slowly(path: str, log: str) -> None:
    """A fetch: a while on the wire, then the file renamed into place whole; each call noted in ``log``."""
    with open(log, "a") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(0.5)
    with open(path + ".part", "wb") as f:
        f.write(b"fetched")
    os.replace(path + ".part", path)


def _fetch_once(path: str, log: str, start: Any, since: float) -> None:
    start.wait(30)
    made_once(path, lambda: _make_slowly(path, log), since)


@pytest.mark.parametrize("there_before", [False, True])
def test_processes_that_need_the_same_file_make_it_once(tmp_path, there_before):
    """Three processes of a node want the same file at once: one fetches it, the others use it, as does one that
    asks once it is there. A file there before the load started (one found damaged) is fetched again, once."""
    path, log = str(tmp_path / "__0_0.distcp"), str(tmp_path / "log")
    if there_before:
        with open(path, "wb") as f:
            f.write(b"damaged")
        os.utime(path, (time.time() - 60, time.time() - 60))  # written before the load started
    ctx = multiprocessing.get_context("fork")
    start, since = ctx.Event(), time.time()
    procs = [ctx.Process(target=_fetch_once, args=(path, log, start, since)) for _ in range(3)]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert not made_once(path, lambda: _make_slowly(path, log), since)  # a rank that comes after it was made
    with open(log) as f:
        assert len(f.read().split()) == 1
    with open(path, "rb") as f:
        assert f.read() == b"fetched"
