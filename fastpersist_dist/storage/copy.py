"""Moving a data file between tiers in chunks of whole checksum blocks, each block checked before it is passed
on; a destination appears whole or not at all, written with O_DIRECT where it is not in memory (docs/design.md,
"The drain").
"""

from __future__ import annotations

import mmap
import os
import queue
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from itertools import islice
from typing import Callable, Iterator, Optional

from ..util.beside import Beside
from ..util.errors import CorruptCheckpointError, FastPersistError
from .files import process_temporary, replace_durably, reserve_room, unlink_quietly
from .checked_read import in_memory, mapping, open_source
from .mounts import on_memory_filesystem
from .spans import CHUNK_BYTES, Span, check_chunk

DIRECT_ALIGN = 4096  # O_DIRECT's alignment of memory, file offsets and lengths
STAGING_BYTES = CHUNK_BYTES  # an O_DIRECT destination's page-aligned staging buffer


class AtomicFile:
    """A file written under a temporary name and renamed into place only by :meth:`commit` (fsynced).

    With O_DIRECT (see the module) the bytes pass through a page-aligned
    staging buffer, written in whole aligned blocks; the last one is padded and
    the file cut back to its length at :meth:`commit`.
    """

    def __init__(self, path: str):
        self.path = path
        self._tmp = process_temporary(path)
        self._fd: Optional[int] = None
        self._staging: Optional[mmap.mmap] = None
        self._staged = 0  # bytes in the staging buffer, not yet written
        self._length = 0  # bytes given to write()
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        if not on_memory_filesystem(os.path.dirname(path) or "."):
            if hasattr(os, "O_DIRECT"):
                try:
                    self._fd = os.open(self._tmp, flags | os.O_DIRECT, 0o644)
                    self._staging = mmap.mmap(-1, STAGING_BYTES)
                except OSError:  # the filesystem refuses O_DIRECT: through the page cache
                    self._fd = None
        if self._fd is None:
            self._fd = os.open(self._tmp, flags, 0o644)

    def reserve(self, nbytes: int, who: str) -> None:
        """Allocate the file's ``nbytes`` before writing them (a copy into a persistent directory:
        ``files.reserve_room``)."""
        assert self._fd is not None and not self._length
        reserve_room(self._fd, self.path, nbytes, who)

    def write(self, data: bytes | memoryview, aligned: bool = False) -> None:
        """Append ``data``. ``aligned``: it starts at a DIRECT_ALIGN-aligned address (a page-aligned buffer),
        so with nothing staged its whole aligned blocks go to the file as they are, not through the staging
        buffer."""
        assert self._fd is not None
        view = memoryview(data).cast("B")
        self._length += len(view)
        if self._staging is None:
            _write_all(self._fd, view)
            return
        if aligned and not self._staged:
            direct = len(view) // DIRECT_ALIGN * DIRECT_ALIGN
            _write_all(self._fd, view[:direct])
            view = view[direct:]
        while view:
            n = min(len(view), STAGING_BYTES - self._staged)
            self._staging[self._staged : self._staged + n] = view[:n]
            self._staged += n
            view = view[n:]
            if self._staged == STAGING_BYTES:
                self._flush(STAGING_BYTES)

    def _flush(self, nbytes: int) -> None:
        """Write the staging buffer's first ``nbytes`` (a multiple of DIRECT_ALIGN); keep the rest at its start."""
        assert self._fd is not None and self._staging is not None
        _write_all(self._fd, memoryview(self._staging)[:nbytes])
        rest = self._staged - nbytes
        if rest:
            self._staging.move(0, nbytes, rest)
        self._staged = rest

    def commit(self) -> None:
        assert self._fd is not None
        if self._staging is not None and self._staged:
            padded = -(-self._staged // DIRECT_ALIGN) * DIRECT_ALIGN
            self._staging[self._staged : padded] = bytes(padded - self._staged)
            self._staged = padded
            self._flush(padded)
        if self._staging is not None:  # the last block's padding
            os.ftruncate(self._fd, self._length)
        os.fsync(self._fd)
        self._close()
        replace_durably(self._tmp, self.path)
        self._tmp = ""

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._staging is not None:
            self._staging.close()
            self._staging = None

    def abandon(self) -> None:
        """Remove the temporary file (after a failure): the destination stays as it was."""
        self._close()
        if self._tmp:
            unlink_quietly(self._tmp)


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view):]


