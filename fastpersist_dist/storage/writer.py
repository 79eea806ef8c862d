"""Streaming one rank's shards into its data file, checksumming as bytes pass.

The bytes go through a sink (``storage/sinks.py``: DeepNVMe's O_DIRECT writer,
or buffered writes on tmpfs and filesystems without O_DIRECT). The checksums
are computed on a second thread from the caller's bytes while those bytes are
copied and written. Records whose elements are not contiguous host memory
(accelerator tensors, strided views: a synchronous save passes them as they
are) are copied to the host as the write reaches them, a bounded number of
bytes ahead (``HOST_COPY_BYTES``), not all before it starts, into a block of
host memory that the process keeps for its next write
(``storage/host_staging.py``). DeepSpeed reports no failed aio write: the file's
size is checked after the final fsync, and sampled blocks are read back from
the device (``storage/readback.py``) before the rank reports success.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

from ..format.checksum import BlockHasher
from ..format.records import ShardRecord, tensor_bytes, with_checksums
from ..util import progress
from ..util.config import MiB, WriteConfig
from ..util.errors import FastPersistError
from ..util.timing import Phases
from .files import free_bytes
from .host_copy import copies_on_this_thread, copy_to_host
from .host_staging import Ring, staging_block
from .readback import confirm_on_disk
from .sinks import Sink, open_sink

logger = logging.getLogger(__name__)

# Host copies (of accelerator tensors, strided views) one write holds at once, made ahead of
# the write position so that the copy of the next record overlaps the aio writes of this one:
# the size of the reused block they go into. A record above it is copied alone, into fresh
# memory, so a rank's share never sits in pageable host memory at once.
HOST_COPY_BYTES = 256 * MiB


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


def write_rank_file(path: str, items: list[WriteItem], cfg: WriteConfig, rank: int) -> WriteResult:
    """Write ``items`` (records placed by the planner, back to back) to ``path`` durably.

    Returns the records with their checksums. Raises if the file on disk does
    not hold exactly the planned bytes after fsync, or if a block read back (see
    :func:`confirm_on_disk`; ``cfg.readback_stride`` None skips it) differs. A file
    left by a failed write is removed.
    """
    start_time = time.perf_counter()
    block = cfg.checksum_block_bytes
    chunk = max(block, 64 * MiB // block * block)
    expected = sum(item.record.length for item in items)
    try:
        if os.path.lexists(path):
            os.unlink(path)  # FastFileWriter opens without O_TRUNC: old bytes would survive.
        sink = open_sink(path, cfg)
    except BaseException as e:
        _remove_partial(path)
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
        raise
    result = WriteResult(out, expected, time.perf_counter() - start_time, sink.mode)
    logger.debug("fastpersist: rank %d wrote %.3f GiB to %s in %.2f s (%.2f GiB/s, %s): %s", rank, expected / 2**30,
                 path, result.seconds, expected / 2**30 / max(result.seconds, 1e-9), sink.mode, phases)
    return result


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
    path: str, sink: Sink, items: list[WriteItem], block: int, chunk: int, rank: int, phases: Phases,
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
    # The block is given up last: after the checksum thread has finished with it, whatever happened.
    with staging as host_block, copies_on_this_thread(), \
            ThreadPoolExecutor(1, thread_name_prefix="fastpersist-checksum") as checksummer:
        ahead = _HostBytesAhead(items, lambda item, data: checksummer.submit(_checksums, item, data, block, chunk),
                                HOST_COPY_BYTES, host_block)
        try:
            for i, item in enumerate(items):
                where = f"writing {item.record.describe()}"
                for piece in _pieces(item, ahead.get(i), chunk):
                    sink.write(piece)
                shown.add(item.record.length)
            phases.mark("copy+aio")
            where = "flushing and fsyncing"
            sink.close()
            phases.mark("flush+fsync")
            where = "checksumming"
            digests = [d.result() for d in ahead.digests]
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
