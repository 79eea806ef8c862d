"""Replicas: each node's data files copied into the local tiers of other nodes over a gloo group of their own,
every chunk checked on arrival (docs/design.md, "Replicas"). A peer that died leaves the checkpoint ``local``
and turns replication off in this process, said once.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ...format.tiers import REPLICATED, TierManifest
from ...plan.replicas import ReplicaTransfer, replica_transfers
from ...storage.checked_read import pages_to_send, sendable_in_place
from ...storage.copy import AtomicFile
from ...storage.spans import Span, block_spans, check_chunk, chunk_plan
from ...util.beside import Beside
from ...util.errors import CorruptCheckpointError
from ...util.per_process import PerProcess
from ..index_reader import read_index
from .state import advance

logger = logging.getLogger(__name__)

TAG = 4243
CHUNK_WAIT_ENV = "FASTPERSIST_REPLICA_CHUNK_WAIT_S"


def chunk_wait() -> datetime.timedelta:
    """How long a chunk (at most 64 MiB: seconds of work even on a slow network) may take to be sent or received
    before its peer counts as gone (default 60 s); the group's own timeout (30 minutes) is for the final agreement."""
    return datetime.timedelta(seconds=float(os.environ.get(CHUNK_WAIT_ENV, "60")))


@dataclass(frozen=True)
class Replication:
    """One rank's part of replicating one checkpoint."""

    manifest: TierManifest
    local: str  # this node's copy of the checkpoint
    rank: int
    node: str  # this node, for messages
    group: dist.ProcessGroup


class _Broken:
    """Set once a transfer failed for a reason other than the bytes (a peer died): the group is unusable."""

    def __init__(self) -> None:
        self.why: Optional[str] = None


_broken = PerProcess(_Broken)


def replicate(job: Replication) -> None:
    """This rank's transfers of ``job`` (collective over its group); see the module."""
    broken = _broken.get()
    if broken.why is not None:
        logger.error("fastpersist: rank %d: %s is not replicated: replication stopped in this process after an "
                     "earlier failure (%s)", job.rank, job.manifest.checkpoint_dir, broken.why)
        return
    start = time.perf_counter()
    who = f"rank {job.rank} ({job.node})"
    index = read_index(job.local, who)
    transfers = replica_transfers(job.manifest.nodes, {f: r for f, r in job.manifest.files.items()
                                                       if f in index.files}, job.manifest.replica_nodes)
    mine = [t for t in transfers if job.rank in (t.src, t.dst)]
    moved = sum(index.files[t.data_file] for t in mine)

    def spans(t: ReplicaTransfer) -> list[Span]:
        size = index.files[t.data_file]
        return block_spans([r for r in index.records if r.file == t.data_file], index.checksum_block_bytes, size,
                           os.path.join(job.local, t.data_file))

    def sends() -> bool:
        return all([_send(t, os.path.join(job.local, t.data_file), spans(t), job.group, who)
                    for t in mine if t.src == job.rank])

    try:
        sent = Beside(sends, "fastpersist-replica-send")  # beside the receives: both directions move at once
        try:
            ok = all([_receive(t, os.path.join(job.local, t.data_file), spans(t), job, who)
                      for t in mine if t.dst == job.rank])
        except BaseException:
            sent.join()  # the sends end too (a peer gone fails them): the receive's error is the one raised
            raise
        ok &= sent.result()
        flag = torch.tensor([int(ok)])
        job.group.allreduce([flag], dist.ReduceOp.MIN).wait()
    except RuntimeError as e:  # torch's DistError family: a peer died or timed out
        broken.why = f"{type(e).__name__}: {e}"
        logger.error("fastpersist: %s: replicating %s failed, it stays local (in the local tiers only): a peer "
                     "died or timed out: %s", who, job.manifest.checkpoint_dir, e)
        return
    seconds = time.perf_counter() - start
    logger.debug("fastpersist: %s: replicas of %s: %.3f GiB sent and received in %.2f s", who,
                 job.manifest.checkpoint_dir, moved / 2**30, seconds)
    if not flag.item():
        if job.rank == 0:
            logger.error("fastpersist: %s is not replicated: a replica failed its checksums (see the ranks' errors)",
                         job.manifest.checkpoint_dir)
        return
    if job.rank == 0 and advance(job.manifest, REPLICATED):
        logger.info("fastpersist: %s replicated: each node's files also in the local tiers of %s (%.2f s)",
                    job.manifest.checkpoint_dir, _describe(job.manifest), seconds)


def _describe(m: TierManifest) -> str:
    return "; ".join(f"node {n} -> nodes {', '.join(map(str, r))}" for n, r in enumerate(m.replica_nodes))


def _buffers(chunks: list[list[Span]]) -> list[torch.Tensor]:
    most = max((c[-1].end - c[0].start for c in chunks), default=0)
    return [torch.empty(most, dtype=torch.uint8) for _ in range(_slots(chunks))]


