"""Loads as a stream of large O_DIRECT aio reads into a locked double buffer, verified, then copied out.

The loader's box reads become pieces (one contiguous byte range of one record,
widened to whole checksum blocks) and the pieces, in file order, become batches
(one aligned byte range of one file that fits a slot of the locked buffer of
DeepSpeed's aio handle). While the handle's threads read batch k+1 into one
slot, this thread verifies every checksum block of batch k in the other slot
and only then copies its elements into the destination tensors: the device
stays busy, and no byte reaches a destination before its block was verified.

Why not straight into the destinations: O_DIRECT needs page-aligned memory and
DeepSpeed bounces any buffer it has not locked itself, so a read into a plain
tensor would cost the same copy plus a locked allocation per read.
DeepSpeed reports no failed aio read (the event results are not checked); a
failed read leaves stale bytes in the slot, which the checksums catch. That is
why only verified loads take this path (see ``use_stream``).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from ..format.checksum import digest_bytes
from ..format.layout import Extent, Shape, blocks_touched, c_strides, coalesce, contiguous_runs
from ..format.records import ShardRecord, dtype_from_name
from ..util.errors import FastPersistError
from .deepspeed_ops import AioResources
from .host_copy import copies_on_this_thread
from .mounts import on_memory_filesystem
from .reader import MAX_READ_GAP, ShardReader, halves, split_axis

logger = logging.getLogger(__name__)

# One slot of the double buffer (at most half the locked buffer: the default 256 MiB buffer's
# halves). A read's last aio blocks drain the device's queue before the next read is
# submitted (DeepSpeed's wait() waits for every pending block), so fewer, larger reads keep
# it fuller: 128 MiB slots read close to the device bound, 64 MiB ones well below it, though
# their first read and last copy, which nothing overlaps, are shorter (docs/performance.md).
SLOT_BYTES = 128 << 20
# O_DIRECT offsets, lengths and addresses are multiples of this (the logical block of
# most devices and the page size; DeepSpeed's own minimum is 512).
ALIGN = 4096


@dataclass(frozen=True)
class BoxRead:
    """One planned read: the sub-box (in ``extent`` coordinates) of a stored extent, into ``dest``."""

    record: ShardRecord
    extent: Extent
    sub_off: Shape
    sub_shape: Shape
    dest: torch.Tensor


@dataclass(frozen=True)
class Piece:
    """Bytes [lo, hi) of a data file (absolute offsets) that hold all of ``box``."""

    box: BoxRead
    lo: int
    hi: int


@dataclass
class Batch:
    """One read of file bytes [lo, hi) (``lo`` aligned) holding every byte of ``pieces``."""

    file: str
    lo: int
    hi: int
    pieces: list[Piece] = field(default_factory=list)


def needed_ranges(read: BoxRead, block: Optional[int]) -> list[tuple[int, int]]:
    """Record-relative byte ranges holding the sub-box (gaps up to MAX_READ_GAP read through).

    ``block``: widened to whole checksum blocks of this size (None: exact bytes).
    """
    rec, ext = read.record, read.extent
    size = dtype_from_name(rec.dtype).itemsize
    starts, run = contiguous_runs(ext.shape, read.sub_off, read.sub_shape)
    ranges = coalesce(starts * size + rec.data_offset + ext.byte_start, run * size, MAX_READ_GAP)
    return blocks_touched(ranges, block, rec.length) if block else ranges


def split_into_pieces(read: BoxRead, block: Optional[int], limit: int) -> list[Piece]:
    """Pieces of one read, each one byte range of at most ``limit`` bytes without a gap above MAX_READ_GAP.

    ``block``: widen to whole checksum blocks of this size (None: exact bytes).
    Splitting halves the sub-box along its first axis longer than 1, as often as needed.
    """
    rec, ext = read.record, read.extent
    ranges = needed_ranges(read, block)
    lo, hi = ranges[0][0], ranges[-1][1]
    if (len(ranges) > 1 or hi - lo > limit) and split_axis(read.sub_shape) is not None:
        return [p for off, shape, part in halves(read.sub_off, read.sub_shape, read.dest)
                for p in split_into_pieces(BoxRead(rec, ext, off, shape, part), block, limit)]
    if hi - lo > limit:
        raise ValueError(f"one element of {rec.describe()} needs {hi - lo} bytes, above the {limit}-byte slot")
    return [Piece(read, rec.offset + lo, rec.offset + hi)]


def into_batches(pieces: list[Piece], slot_bytes: int, align: int) -> list[Batch]:
    """Pieces in file order, grouped into reads of at most ``slot_bytes`` aligned bytes.

    A piece joins the current batch when it is in the same file, starts at most
    MAX_READ_GAP bytes past its end and the widened batch still fits a slot.
    Every piece must fit a slot on its own (``limit`` = slot_bytes - 2 * align).
    """
    out: list[Batch] = []
    for p in sorted(pieces, key=lambda p: (p.box.record.file, p.lo, p.hi)):
        cur = out[-1] if out else None
        if (cur is not None and cur.file == p.box.record.file and p.lo - cur.hi <= MAX_READ_GAP
                and _align_up(max(cur.hi, p.hi), align) - cur.lo <= slot_bytes):
            cur.hi = max(cur.hi, p.hi)
            cur.pieces.append(p)
        else:
            out.append(Batch(p.box.record.file, p.lo // align * align, p.hi, [p]))
    return out


def _align_up(n: int, align: int) -> int:
    return -(-n // align) * align


class StreamReader:
    """Runs a load's box reads through one aio handle and its locked buffer (two slots)."""

    def __init__(self, reader: ShardReader, aio: AioResources, slot_bytes: int = SLOT_BYTES):
        self.reader = reader
        self.handle = aio.handle
        self.align = max(ALIGN, self.handle.get_alignment())
        self.slot_bytes = min(slot_bytes, aio.buffer.numel() // 2) // self.align * self.align
        self.slots = [aio.buffer[i * self.slot_bytes : (i + 1) * self.slot_bytes] for i in range(2)]
        self.block = reader.index.checksum_block_bytes
        self.seconds = {"wait for reads": 0.0, "verify": 0.0, "copy": 0.0}
        self.bytes_read = 0
        self._pending = False  # an aio read into a slot is in flight

    def fits(self) -> bool:
        """Whether a slot holds two checksum blocks and the alignment slack: the most one element can need."""
        return self.slot_bytes - 2 * self.align >= 2 * self.block

    def run(self, reads: list[BoxRead], done: Callable[[torch.Tensor], None]) -> None:
        """Read, verify and copy out every read; ``done(dest)`` with each piece's part of its destination once in place."""
        with copies_on_this_thread():
            self._run(reads, done)

    def _run(self, reads: list[BoxRead], done: Callable[[torch.Tensor], None]) -> None:
        limit = self.slot_bytes - 2 * self.align
        pieces = [p for read in reads for p in split_into_pieces(read, self.block, limit)]
        batches = into_batches(pieces, self.slot_bytes, self.align)
        self.reader.open_all({b.file for b in batches})  # size checks first: reads never run past a file's end
        try:
            if batches:
                self._submit(batches[0], self.slots[0])
            for i, batch in enumerate(batches):
                start = time.perf_counter()
                self._wait()
                self.seconds["wait for reads"] += time.perf_counter() - start
                if i + 1 < len(batches):
                    self._submit(batches[i + 1], self.slots[(i + 1) % 2])
                self._consume(batch, self.slots[i % 2], done)
        finally:
            self._wait()  # on errors too: the slot must not be reused, nor the handle left busy
        logger.debug("fastpersist: %s: %d pieces in %d reads of %.3f GiB in all; %s", self.reader.who, len(pieces),
                     len(batches), self.bytes_read / 2**30, ", ".join(f"{k} {v:.3f} s" for k, v in self.seconds.items()))

    def _wait(self) -> None:
        """Wait for the pending aio read, if any (DeepSpeed's wait() must not be called with none)."""
        if self._pending:
            self.handle.wait()
            self._pending = False

    def _submit(self, batch: Batch, slot: torch.Tensor) -> None:
        """Start reading ``batch`` into ``slot``.

        The aligned part goes through aio; bytes past the last whole aligned block
        of the file (O_DIRECT cannot read them, DeepSpeed refuses reads past the
        end) through pread, now.
        """
        size = self.reader.index.files[batch.file]
        direct_end = min(_align_up(batch.hi, self.align), size // self.align * self.align)
        self.bytes_read += batch.hi - batch.lo
        if direct_end > batch.lo:
            path = self.reader.path(batch.file)
            if self.handle.async_pread(slot[: direct_end - batch.lo], path, batch.lo) != 0:
                raise OSError(f"{self.reader.who}: aio read of {path} at byte {batch.lo} could not start")
            self._pending = True
        tail = max(direct_end, batch.lo)
        if batch.hi > tail:
            self.reader.pread_at(batch.file, slot[tail - batch.lo : batch.hi - batch.lo], tail,
                                 f"the end of {batch.file}")

    def _consume(self, batch: Batch, slot: torch.Tensor, done: Callable[[torch.Tensor], None]) -> None:
        """Verify every block the batch's pieces touch (each once), then copy each piece out."""
        start = time.perf_counter()
        while (bad := self._first_bad_block(batch, slot.numpy())) is not None:
            # a damaged copy: the batch's bytes again from the file's next copy, if it has one
            error = self.reader.checksum_error(*bad)
            if not self.reader.next_copy(batch.file, str(error)):
                raise error
            self.reader.pread_at(batch.file, slot[: batch.hi - batch.lo], batch.lo, f"bytes of {batch.file}")
        copied = time.perf_counter()
        self.seconds["verify"] += copied - start
        for piece in batch.pieces:
            _copy_out(piece.box, slot, batch.lo)
            done(piece.box.dest)
        self.seconds["copy"] += time.perf_counter() - copied

    def _first_bad_block(self, batch: Batch, data: Any) -> Optional[tuple[ShardRecord, int]]:
        """The first (record, block) the batch's pieces touch whose bytes in ``data`` fail their checksum."""
        verified: set[tuple[int, int]] = set()
        for piece in batch.pieces:
            rec = piece.box.record
            for k in range((piece.lo - rec.offset) // self.block, _align_up(piece.hi - rec.offset, self.block) // self.block):
                if (rec.offset, k) in verified:
                    continue
                a = rec.offset + k * self.block - batch.lo
                b = min(a + self.block, rec.offset + rec.length - batch.lo)
                if digest_bytes(data[a:b]) != rec.checksums[k]:
                    return rec, k
                verified.add((rec.offset, k))
        return None


def _copy_out(read: BoxRead, slot: torch.Tensor, slot_lo: int) -> None:
    """Copy the sub-box's elements from ``slot`` (file bytes from ``slot_lo``) into its destination."""
    rec, ext = read.record, read.extent
    dtype = dtype_from_name(rec.dtype)
    size = dtype.itemsize
    strides = c_strides(ext.shape)
    first = sum(o * s for o, s in zip(read.sub_off, strides))
    last = sum((o + n - 1) * s for o, n, s in zip(read.sub_off, read.sub_shape, strides))
    start = rec.offset + rec.data_offset + ext.byte_start + first * size - slot_lo
    raw = slot[start : start + (last + 1 - first) * size]
    if start % size:  # elements not aligned in the file (after an odd-length object record)
        raw = raw.clone()
    read.dest.copy_(torch.as_strided(raw.view(dtype), read.sub_shape, strides))


def open_stream(reader: ShardReader, aio: Callable[[], AioResources], direct_io: str) -> Optional[StreamReader]:
    """The stream for this load, or None where plain pread is the better or the only way.

    pread where checksums are off (a failed aio read would go unnoticed), where
    ``direct_io`` is "off", on in-memory filesystems, and (with one log line)
    where the aio op, its locked buffer or O_DIRECT is unavailable; with
    ``direct_io="on"`` those last ones raise.
    """
    if direct_io == "off" or not reader.verify or not reader.index.files:
        return None
    first = min(reader.index.files)
    if direct_io == "auto" and on_memory_filesystem(os.path.dirname(reader.path(first))):
        return None
    try:
        stream = StreamReader(reader, aio())
        probe = reader.path(first)
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
    except (RuntimeError, OSError) as e:  # no aio op, memlock limit, O_DIRECT refused (EINVAL)
        if direct_io == "on":
            raise FastPersistError(f"{reader.who}: direct_io='on' but {e}") from e
        logger.info("fastpersist: %s: loading %s with pread: %s", reader.who, reader.dir, e)
        return None
    return stream if stream.fits() else None