@contextmanager
def _written_whole(dst: str, where: str, who: str, reserve: Optional[int] = None) -> Iterator[AtomicFile]:
    """``dst`` as an :class:`AtomicFile` (``reserve`` bytes allocated first, if given), committed when the block
    ends and abandoned where it raises; an error other than ours is raised as ``FastPersistError`` naming both
    ends (``where``: the source)."""
    out = None
    try:
        out = AtomicFile(dst)
        if reserve is not None:
            out.reserve(reserve, who)
        yield out
        out.commit()
    except BaseException as e:
        if out is not None:
            out.abandon()
        if isinstance(e, FastPersistError) or not isinstance(e, Exception):  # ours name the damaged block
            raise
        raise FastPersistError(f"{who}: copying {where} to {dst} failed: {type(e).__name__}: {e}") from e


def receive_checked(chunks: list[list[Span]], next_chunk: Callable[[list[Span]], bytes | memoryview], dst: str,
                    where: str, who: str, ahead: int = 1) -> float:
    """Write ``dst`` from ``next_chunk(chunk)`` for each chunk in order, each checked first; the seconds it took.

    ``ahead``: chunks asked for at once, ``next_chunk`` called from as many
    threads (a source with latency: an object store's ranged reads), written
    in order. ``where`` names the source in errors. Raises
    ``CorruptCheckpointError`` at the first damaged block, ``FastPersistError``
    on any other failure; ``dst`` is then left as it was.
    """
    start = time.perf_counter()
    with _written_whole(dst, where, who) as out, \
            ThreadPoolExecutor(max(1, ahead), thread_name_prefix="fastpersist-receive") as pool:
        asked = iter(chunks)
        pending = deque((c, pool.submit(next_chunk, c)) for c in islice(asked, max(1, ahead)))
        while pending:
            chunk, data = pending.popleft()
            following = next(asked, None)
            if following is not None:
                pending.append((following, pool.submit(next_chunk, following)))
            received = data.result()
            check_chunk(received, chunk, where, who)
            out.write(received)
    return time.perf_counter() - start


@dataclass(frozen=True)
class Window:
    """One step of :func:`copy_checked`: file bytes [start, stop) are written from a buffer holding bytes
    [start, read_end), after the blocks that start in [start, stop) (``spans``) passed their checksums.

    A block that runs past ``stop`` is checked whole here, and its bytes past
    ``stop`` carried over to the next window's buffer, so that every window is
    written from the start of its buffer (aligned for O_DIRECT) and no byte is
    read twice.
    """

    start: int
    stop: int
    read_end: int
    spans: tuple[Span, ...]


