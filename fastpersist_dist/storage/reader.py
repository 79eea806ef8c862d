"""Reading parts of stored shards into destination tensors, verifying checksums.

Plain ``pread`` into the destination (or a small staging buffer) is used: it
needs no native op, so a checkpoint loads anywhere. Only the bytes a request
needs are read; with verification on, reads widen to whole checksum blocks and
every block read is checked before its bytes are used.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable, Iterable, Optional, Protocol

import torch

from ..format.checksum import first_bad_block
from ..format.layout import Extent, Shape, blocks_touched, c_strides, coalesce, contiguous_runs
from ..format.records import CheckpointIndex, ShardRecord, dtype_from_name, tensor_bytes
from ..util.errors import CorruptCheckpointError, FastPersistError
from ..util.events import NEXT_COPY, event

logger = logging.getLogger(__name__)

# Gaps up to this size between needed runs are read through rather than skipped.
MAX_READ_GAP = 256 << 10
# Staging buffers larger than this are avoided by splitting the request.
MAX_STAGING_BYTES = 256 << 20
# One pread of at most this much: cold buffered reads in calls of a few MiB keep the kernel's
# readahead ahead of the copy; far larger calls ran at a fraction of that speed.
READ_CALL_BYTES = 8 << 20
# Whole-record verification reads this much at a time.
VERIFY_CHUNK_BYTES = 64 << 20


class CopySource(Protocol):
    """Where the copies of a checkpoint's data files are (a tiered checkpoint's: ``engine/tiers/copies.py``)."""

    def of(self, name: str) -> tuple[str, ...]:
        """The directories known to hold a copy of data file ``name``, nearest first."""

    def further(self, name: str) -> bool:
        """Look for copies of ``name`` beyond those known (they all failed); whether one was found."""

    def why_missing(self, name: str) -> str:
        """Why no copy of ``name`` can be read from here."""


class ShardReader:
    """Reads from the data files of one checkpoint; keeps files open until ``close``.

    A data file may have several copies (a tiered checkpoint: the node's local
    tier, then the persistent one, as ``copies`` finds them): a copy that is
    missing, of another size, or whose bytes fail their checksums is left, with
    a warning, for the next one, and the read is done again from there.
    ``fetch``: (a copy that is not a local directory, the local directory its
    files are fetched into, the function fetching one there and returning its
    path): such a copy's file is fetched when first opened.
    """

    def __init__(self, checkpoint_dir: str, index: CheckpointIndex, verify: bool, who: str,
                 copies: Optional[CopySource] = None, fetch: Optional[tuple[str, str, Callable[[str], str]]] = None):
        self.dir = checkpoint_dir
        self.index = index
        self.verify = verify
        self.who = who  # e.g. "rank 3": starts every error message
        self._copies = copies
        self._fetch = fetch
        self._fetched: set[str] = set()
        self._fetching = threading.Lock()
        self._choice: dict[str, int] = {}  # data file -> the copy in use (index into its copies)
        self._fds: dict[str, int] = {}
        self._dropped: list[int] = []  # descriptors of copies left: another read thread may still use one
        self._lock = threading.Lock()
        self._local = threading.local()  # each read thread's staging buffer, see _staging

    def widen(self, index: CheckpointIndex) -> None:
        """Read by ``index`` from now on: the whole index of the one this reader was opened with (which held the
        records of the load's requests), for reads of files beyond them."""
        self.index = index

    def close(self) -> None:
        """Close every file opened so far."""
        for fd in [*self._fds.values(), *self._dropped]:
            os.close(fd)
        self._fds.clear()
        self._dropped.clear()

    def copies_of(self, name: str) -> tuple[str, ...]:
        """The directories holding a copy of data file ``name``, nearest first."""
        return (self.dir,) if self._copies is None else self._copies.of(name)

    def path(self, name: str) -> str:
        """The path of the copy of data file ``name`` that reads use now."""
        copies = self.copies_of(name)
        choice = self._choice.get(name, 0)
        where = copies[choice] if choice < len(copies) else self.dir
        if self._fetch is not None and where == self._fetch[0]:
            where = self._fetch[1]
        return os.path.join(where, name)

    def next_copy(self, name: str, why: str) -> bool:
        """Leave the copy of ``name`` in use (``why``: what is wrong with it) for the next one; whether there is one.

        Safe to call from several read threads: the copy is left once, and its
        descriptor stays open until ``close``.
        """
        with self._lock:
            choice = self._choice.get(name, 0)
            if choice + 1 >= len(self.copies_of(name)) and (self._copies is None or not self._copies.further(name)):
                return False
            fd = self._fds.pop(name, None)
            if fd is not None:
                self._dropped.append(fd)
            self._choice[name] = choice + 1
        logger.warning("fastpersist: %s: %s; reading %s from its next copy, %s", self.who, why, name,
                       self.path(name), extra=event(NEXT_COPY, file=name, why=why))
        return True

    def __enter__(self) -> "ShardReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open_all(self, names: set[str]) -> None:
        """Open (and size-check) ``names`` now, before reads run on several threads."""
        for name in sorted(names):
            self._fd(name)

    def reachable(self, names: Iterable[str]) -> frozenset[str]:
        """Those of ``names`` of which a copy opens here, of the size the index says (each copy tried in turn,
        nearest first; one that fails is left for the next, with a warning)."""
        found = set()
        for name in sorted(set(names)):
            try:
                self._fd(name)
            except FastPersistError as e:
                logger.debug("fastpersist: %s: no copy of %s opens here: %s", self.who, name, e)
                continue
            found.add(name)
        return frozenset(found)

    def _fd(self, name: str) -> int:
        with self._lock:
            fd = self._fds.get(name)
        while fd is None:
            if not self.copies_of(name) and (self._copies is None or not self._copies.further(name)):
                why = "it is in no tier this load knows" if self._copies is None else self._copies.why_missing(name)
                raise FastPersistError(f"{self.who}: no copy of {name} can be read from here: {why}")
            try:
                fd = self._open(name)
            except CorruptCheckpointError as e:
                if not self.next_copy(name, str(e)):
                    raise
                continue
            with self._lock:
                if name in self._fds:  # another read thread opened it meanwhile
                    self._dropped.append(fd)
                    fd = self._fds[name]
                else:
                    self._fds[name] = fd
        return fd

    def _open(self, name: str) -> int:
        """A descriptor of the copy of ``name`` in use, its size checked against the index."""
        copies, choice = self.copies_of(name), self._choice.get(name, 0)
        if self._fetch is not None and choice < len(copies) and copies[choice] == self._fetch[0]:
            with self._fetching:
                if name not in self._fetched:
                    self._fetch[2](name)
                    self._fetched.add(name)
        path = self.path(name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{self.who}: data file {path} listed in the index is missing") from None
        except OSError as e:  # this copy cannot be read (an I/O error, a directory out of reach): the next one may
            raise CorruptCheckpointError(f"{self.who}: data file {path} cannot be opened: {e}") from e
        size = os.fstat(fd).st_size
        if size != self.index.files[name]:
            os.close(fd)
            raise CorruptCheckpointError(
                f"{self.who}: {path} has {size} bytes, the index says {self.index.files[name]} "
                "(truncated or replaced file)"
            )
        return fd

    def pread_at(self, name: str, into: torch.Tensor, pos: int, what: str) -> None:
        """Fill the 1-D uint8 CPU tensor ``into`` with bytes of data file ``name`` from ``pos`` on."""
        self._preadv(name, [memoryview(into.numpy())], pos, what)

    def _preadv(self, name: str, views: list[memoryview], pos: int, what: str) -> None:
        """Fill ``views`` (byte buffers) back to back with bytes of data file ``name`` from ``pos`` on."""
        fd = self._fd(name)
        views = [v for v in views if len(v)]
        while views:
            n = os.preadv(fd, taken(views, READ_CALL_BYTES), pos)
            if n == 0:
                raise CorruptCheckpointError(
                    f"{self.who}: unexpected end of {name} at byte {pos} while reading {what}"
                )
            views, pos = skipped(views, n), pos + n

    def _read_checked(self, record: ShardRecord, pieces: list[torch.Tensor], rel: int) -> None:
        """Fill ``pieces`` (1-D uint8 CPU tensors, back to back from record byte ``rel``, which is block-aligned)
        and verify them, one checksum block at a time: each block is hashed while in cache. A block that fails
        is read again from the file's next copy, if it has one."""
        views = [memoryview(p.numpy()) for p in pieces]
        total = sum(len(v) for v in views)
        step = self.index.checksum_block_bytes if self.verify else total or 1
        for start in range(0, total, step):
            window = taken(skipped(views, start), step)
            while True:
                self._preadv(record.file, window, record.offset + rel + start, record.describe())
                try:
                    self._check(record, window, rel + start)
                    break
                except CorruptCheckpointError as e:
                    if not self.next_copy(record.file, str(e)):
                        raise

    def _check(self, record: ShardRecord, window: list[memoryview], rel: int) -> None:
        """Verify the whole blocks held in ``window``, which starts at block-aligned ``rel``."""
        if not self.verify:
            return
        block = self.index.checksum_block_bytes
        first = rel // block
        count = -(-sum(len(v) for v in window) // block)
        bad = first_bad_block(window, record.checksums[first : first + count], block)
        if bad >= 0:
            raise self.checksum_error(record, first + bad)

    def checksum_error(self, record: ShardRecord, block_index: int) -> CorruptCheckpointError:
        """The error for a block of ``record`` whose bytes do not match its checksum."""
        at = record.offset + block_index * self.index.checksum_block_bytes
        return CorruptCheckpointError(
            f"{self.who}: checksum mismatch in {self.path(record.file)} at byte "
            f"offset {at} (block {block_index} of {record.describe()}): the checkpoint is corrupt"
        )

    def check_record(self, record: ShardRecord) -> None:
        """Read every byte of ``record`` once, in bounded chunks, verifying each block."""
        step = max(1, VERIFY_CHUNK_BYTES // self.index.checksum_block_bytes) * self.index.checksum_block_bytes
        buffer = torch.empty(min(step, record.length), dtype=torch.uint8)
        for rel in range(0, record.length, step):
            self._read_checked(record, [buffer[: min(step, record.length - rel)]], rel)

    def read_object(self, record: ShardRecord) -> bytes:
        """All bytes of an object record, verified."""
        data = torch.empty(record.length, dtype=torch.uint8)
        self._read_checked(record, [data], 0)
        return data.numpy().tobytes()

    def read_box(self, record: ShardRecord, extent: Extent, sub_off: Shape, sub_shape: Shape, dest: torch.Tensor) -> None:
        """Copy the sub-box (in ``extent`` coordinates) of a stored extent into ``dest`` (same shape)."""
        size = dtype_from_name(record.dtype).itemsize
        strides = c_strides(extent.shape)
        first = sum(o * s for o, s in zip(sub_off, strides))
        last = sum((o + n - 1) * s for o, n, s in zip(sub_off, sub_shape, strides))
        span = (last + 1 - first) * size
        starts, run = contiguous_runs(extent.shape, sub_off, sub_shape)
        base = record.data_offset + extent.byte_start
        ranges = coalesce(starts * size + base, run * size, MAX_READ_GAP)
        if self.verify:
            ranges = blocks_touched(ranges, self.index.checksum_block_bytes, record.length)
        saved_dtype = dtype_from_name(record.dtype)
        direct = _direct_target(dest, saved_dtype)
        wanted = (base + first * size, base + (last + 1) * size)
        # One run: its bytes straight into the destination, those of the checksum blocks it touches beyond it
        # (a record's framing, neighbouring elements) into the staging buffer, all in one scattered read.
        if direct is not None and len(starts) == 1 and len(ranges) == 1:
            (lo, hi), (a, b) = ranges[0], wanted
            staging = self._staging(a - lo + hi - b)
            self._read_checked(record, [staging[: a - lo], direct, staging[a - lo :]], lo)
            return
        if span > MAX_STAGING_BYTES and split_axis(sub_shape) is not None:
            for off, shp, part in halves(sub_off, sub_shape, dest):
                self.read_box(record, extent, off, shp, part)
            return
        lo = ranges[0][0]
        staging = self._staging(ranges[-1][1] - lo)
        for a, b in ranges:
            self._read_checked(record, [staging[a - lo : b - lo]], a)
        # Whole checksum blocks may reach into a torch.save archive's trailer: not whole elements.
        elements = staging[: staging.numel() // size * size].view(saved_dtype)
        src = torch.as_strided(elements, sub_shape, strides, (base - lo) // size + first)
        dest.copy_(src)

    def _staging(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of this thread's staging buffer, kept for the reader's next reads.

        A fresh buffer per read faults in fresh pages every time: on tmpfs, where a
        pread is a memory copy, the page faults would cost more than the reads.
        """
        buf = getattr(self._local, "buffer", None)
        if buf is None or buf.numel() < nbytes:
            buf = self._local.buffer = torch.empty(nbytes, dtype=torch.uint8)
        return buf[:nbytes]


def taken(views: list[memoryview], nbytes: int) -> list[memoryview]:
    """The first ``nbytes`` of the buffers ``views`` taken back to back."""
    out = []
    for v in views:
        if nbytes <= 0:
            break
        out.append(v[:nbytes])
        nbytes -= len(out[-1])
    return out


def skipped(views: list[memoryview], nbytes: int) -> list[memoryview]:
    """What follows the first ``nbytes`` of the buffers ``views`` taken back to back."""
    out = []
    for v in views:
        if nbytes >= len(v):
            nbytes -= len(v)
            continue
        out.append(v[nbytes:])
        nbytes = 0
    return out


def halves(sub_off: Shape, sub_shape: Shape, dest: torch.Tensor) -> list[tuple[Shape, Shape, torch.Tensor]]:
    """The two halves of a sub-box along its ``split_axis`` (which must exist): offset, shape, part of ``dest``."""
    axis = split_axis(sub_shape)
    half = sub_shape[axis] // 2
    return [(tuple(o + lo if i == axis else o for i, o in enumerate(sub_off)),
             tuple(n if i == axis else s for i, s in enumerate(sub_shape)),
             dest.narrow(axis, lo, n))
            for lo, n in ((0, half), (half, sub_shape[axis] - half))]


def split_axis(shape: Shape) -> Optional[int]:
    """The first axis longer than 1 (where a box is halved), or None for a single element."""
    for axis, n in enumerate(shape):
        if n > 1:
            return axis
    return None


def _direct_target(dest: torch.Tensor, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """A uint8 view of ``dest``'s bytes if bytes can be read straight into it."""
    if dest.device.type != "cpu" or dest.dtype != dtype or not dest.is_contiguous():
        return None
    return tensor_bytes(dest)
