"""Streaming one rank's shards into its data file, checksumming as bytes pass.

The fast path is DeepSpeed's ``FastFileWriter`` (O_DIRECT + libaio through a
page-locked double bounce buffer). Its traps are handled here: it opens without
``O_TRUNC`` (we unlink first), it reports failed aio writes nowhere (we check
the file size after the final fsync), and some filesystems refuse O_DIRECT (we
fall back, once warned, to a buffered writer producing identical bytes). On
an in-memory filesystem (tmpfs: ``/dev/shm`` as a local tier) O_DIRECT is a
memory copy like any other and the bounce one more, so writes go straight from
the tensors' bytes into the file with plain ``write`` there. The
checksums are computed on a second thread from the caller's bytes while those
bytes are copied and written, and the bounce-buffer copies run on one thread.
Records whose elements are not contiguous host memory (accelerator tensors,
strided views: a synchronous save passes them as they are) are copied to the
host as the write reaches them, a bounded number of bytes ahead
(``HOST_COPY_BYTES``), not all before it starts, into a block of host memory
that the process keeps for its next write (storage/host_staging.py).

A tiered save's write-through copy (``copy_to``) gets the same bytes on a
thread of its own, through a second aio handle and bounce buffer, so that the
persistent tier is written at its own bandwidth while the local tier is written
at its own: the file is done (and its status can be left) when the local tier
is, and the copy follows at the slower tier's pace.

Because a failed aio write can leave a file of the right size with wrong bytes
(a hole, a stale bounce-buffer half), a few checksum blocks are read back from
the device after fsync and compared with what was streamed (see
:func:`confirm_on_disk`) before the rank reports success.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Protocol

import torch

from ..format.checksum import BlockHasher, digest_bytes
from ..format.records import ShardRecord, tensor_bytes, with_checksums
from ..util import progress
from ..util.config import MiB, WriteConfig
from ..util.cores import cores_per_local_rank
from ..util.errors import FastPersistError
from ..util.timing import Phases
from .deepspeed_ops import LockedMemoryError, aio_available, aio_module, aio_resources, ensure_fast_file_writer_usable
from .files import free_bytes, process_temporary, reserve_room, unlink_quietly, written_through_name
from .host_copy import copies_on_this_thread, copy_to_host
from .host_staging import Ring, staging_block
from .mounts import on_memory_filesystem
from .recycle import take

logger = logging.getLogger(__name__)

MODE_DIRECT = "direct"
MODE_BUFFERED = "buffered"
_PAGE = os.sysconf("SC_PAGE_SIZE")
# Host copies (of accelerator tensors, strided views) one write holds at once, made ahead of
# the write position so that the copy of the next record overlaps the aio writes of this one:
# the size of the reused block they go into. A record above it is copied alone, into fresh
# memory. Was: the whole share copied before the first byte went out (a GPU rank's share in
# pageable host memory at once).
HOST_COPY_BYTES = 256 * MiB
# Buffered writes where a rank has under two cores: each piece is hashed right after its write,
# on the same thread, while its bytes are still in the CPU's caches. A checksum thread beside the
# writes would only compete for the cores and read the bytes from memory a second time.
INLINE_PIECE_BYTES = 4 * MiB
COPY_SLOT = 1  # the aio handle and bounce buffer of a write-through copy (deepspeed_ops.aio_resources)
_warned: set[object] = set()


class _Sink(Protocol):
    mode: str

    def write(self, data: torch.Tensor) -> None:
        """Append a 1-D uint8 host tensor."""

    def close(self) -> None:
        """Flush everything and fsync the file."""


class _DirectSink:
    """FastFileWriter over this process's aio handle and bounce buffer."""

    mode = MODE_DIRECT

    def __init__(self, path: str, cfg: WriteConfig, slot: int = 0):
        from deepspeed.io import FastFileWriter, FastFileWriterConfig

        ensure_fast_file_writer_usable()
        res = aio_resources(cfg.aio, slot)
        self._writer = FastFileWriter(
            path,
            FastFileWriterConfig(
                dnvme_handle=res.handle, pinned_tensor=res.buffer, double_buffer=cfg.double_buffer
            ),
        )

    def write(self, data: torch.Tensor) -> None:
        # A storage slice is a zero-copy view of exactly these bytes; save_size=False
        # avoids DeepSpeed's freed-size-tensor bug.
        start = data.storage_offset()
        storage = data.untyped_storage()[start : start + data.numel()]
        self._writer.save_torch_storage_object_list([(storage, torch.uint8)], False)

    def close(self) -> None:
        self._writer.close()