def _slots(chunks: list[list[Span]]) -> int:
    """Chunks in flight at once: two (one moves while the next is read or checked), one where there is one."""
    return 2 if len(chunks) > 1 else 1


def _send(t: ReplicaTransfer, path: str, spans: list[Span], group: dist.ProcessGroup, who: str) -> bool:
    """Send ``path`` to ``t.dst`` chunk by chunk, a slot's next chunk once its last one is sent: from its pages
    where it is in memory, else read into buffers; a chunk that cannot be read goes as zeros (the receiver's
    checksums reject it) so that both ends stay in step. Whether every chunk was read."""
    chunks = chunk_plan(spans)
    pending: list[Optional[dist.Work]] = [None] * _slots(chunks)
    try:
        fd: Optional[int] = os.open(path, os.O_RDONLY)
    except OSError as e:
        logger.error("fastpersist: %s: cannot read %s to send it to rank %d: %s", who, path, t.dst, e)
        fd = None
    unread: list[int] = []  # the first byte of each chunk sent as zeros
    try:
        if fd is not None and chunks and sendable_in_place(fd, path, chunks[-1][-1].end):
            chunk = _mapped_chunks(fd, chunks)
        else:
            chunk = _read_chunks(fd, path, chunks, unread, f"{who}: reading {path} to send it to rank {t.dst}")
        for i in range(len(chunks)):
            slot = i % len(pending)
            if pending[slot] is not None:
                pending[slot].wait(chunk_wait())
            pending[slot] = group.send([chunk(i)], t.dst, TAG)
        for work in pending:
            if work is not None:
                work.wait(chunk_wait())
    finally:
        if fd is not None:
            os.close(fd)
    return fd is not None and not unread


def _mapped_chunks(fd: int, chunks: list[list[Span]]) -> Callable[[int], torch.Tensor]:
    """Chunk i of the file ``fd`` (in memory), mapped: the mapping goes with its send, so no more is mapped at
    once than two buffers would hold."""
    return lambda i: torch.frombuffer(pages_to_send(fd, chunks[i][0].start, chunks[i][-1].end), dtype=torch.uint8)


def _read_chunks(fd: Optional[int], path: str, chunks: list[list[Span]], unread: list[int], what: str
                 ) -> Callable[[int], torch.Tensor]:
    """Chunk i of ``path`` (open as ``fd``; None: it could not be opened) read into buffer i % slots, whose
    last send is done; zeros where it cannot be read, its first byte added to ``unread``."""
    buffers = _buffers(chunks)

    def read(i: int) -> torch.Tensor:
        start = chunks[i][0].start
        view = buffers[i % len(buffers)][: chunks[i][-1].end - start]
        if fd is not None:
            try:
                got, error = os.preadv(fd, [memoryview(view.numpy())], start), "a short read"
            except OSError as e:
                got, error = 0, str(e)
            if got == view.numel():
                return view
            logger.error("fastpersist: %s at byte %d failed (%s)", what, start, error)
        view.zero_()
        unread.append(start)
        return view

    return read


def _receive(t: ReplicaTransfer, path: str, spans: list[Span], job: Replication, who: str) -> bool:
    """Receive ``t.data_file`` from ``t.src`` into this node's copy, checked; whether it is there now."""
    chunks = chunk_plan(spans)
    buffers = _buffers(chunks)
    sender = f"rank {t.src}'s copy of {t.data_file} (node {job.manifest.node_of(t.src)})"

    def post(i: int) -> dist.Work:
        chunk = chunks[i]
        return job.group.recv([buffers[i % len(buffers)][: chunk[-1].end - chunk[0].start]], t.src, TAG)

    error: Optional[Exception] = None
    out: Optional[AtomicFile] = None
    try:
        out = AtomicFile(path)
    except OSError as e:  # e.g. the local tier is full or gone: received all the same, and dropped
        error = e
    try:
        work = post(0) if chunks else None
        for i, chunk in enumerate(chunks):
            assert work is not None
            work.wait(chunk_wait())
            data = buffers[i % len(buffers)][: chunk[-1].end - chunk[0].start]
            work = post(i + 1) if i + 1 < len(chunks) else None
            if out is None:
                continue  # a bad block or a failed write earlier: received and dropped, in step with the sender
            try:
                check_chunk(memoryview(data.numpy()), chunk, sender, who)
                out.write(memoryview(data.numpy()))
            except (CorruptCheckpointError, OSError) as e:
                error = e
                out.abandon()
                out = None
        if out is not None:
            try:
                out.commit()
            except OSError as e:
                error = e
                out.abandon()
            out = None
    finally:
        if out is not None:
            out.abandon()
    if error is not None:
        logger.error("fastpersist: %s: the replica of %s from rank %d was not kept: %s", who, t.data_file, t.src,
                     error)
        return False
    logger.debug("fastpersist: %s: received the replica of %s from rank %d, every block checked", who, t.data_file,
                 t.src)
    return True
