"""Reading a local data file's bytes checked against its index: whole (:func:`check_file`), as a file object
for a client that pulls the bytes itself (:class:`CheckedFile`: an object store's upload), or its pages mapped
to send them (:func:`pages_to_send`).

A file on an in-memory filesystem (a tmpfs) is mapped rather than read: its
blocks are checked and passed on where they are, not copied into buffers first.
"""

from __future__ import annotations

import io
import mmap
import os
from bisect import bisect_right
from typing import Optional

from ..util.errors import CorruptCheckpointError, FastPersistError
from .mounts import on_memory_filesystem
from .spans import Span, check_chunk, chunk_plan

def in_memory(src: str) -> bool:
    """Whether ``src`` is on an in-memory filesystem: its windows are mapped, not read (:func:`_copy_windows`)."""
    return on_memory_filesystem(os.path.dirname(src) or ".")


def mapping(fd: int, length: int, offset: int = 0, writable: bool = False) -> mmap.mmap:
    """Bytes [offset, offset + length) of the file ``fd``, mapped read-only (``offset`` page-aligned); or
    ``writable``, copy-on-write: for a consumer that takes only writable memory (a tensor), never written."""
    if writable:
        return mmap.mmap(fd, length, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=offset)
    return mmap.mmap(fd, length, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, offset=offset)


def _mappable(src: str, size: int) -> bool:
    """Whether ``size`` bytes of ``src`` are better mapped than read: some, in memory (nothing to read ahead)."""
    return bool(size) and in_memory(src)


def mapped_if_in_memory(fd: int, src: str, size: int) -> Optional[memoryview]:
    """The whole of ``src`` (open as ``fd``, ``size`` bytes) mapped where it is in memory, else None: read it."""
    return memoryview(mapping(fd, size)) if _mappable(src, size) else None


def sendable_in_place(fd: int, src: str, size: int) -> bool:
    """Whether ``src`` (open as ``fd``) is in memory and holds ``size`` bytes: sent from its own pages
    (:func:`pages_to_send`), its bytes are copied once (into the socket) rather than twice."""
    return _mappable(src, size) and os.fstat(fd).st_size >= size


def pages_to_send(fd: int, start: int, end: int) -> memoryview:
    """Bytes [start, end) of the file ``fd``, mapped copy-on-write: writable for a consumer that takes only
    writable memory (a tensor to send), never written; unmapped when the last view of it goes."""
    base = start - start % mmap.ALLOCATIONGRANULARITY
    return memoryview(mapping(fd, end - base, base, writable=True))[start - base :]


def open_source(src: str, who: str, size: int) -> int:
    """``src`` opened for reading, once it is found to hold the ``size`` bytes its index says."""
    try:
        fd = os.open(src, os.O_RDONLY)
    except FileNotFoundError:
        raise FastPersistError(f"{who}: {src} is missing") from None
    except OSError as e:
        raise FastPersistError(f"{who}: cannot open {src}: {e}") from e
    actual = os.fstat(fd).st_size
    if actual != size:
        os.close(fd)
        raise CorruptCheckpointError(f"{who}: {src} has {actual} bytes, the index says {size}")
    return fd


def read_chunk_into(fd: int, chunk: list[Span], buffer: bytearray, where: str, who: str) -> memoryview:
    """The bytes of ``chunk`` read from ``fd`` into ``buffer`` (reused: no page faults per chunk); not checked."""
    want = chunk[-1].end - chunk[0].start
    view = memoryview(buffer)[:want]
    got = os.preadv(fd, [view], chunk[0].start)
    if got != want:
        raise CorruptCheckpointError(f"{who}: short read of {where} at byte {chunk[0].start + got}")
    return view


def check_file(src: str, spans: list[Span], size: int, who: str) -> None:
    """Every block of the local data file ``src`` (``size`` bytes, ``spans`` its blocks) against its checksum,
    read a chunk at a time into one reused buffer (in memory, a tmpfs: hashed where it is, mapped); raises
    ``CorruptCheckpointError`` naming the first bad one."""
    fd = open_source(src, who, size)
    try:
        chunks = chunk_plan(spans)
        whole = mapped_if_in_memory(fd, src, size)
        if whole is not None:
            for chunk in chunks:
                check_chunk(whole[chunk[0].start : chunk[-1].end], chunk, src, who)
            return
        buffer = bytearray(max((c[-1].end - c[0].start for c in chunks), default=0))
        for chunk in chunks:
            check_chunk(read_chunk_into(fd, chunk, buffer, src, who), chunk, src, who)
    finally:
        os.close(fd)


class CheckedFile(io.RawIOBase):
    """A local data file, read-only and seekable, whose reads return only bytes checked against the index.

    For clients that pull a file's bytes themselves (an object store's upload):
    each checksum block a read touches is read whole and checked once; the
    last one is kept, so sequential reads of any size read every byte once.
    A file in memory (a tmpfs) is mapped: its blocks are checked and passed on
    where they are, not read into buffers first.
    """

    def __init__(self, path: str, spans: list[Span], size: int, who: str):
        super().__init__()
        self.path, self._spans, self._size, self._who = path, spans, size, who
        self._fd = -1  # until open: a close() (the garbage collector's) must not close a reused number
        self._fd = open_source(path, who, size)
        self._mapped = mapped_if_in_memory(self._fd, path, size)
        self._pos = 0
        self._held: tuple[int, memoryview] = (-1, memoryview(b""))  # (span index, its checked bytes)
        self._starts = [s.start for s in spans]

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        out = memoryview(buffer).cast("B")
        done = 0
        while done < len(out) and self._pos < self._size:
            i = self._span_at(self._pos)
            span, data = self._spans[i], self._checked(i)
            piece = data[self._pos - span.start : self._pos - span.start + len(out) - done]
            out[done : done + len(piece)] = piece
            done += len(piece)
            self._pos += len(piece)
        return done

    def close(self) -> None:
        if not self.closed and self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._mapped = None  # unmapped once the last block handed out is dropped too
        self._held = (-1, memoryview(b""))
        super().close()

    def _span_at(self, pos: int) -> int:
        return bisect_right(self._starts, pos) - 1

    def _checked(self, i: int) -> memoryview:
        if self._held[0] != i:
            chunk = [self._spans[i]]
            if self._mapped is not None:
                data = self._mapped[chunk[0].start : chunk[-1].end]
            else:
                data = read_chunk_into(self._fd, chunk, bytearray(chunk[0].end - chunk[0].start), self.path,
                                       self._who)
            check_chunk(data, chunk, self.path, self._who)
            self._held = (i, data)  # its own buffer (or the mapping's bytes), checked once per block
        return self._held[1]