class _BufferedSink:
    """Plain buffered writes + fsync: same bytes, for filesystems without O_DIRECT.

    Opened without truncation and cut to the bytes written at close: a retired
    file put at ``path`` (``storage/recycle.py``) is overwritten in place.
    """

    mode = MODE_BUFFERED

    def __init__(self, path: str):
        self._file = os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT, 0o644), "wb", buffering=0)

    def write(self, data: torch.Tensor) -> None:
        view = memoryview(data.numpy())
        while view:
            view = view[self._file.write(view) :]

    def close(self) -> None:
        try:
            self._file.truncate()
            os.fsync(self._file.fileno())
        finally:
            self._file.close()


class _ThroughCopy:
    """A tiered save's write-through copy of a rank's file: the same bytes, written on a thread of its own
    through a second aio handle and bounce buffer, at the persistent tier's pace.

    The file does not wait for it: the local tier is written at its own speed,
    and the caller leaves the rank's status (and so the local commit may run)
    while the copy goes on; :meth:`finish` then waits for it. It is made
    before the file and holds an exclusive ``flock`` until it is put where the
    drain takes it or removed (or its writer dies): the drain waits on that
    lock for the copy, and a drain that gives the save up waits on it before
    it removes what is there. It never fails the write: its first error drops
    it (its file removed, the cause logged), and the drain copies the file
    instead.
    """

    def __init__(self, copy_to: str, nbytes: int, cfg: WriteConfig, rank: int):
        self.tmp, self._done_as, self._rank = process_temporary(copy_to), written_through_name(copy_to), rank
        self.done = ""  # where the copy is once written and checked (:meth:`finish`)
        unlink_quietly(self._done_as)  # an earlier save's, never taken: the drain takes what is there after this write
        unlink_quietly(self.tmp)  # FastFileWriter opens without O_TRUNC
        self._lock = os.open(self.tmp, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX)
            reserve_room(self._lock, copy_to, nbytes, f"rank {rank}")
            self._copy: _Sink = _open_sink(self.tmp, cfg, COPY_SLOT)
        except BaseException:
            os.close(self._lock)
            _remove_partial(self.tmp)
            raise
        self._copy_open = True
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._failed = ""  # why the thread's write failed

    def start(self, items: list[WriteItem], chunk: int) -> None:
        """Write ``items`` (contiguous host bytes: an async save's snapshot) into the copy, on its own thread."""
        if any(needs_host_copy(item.data) for item in items):
            raise ValueError("a write-through copy is written from host bytes (an async save's snapshot)")
        self._thread = threading.Thread(target=self._write, args=(items, chunk), name="fastpersist-through",
                                        daemon=True)
        self._thread.start()

    def _write(self, items: list[WriteItem], chunk: int) -> None:
        try:
            for item in items:
                for piece in _pieces(item, tensor_bytes(item.data), chunk):
                    if self._stop.is_set():
                        return
                    self._copy.write(piece)
            self._copy_open = False
            self._copy.close()
        except Exception as e:  # noqa: BLE001 - the copy is optional; the file is what the save needs
            self._failed = f"writing it failed: {type(e).__name__}: {e}"

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def finish(self, records: list[ShardRecord], expected: int, block: int, cfg: WriteConfig) -> int:
        """Once the file is written and checked: wait for the copy, check it alike and put it where the drain
        takes it (``files.written_through_name``), or drop it; the bytes read back."""
        self._join()
        if self._failed:
            self.drop(self._failed)
            return 0
        try:
            checked = _check_written(self.tmp, records, expected, "write-through", block, self._rank, cfg)
            os.replace(self.tmp, self._done_as)
        except (OSError, FastPersistError) as e:
            self.drop(str(e))
            return 0
        self.tmp, self.done = "", self._done_as
        os.close(self._lock)
        return checked

    def drop(self, why: str) -> None:
        """Give the copy up, ``why`` logged: the drain copies the file instead."""
        if self.tmp:
            logger.warning("fastpersist: rank %d: the write-through copy %s is dropped (%s); the file is copied "
                           "from the local tier instead", self._rank, self.tmp, why)
        self.discard()

    def discard(self) -> None:
        """The copy stopped, closed and removed (no-op once gone)."""
        if not self.tmp:
            return
        self._stop.set()
        self._join()
        if self._copy_open:
            self._copy_open = False
            try:
                self._copy.close()
            except Exception:  # noqa: BLE001 - already failed or given up: its file goes anyway
                logger.debug("fastpersist: closing %s after it failed also failed", self.tmp, exc_info=True)
        _remove_partial(self.tmp)
        self.tmp = ""
        os.close(self._lock)