def window_plan(spans: list[Span], size: int, window: int = CHUNK_BYTES) -> list[Window]:
    """The windows of a copy of a ``size``-byte file of blocks ``spans`` (:func:`block_spans`, in file order).

    ``window`` is raised to a multiple of DIRECT_ALIGN that holds the longest
    block, so a block spills at most into the next window.
    """
    longest = max((s.end - s.start for s in spans), default=0)
    window = -(-max(window, longest) // DIRECT_ALIGN) * DIRECT_ALIGN
    windows, i = [], 0
    for start in range(0, size, window):
        stop, first = min(start + window, size), i
        while i < len(spans) and spans[i].start < stop:
            i += 1
        windows.append(Window(start, stop, max(stop, spans[i - 1].end if i > first else stop), tuple(spans[first:i])))
    return windows


def _read_windows(fd: int, windows: list[Window], free: queue.Queue[Optional[mmap.mmap]],
                  ready: queue.Queue[tuple[Window, mmap.mmap, mmap.mmap] | BaseException], where: str, who: str,
                  mapped: bool) -> None:
    """The reading end of a windowed copy: each window read into a free buffer (``mapped``: mapped from the file
    instead, see :func:`_copy_windows`), and its blocks checked, in order."""
    try:
        previous: Optional[tuple[Window, mmap.mmap]] = None
        for w in windows:
            buffer = free.get()
            if buffer is None:  # the writing end gave up
                return
            if mapped:
                data = mapping(fd, w.read_end - w.start, w.start)
            else:
                data, carried = buffer, 0
                if previous is not None:  # bytes past the previous window's stop, checked there
                    pw, pbuffer = previous
                    carried = pw.read_end - w.start
                    buffer[:carried] = pbuffer[w.start - pw.start : pw.read_end - pw.start]
                want = w.read_end - w.start - carried
                got = os.preadv(fd, [memoryview(buffer)[carried : carried + want]], w.start + carried) if want else 0
                if got != want:
                    raise CorruptCheckpointError(f"{who}: short read of {where} at byte {w.start + carried + got}")
                previous = (w, buffer)
            if w.spans:
                base = w.spans[0].start - w.start
                check_chunk(memoryview(data)[base : base + w.spans[-1].end - w.spans[0].start], list(w.spans), where,
                            who)
            ready.put((w, data, buffer))
    except BaseException as e:  # noqa: BLE001 - handed to the writing end, which raises it
        ready.put(e)


def _copy_windows(fd: int, out: AtomicFile, windows: list[Window], where: str, who: str, mapped: bool) -> None:
    """``windows`` of ``fd`` (``where``) appended to ``out``: a thread reads and checks the next window while
    this one writes the last (two page-aligned buffers), so a copy takes about as long as the slower of reading
    and writing, and no byte is copied in memory on the way to an O_DIRECT destination.

    ``mapped`` (a source in memory, a tmpfs): each window is mapped from the
    file instead of read into a buffer, checked there and written from the
    file's own pages, which saves the copy into the buffer (about 40 % of the
    CPU a copy of a tmpfs file to a disk takes). Its bytes are checked just
    before they are written rather than in a private buffer: a source changed
    in between (nothing writes a copy the drain reads) would reach the
    destination unlike its checksums, which every load verifies.
    """
    if not windows:
        return
    free: queue.Queue[Optional[mmap.mmap]] = queue.Queue()
    ready: queue.Queue[tuple[Window, mmap.mmap, mmap.mmap] | BaseException] = queue.Queue()
    most = -(-max(w.read_end - w.start for w in windows) // DIRECT_ALIGN) * DIRECT_ALIGN
    for _ in range(min(2, len(windows))):  # unmapped when no view of them is left (an error may hold one)
        free.put(mmap.mmap(-1, most))  # mapped: a window in flight each, never touched
    reader = Beside(partial(_read_windows, fd, windows, free, ready, where, who, mapped),
                    "fastpersist-copy-read")
    try:
        for _ in windows:
            item = ready.get()
            if isinstance(item, BaseException):
                raise item
            w, data, buffer = item
            out.write(memoryview(data)[: w.stop - w.start], aligned=True)
            del item, data  # a mapped window is unmapped once the reader moved on too
            free.put(buffer)
    finally:
        free.put(None)  # a reader still waiting for a buffer stops
        reader.join()


def copy_checked(src: str, dst: str, spans: list[Span], size: int, who: str, window: int = CHUNK_BYTES,
                 reserve: bool = False) -> float:
    """Copy data file ``src`` (``size`` bytes, ``spans`` its blocks: :func:`block_spans`) to ``dst``, ``window``
    bytes per step (:func:`window_plan`), each block checked before it is written; the seconds it took.
    ``reserve``: its bytes allocated first (a copy into a persistent directory: ``files.reserve_room``).

    Raises like :func:`receive_checked`.
    """
    start = time.perf_counter()
    fd = open_source(src, who, size)
    try:
        with _written_whole(dst, src, who, size if reserve else None) as out:
            _copy_windows(fd, out, window_plan(spans, size, window), src, who, in_memory(src))
    finally:
        os.close(fd)
    return time.perf_counter() - start