def _warn_once(key: object, reason: str) -> None:
    """One warning per cause (and per filesystem), not one per save."""
    if key not in _warned:
        _warned.add(key)
        logger.warning("fastpersist: falling back to buffered writes: %s", reason)


def preload_ops(cfg: WriteConfig) -> None:
    """Load the native ops here, so that a writer forked from this process inherits them.

    Loading takes seconds and a file lock under ~/.cache/torch_extensions; only
    the aio *handle* must be made by the writer itself.
    """
    if cfg.direct_io != "off" and aio_available():
        ensure_fast_file_writer_usable()


def prepare_direct_writes(cfg: WriteConfig, write_through: bool = False) -> None:
    """Make this process's aio handle and locked bounce buffer for ``cfg`` now, not in its first write; with
    ``write_through``, also those of its write-through copies (``COPY_SLOT``).

    For the async writer process, before it serves: made inside the first job,
    they would delay that save while a training loop keeps the cores busy.
    Never in a trainer that may fork (a handle made before ``fork`` hangs in
    the child). What fails here fails again in the write, which falls back
    or raises with the cause.
    """
    if cfg.direct_io == "off" or not aio_available():
        return
    try:
        for slot in (0, COPY_SLOT) if write_through else (0,):
            aio_resources(cfg.aio, slot)
    except (RuntimeError, OSError) as e:  # LockedMemoryError too: the write warns and falls back, or raises
        logger.debug("fastpersist: aio handle and bounce buffer not made ahead (%s); the first write says why", e)


def _buffered_by_choice(directory: str, cfg: WriteConfig) -> bool:
    """Whether files in ``directory`` are written buffered whatever the system offers (asked to, or tmpfs)."""
    return cfg.direct_io == "off" or (cfg.direct_io == "auto" and on_memory_filesystem(directory))


def _open_sink(path: str, cfg: WriteConfig, slot: int = 0) -> _Sink:
    if _buffered_by_choice(os.path.dirname(path) or ".", cfg):
        return _BufferedSink(path)  # on tmpfs: one copy from the tensors into the files' pages, no bounce
    try:
        aio_module()
    except RuntimeError as e:
        if cfg.direct_io == "on":
            raise FastPersistError(f"direct_io='on' but {e}") from e
        _warn_once("no-aio", str(e))
        return _BufferedSink(path)
    try:
        return _DirectSink(path, cfg, slot)
    except LockedMemoryError as e:
        if cfg.direct_io == "on":
            raise FastPersistError(f"direct_io='on' but {e}") from e
        _warn_once("memlock", str(e))
        return _BufferedSink(path)
    except OSError as e:
        if e.errno != errno.EINVAL or cfg.direct_io == "on":
            raise
        directory = os.path.dirname(path) or "."
        _warn_once(("no-o-direct", os.stat(directory).st_dev), f"the filesystem of {directory} refuses O_DIRECT ({e.strerror})")
        return _BufferedSink(path)


def settling_bytes(directory: str, cfg: WriteConfig) -> int:
    """How many bytes at the end of a file :func:`write_rank_file` is writing in ``directory`` may not hold their
    final value yet, for a reader that follows the write: none for buffered writes (a file grows past a byte only
    once it is in the page cache), the bounce buffer for DeepNVMe's (its aio write in flight may land after a later
    part of it)."""
    return 0 if _buffered_by_choice(directory, cfg) else cfg.aio.buffer_bytes


@dataclass
class WriteItem:
    """One placed record and its bytes: a container's framing around the record's elements.

    ``data``: 1-D uint8 host bytes, or any tensor (on an accelerator, strided)
    whose bytes the write copies to the host when it gets there (see
    :func:`host_bytes`). ``len(prefix) + nbytes(data) + len(suffix) ==
    record.length``; the checksums cover all of it (a torch_dist reader parses
    the framing too).
    """

    record: ShardRecord
    data: torch.Tensor
    prefix: bytes = b""
    suffix: bytes = b""


@dataclass(frozen=True)
class WriteResult:
    """What one rank wrote: records with checksums, and how fast."""

    records: list[ShardRecord]
    nbytes: int
    seconds: float
    mode: str


def needs_host_copy(data: torch.Tensor) -> bool:
    """Whether ``data``'s bytes must be copied before a write: not contiguous host memory."""
    return data.device.type != "cpu" or not data.is_contiguous()


def host_bytes(data: torch.Tensor) -> torch.Tensor:
    """1-D uint8 host bytes of ``data``: a view of contiguous host memory, else a copy."""
    host = data.detach()
    if host.device.type != "cpu":
        host = host.to("cpu")
    return tensor_bytes(host.contiguous())


class _HostBytesAhead:
    """Each item's host bytes, asked for in order, with its checksum started as soon as they exist.

    Copies are made on the calling thread (an accelerator's data on its current
    stream, as the caller left it), ahead of the item asked for while the copies
    not yet both written and checksummed stay within ``budget`` bytes; items that
    need no copy cost nothing, so for host state every checksum starts at once.
    With a ``block`` (storage/host_staging.py) a copy of at most its size goes
    into a region of it, given back in order once written and checksummed; a
    larger one, or every copy without a block, into fresh memory.
    """

    def __init__(self, items: list[WriteItem], checksum: Callable[[WriteItem, torch.Tensor], Future], budget: int,
                 block: Optional[torch.Tensor] = None):
        self._items, self._checksum, self._budget = items, checksum, budget
        self._block = block
        self._ring = Ring(block.numel()) if block is not None else None
        self.digests: list[Future] = []  # one per item made, in order
        self._hosts: list[Optional[torch.Tensor]] = []
        self._copies: list[tuple[int, int, bool]] = []  # (item index, bytes, in the ring) of copies maybe still held

    def get(self, i: int) -> torch.Tensor:
        """Host bytes of item ``i`` (items before it are written); the caller's reference is the only one kept."""
        while len(self.digests) <= i:
            while (place := self._room(i)) is None:
                self.digests[self._copies[0][0]].result()  # a written copy still being checksummed
            self._make(*place)
        while len(self.digests) < len(self._items) and (place := self._room(i)) is not None:
            self._make(*place)
        host, self._hosts[i] = self._hosts[i], None
        return host

    def _room(self, writing: int) -> Optional[tuple[int, Optional[int]]]:
        """The next item's copy cost and offset in the block (None: elsewhere) if it fits beside the copies held."""
        # Items are written in order and checksummed in order (one thread): copies are freed oldest first.
        while self._copies and self._copies[0][0] < writing and self.digests[self._copies[0][0]].done():
            if self._copies.pop(0)[2]:
                self._ring.give_back_oldest()
        data = self._items[len(self.digests)].data
        cost = data.nbytes if needs_host_copy(data) else 0
        if cost and self._ring is not None and cost <= self._ring.capacity:
            offset = self._ring.take(cost)
            return None if offset is None else (cost, offset)
        fits = cost == 0 or not self._copies or sum(n for _, n, _ in self._copies) + cost <= self._budget
        return (cost, None) if fits else None

    def _make(self, cost: int, offset: Optional[int]) -> None:
        k = len(self.digests)
        item = self._items[k]
        try:
            host = host_bytes(item.data) if offset is None else self._into_block(item.data, offset, cost)
        except Exception as e:  # made ahead of the item being written: name the one that failed
            raise FastPersistError(f"taking the bytes of {item.record.describe()}: {type(e).__name__}: {e}") from e
        if cost:
            self._copies.append((k, cost, offset is not None))
        self._hosts.append(host)
        self.digests.append(self._checksum(item, host))

    def _into_block(self, data: torch.Tensor, offset: int, nbytes: int) -> torch.Tensor:
        """``data``'s bytes copied into the block at ``offset`` (a blocking copy: complete on return)."""
        dest = self._block[offset : offset + nbytes]
        copy_to_host(dest.view(data.dtype).view(data.shape), data.detach())
        return dest


def _readback_blocks(records: list[ShardRecord], block: int, stride: int) -> list[tuple[ShardRecord, int]]:
    """(record, block index) of the blocks to re-read: the file's first and last, and every ``stride``-th."""
    blocks = [(r, i) for r in sorted(records, key=lambda r: r.offset) for i in range(len(r.checksums))]
    picked = {0, len(blocks) - 1} if blocks else set()
    if stride > 0:
        picked.update(range(0, len(blocks), stride))
    return [blocks[i] for i in sorted(picked)]


def confirm_on_disk(path: str, records: list[ShardRecord], block_bytes: int, rank: int, stride: int = 0) -> int:
    """Re-read sampled checksum blocks of ``path`` from the device and compare them; returns bytes read.

    DeepSpeed's aio path reports no failed write, and the size check after fsync
    cannot see a hole or misplaced bytes inside the file. The sampled pages are
    dropped from the page cache first (clean after fsync), so the buffered
    ``pread`` sees what the device holds, not what the writer left in memory.
    Raises naming the file, byte offset, key and rank of the first mismatch.
    """
    nbytes = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        for record, i in _readback_blocks(records, block_bytes, stride):
            start = record.offset + i * block_bytes
            length = min(block_bytes, record.length - i * block_bytes)
            lo = start // _PAGE * _PAGE
            os.posix_fadvise(fd, lo, -(-(start + length - lo) // _PAGE) * _PAGE, os.POSIX_FADV_DONTNEED)
            data = os.pread(fd, length, start)
            nbytes += len(data)
            if len(data) != length or digest_bytes(data) != record.checksums[i]:
                short = "" if len(data) == length else f" (short read: {len(data)} bytes)"
                raise FastPersistError(
                    f"rank {rank}: read-back of {path} at byte offset {start} (block {i} of {record.describe()}) "
                    f"does not match the bytes written{short}: "
                    "the storage did not persist what it acknowledged (silent aio or device failure)"
                )
    finally:
        os.close(fd)
    return nbytes


def _free_space(path: str) -> str:
    """Free bytes on ``path``'s filesystem, to tell a full disk from an I/O error in a message."""
    return f"{free_bytes(os.path.dirname(path) or '.')} bytes"


def _remove_partial(path: str) -> None:
    """A failed rank's file is never committed: free its space (a full disk needs it most)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError:
        logger.warning("fastpersist: could not remove the partial file %s", path, exc_info=True)


def write_rank_file(
    path: str,
    items: list[WriteItem],
    cfg: WriteConfig,
    rank: int,
    reuse_from: Optional[str] = None,
    copy_to: Optional[str] = None,
    written: Optional[Callable[[WriteResult], None]] = None,
) -> WriteResult:
    """Write ``items`` (records placed by the planner, back to back) to ``path`` durably.

    Returns the records with their checksums. Raises if the file on disk does
    not hold exactly the planned bytes after fsync, or if a block read back (see
    :func:`confirm_on_disk`; ``cfg.readback_stride`` None skips it) differs. A file
    left by a failed write is removed. ``reuse_from``: a pool of retired files
    (``storage/recycle.py``) of which one is overwritten where the write is
    buffered (tmpfs), instead of a new file. ``copy_to``: a tiered save's
    write-through copy to the persistent tier (items in host memory), the same
    bytes written beside the file on a thread of its own and checked alike,
    left at ``written_through_name(copy_to)`` for the drain to put in place; a
    copy that fails is removed, logged, and the write goes on. ``written``:
    called with the result as soon as the file is written and checked, before
    this waits for the copy (the caller leaves its status there: the local
    commit need not wait for the persistent tier); it must not raise.
    """
    start_time = time.perf_counter()
    block = cfg.checksum_block_bytes
    chunk = max(block, 64 * MiB // block * block)
    expected = sum(item.record.length for item in items)
    through = None if copy_to is None else _through(copy_to, expected, cfg, rank)  # before the file (_ThroughCopy)
    try:
        if os.path.lexists(path):
            os.unlink(path)  # FastFileWriter opens without O_TRUNC: old bytes would survive.
        reused = reuse_from is not None and _buffered_by_choice(os.path.dirname(path) or ".", cfg) and take(
            reuse_from, path)
        sink = _open_sink(path, cfg)
        if through is not None:
            through.start(items, chunk)
    except BaseException as e:
        _remove_partial(path)
        if through is not None:
            through.discard()
        if isinstance(e, OSError):
            raise FastPersistError(f"rank {rank}: cannot open {path} for writing: {e}") from e
        raise
    phases = Phases()
    try:
        out = _stream(path, sink, items, block, chunk, rank, phases)
        checked = _check_written(path, out, expected, sink.mode, block, rank, cfg)
        phases.mark(f"size check, read back {checked / MiB:.0f} MiB")
    except BaseException:
        _remove_partial(path)
        if through is not None:
            through.discard()
        raise
    result = WriteResult(out, expected, time.perf_counter() - start_time, sink.mode)
    logger.debug(
        "fastpersist: rank %d wrote %.3f GiB to %s in %.2f s (%.2f GiB/s, %s%s): %s", rank, expected / 2**30, path,
        result.seconds, expected / 2**30 / max(result.seconds, 1e-9), sink.mode,
        ", over a retired file" if reused else "", phases,
    )
    try:
        if written is not None:
            written(result)
    finally:
        if through is not None:
            checked = through.finish(out, expected, block, cfg)
            if through.done:
                seconds = time.perf_counter() - start_time
                logger.debug("fastpersist: rank %d wrote %s through in %.2f s (%.2f GiB/s), read back %.0f MiB",
                             rank, through.done, seconds, expected / 2**30 / max(seconds, 1e-9), checked / MiB)
    return result


def _through(copy_to: str, nbytes: int, cfg: WriteConfig, rank: int) -> Optional[_ThroughCopy]:
    """A write-through copy of ``nbytes`` to ``copy_to`` opened, or None (logged) where it cannot be."""
    try:
        return _ThroughCopy(copy_to, nbytes, cfg, rank)
    except Exception as e:  # noqa: BLE001 - the copy is optional; the write goes on without it
        logger.warning("fastpersist: rank %d: no write-through copy to %s (%s: %s); the file is copied from the "
                       "local tier instead", rank, copy_to, type(e).__name__, e)
        return None


def _check_written(path: str, records: list[ShardRecord], expected: int, mode: str, block: int, rank: int,
                   cfg: WriteConfig) -> int:
    """Raise unless ``path`` holds ``expected`` bytes after fsync and its sampled blocks read back as written;
    the bytes read back."""
    os.chmod(path, 0o644)  # FastFileWriter creates files with mode 0o777 (minus umask)
    size = os.stat(path).st_size
    if size != expected:
        raise FastPersistError(
            f"rank {rank}: {path} holds {size} bytes after fsync, expected {expected} "
            f"({mode} writes failed silently: {_free_space(path)} free there; disk full or I/O error?)"
        )
    return 0 if cfg.readback_stride is None else confirm_on_disk(path, records, block, rank, cfg.readback_stride)


def _stream(
    path: str, sink: _Sink, items: list[WriteItem], block: int, chunk: int, rank: int, phases: Phases,
) -> list[ShardRecord]:
    """Push every item through ``sink`` and close (fsync) it, checksumming on a second thread meanwhile.

    The checksum reads the caller's bytes, never the bounce buffer, so it runs
    beside the copy and the aio writes of the same bytes instead of before each
    piece (xxhash releases the GIL on large buffers, the copy and the aio waits
    do too). ``phases`` gets "copy+aio" (bounce-buffer copies and the aio waits
    the double buffer cannot hide), "flush+fsync" and "checksum wait" (what the
    checksums still needed once the file was durable).
    """
    where = "writing"
    shown = progress.task("write", sum(item.record.length for item in items))
    staged = [d for d in (item.data for item in items) if needs_host_copy(d) and d.nbytes <= HOST_COPY_BYTES]
    on_device = any(d.device.type != "cpu" for d in staged)
    staging = staging_block(HOST_COPY_BYTES, pinned=on_device) if staged else nullcontext()
    inline = sink.mode == MODE_BUFFERED and cores_per_local_rank() < 2
    # The block is given up last: after the checksum thread has finished with it, whatever happened.
    with staging as host_block, copies_on_this_thread(), \
            ThreadPoolExecutor(1, thread_name_prefix="fastpersist-checksum") as checksummer:
        checksum = _hashed_inline if inline else \
            (lambda item, data: checksummer.submit(_checksums, item, data, block, chunk))
        ahead = _HostBytesAhead(items, checksum, HOST_COPY_BYTES, host_block)
        inline_digests: list[list[str]] = []
        try:
            for i, item in enumerate(items):
                where = f"writing {item.record.describe()}"
                if inline:
                    hasher = BlockHasher(block)
                    for piece in _pieces(item, ahead.get(i), INLINE_PIECE_BYTES):
                        sink.write(piece)
                        hasher.update(piece.numpy())  # the bytes just written, still in the CPU's caches
                    inline_digests.append(hasher.finish())
                else:
                    for piece in _pieces(item, ahead.get(i), chunk):
                        sink.write(piece)
                shown.add(item.record.length)
            phases.mark("copy+aio" if not inline else "write+checksum")
            where = "flushing and fsyncing"
            sink.close()
            phases.mark("flush+fsync")
            where = "checksumming"
            digests = inline_digests if inline else [d.result() for d in ahead.digests]
            out = [with_checksums(item.record, d) for item, d in zip(items, digests)]
            phases.mark("checksum wait")
        except Exception as e:
            checksummer.shutdown(cancel_futures=True)
            if where.startswith("writing"):
                try:
                    sink.close()
                except Exception:  # noqa: BLE001 - the first error is the one to report
                    logger.debug("closing %s after a failed write also failed", path, exc_info=True)
            raise FastPersistError(f"rank {rank}: {where} in {path} failed: {type(e).__name__}: {e}") from e
    return out


def _hashed_inline(item: WriteItem, data: torch.Tensor) -> Future:
    """The checksum of an item hashed by the write loop itself: nothing left to wait for here."""
    done: Future = Future()
    done.set_result(None)
    return done


def _checksums(item: WriteItem, data: torch.Tensor, block: int, chunk: int) -> list[str]:
    """Block checksums of everything ``item`` puts in the file (``data``: its host bytes), framing included."""
    hasher = BlockHasher(block)
    for piece in _pieces(item, data, chunk):
        hasher.update(piece.numpy())
    return hasher.finish()


def _pieces(item: WriteItem, data: torch.Tensor, chunk: int) -> Iterator[torch.Tensor]:
    """The item's bytes in order (``data``: its host bytes) as 1-D uint8 tensors of at most ``chunk`` bytes."""
    if item.prefix:
        yield torch.frombuffer(bytearray(item.prefix), dtype=torch.uint8)
    for pos in range(0, data.numel(), chunk):
        yield data[pos : pos + chunk]
    if item.suffix:
        yield torch.frombuffer(bytearray(item.suffix), dtype=torch.uint8)
