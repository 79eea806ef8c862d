"""One rank's part of a shared load: read for others, send as reads finish, receive the rest.

The group agrees on a plan (``plan/read_sharing.py``) from every rank's needs
(one ``all_gather_object``). Before any read, a rank posts a receive for each
sub-box another rank reads for it, straight into its destination where the
destination is a contiguous tensor of the saved dtype on the group's device,
else into a staging tensor. It then reads its own boxes and, into send
buffers, the boxes it reads for others, verified like any read; each buffer is
sent as soon as its bytes are in (in plan order, so the pairs' messages match
on NCCL as on gloo), while the next reads run. At the end the ranks exchange
their status, then wait for their receives. A rank that fails anywhere in the
load (index, planning, a read) still takes part in the group's next gather
(``Agreement.fail_together``), so every rank raises an error naming it instead of
waiting forever on a collective or a receive.

A tiered checkpoint is read from the nearest intact copy of each file: within
the group, a file a rank's node lacks is read by a rank of a node that holds it
(a replaced node's files, in the replicas of others), and only where no rank
holds it near, by a rank that needs it from the persistent tier. A file may
also be held only in the local tiers of other nodes (a checkpoint not durable
yet, or a persistent copy missing or cut short). Where the load's group is not
the whole job (a job above ``DEFAULT_GROUP_MAX_RANKS``, or a ``parallel_group``
of one node's ranks; not with ``share_reads="off"``, whose loads stay
independent), :meth:`ReadExchange.recover` gathers over the whole job each
rank's needs of files of which no copy opens for it (none from most ranks, or
from all: only the ranks that have some send them, ``Agreement.agree_sparse``);
only where there are some does every rank say which of those files it can
open, and ranks holding a copy read and send them
(``plan.read_sharing.plan_recovery``).

Bytes received were verified by the rank that read them; the transport
(TCP for gloo, NCCL) is trusted. Extra memory: the send buffers of this rank
and staging for receives that cannot land in place, at most what it reads
for others plus what it gets from them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist

from ..format.layout import Extent
from ..format.records import ShardRecord, dtype_from_name
from ..plan.read_sharing import Need, Transfer, plan_recovery, plan_sharing
from ..storage.reader import MAX_READ_GAP
from ..storage.stream_reader import BoxRead, needed_ranges
from ..util.config import ReadConfig
from ..util.errors import FastPersistError
from .agreement import Agreement

logger = logging.getLogger(__name__)

# Sharing reads gathers every rank's needs on every rank of the group: the default
# process group is used up to this many ranks; larger jobs pass a group (one node's ranks).
DEFAULT_GROUP_MAX_RANKS = 64
# Reads up to this size that lie alone between another rank's reads are taken over by that
# rank (plan/read_sharing.py): up to one aio block of the loads' handle (32 MiB), which the device
# serves at a queue depth of one; the resharded bench load had 8-15 MiB ones.
ABSORB_MAX_BYTES = ReadConfig().aio.block_size
# (file, record offset, extent byte_start) -> the record and its extent: from the load's index.
Lookup = Callable[[str, int, int], tuple[ShardRecord, Extent]]
# Tag of our point-to-point messages (gloo matches on it; NCCL ignores it).
TAG = 0x4650
# One rank's needs as the plan saw them: all of them, or (recovery) those it cannot read, by their index.
RankNeeds = Union[Sequence[Need], Mapping[int, Need]]


# Groups a shared load failed on: receives may still be posted there, which a later exchange's
# messages could match (NCCL matches by order only), so this process shares no more reads on them.
_abandoned: list[dist.ProcessGroup] = []


def sharing_group(share: bool, group: Optional[dist.ProcessGroup]) -> Optional[dist.ProcessGroup]:
    """The group this rank shares reads with, or None (sharing off, no process group, one rank)."""
    if not share or not dist.is_available() or not dist.is_initialized():
        return None
    size = dist.get_world_size(group)
    if size < 2:
        return None
    if (group or dist.group.WORLD) in _abandoned:
        logger.warning("fastpersist: a shared load over this process group failed earlier and may have left "
                       "receives posted; this process's loads read unshared from now on")
        return None
    if group is None and size > DEFAULT_GROUP_MAX_RANKS:
        logger.info("fastpersist: %d ranks: loads read unshared; FastPersistLoadStrategy(parallel_group=...) with "
                    "one node's ranks shares the reads of resharded loads within it", size)
        return None
    return group or dist.group.WORLD


def recovery_group(share: bool, group: Optional[dist.ProcessGroup]) -> Optional[dist.ProcessGroup]:
    """The whole job, where bytes a rank cannot reach must come from ranks outside ``group`` (the sharing group,
    or None); None where loads are independent (``share`` False: ``share_reads="off"``), where ``group`` is the
    whole job already, or where there is no other rank."""
    if not share or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    world = dist.group.WORLD
    if group is world:
        return None
    if world in _abandoned:
        logger.warning("fastpersist: a shared load over the whole job failed earlier and may have left receives "
                       "posted; bytes this rank cannot reach are not read for it by other ranks")
        return None
    return world


def shared_load(who: str) -> Agreement:
    """How the ranks of a shared load fail together: each raises an error naming the rank that failed."""
    return Agreement(FastPersistError, f"{who}: load abandoned, a rank sharing its reads failed",
                     f"{who}: load abandoned, a rank sharing its reads died or timed out")


def read_order(read: BoxRead) -> tuple[str, int]:
    """Sort key putting reads in file and byte order: sequential I/O."""
    return read.record.file, read.record.offset + read.record.data_offset + read.extent.byte_start


def need_of(read: BoxRead, block: Optional[int]) -> Need:
    """What ``read`` asks of the files: its extent and the bytes read for it (``block``: checksum block widening)."""
    ranges = needed_ranges(read, block)
    rec = read.record
    return Need(rec.file, rec.offset, read.extent.byte_start, read.sub_off, read.sub_shape,
                rec.offset + ranges[0][0], rec.offset + ranges[-1][1])


def comm_device(group: dist.ProcessGroup) -> torch.device:
    """Where tensors sent over ``group`` must live: the current CUDA device for NCCL, else the host."""
    backend = str(dist.get_backend(group))
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass
class _Outgoing:
    dst: int  # group rank
    buffer: torch.Tensor
    left: int  # bytes not yet read into ``buffer``


class ReadExchange:
    """The shared part of one load on one rank; :meth:`start` decides whether there is one."""

    def __init__(self, reads: list[BoxRead], everyone: Sequence[RankNeeds], transfers: list[Transfer],
                 group: dist.ProcessGroup, who: str, lookup: Optional[Lookup] = None):
        self.group = group
        self.who = who
        self.me = dist.get_rank(group)
        device = comm_device(group)
        known = {(r.record.file, r.record.offset, r.extent.byte_start): r for r in reads}
        mine = [t for t in transfers if t.dst == self.me]
        remote = {t.need for t in mine}
        local = [r for i, r in enumerate(reads) if i not in remote]
        self.outgoing: list[_Outgoing] = []
        for t in transfers:
            if t.src != self.me:
                continue
            need = everyone[t.dst][t.need]
            key = (need.file, need.record, need.extent)
            # a reader that wants part of the extent knows it; one reading a file only it can read, from the index
            record, extent = (known[key].record, known[key].extent) if key in known else lookup(*key)
            buffer = torch.empty(need.sub_shape, dtype=dtype_from_name(record.dtype), device=device)
            local.append(BoxRead(record, extent, need.sub_off, need.sub_shape, buffer))
            self.outgoing.append(_Outgoing(t.dst, buffer, buffer.nbytes))
        self._by_storage = {o.buffer.untyped_storage().data_ptr(): o for o in self.outgoing}
        self.reads = sorted(local, key=read_order)
        self.received_bytes = sum(reads[t.need].dest.nbytes for t in mine)
        self.sent_bytes = sum(o.left for o in self.outgoing)
        self._next = 0  # outgoing[:_next] are sent
        self._sends: list[dist.Work] = []
        self._recvs: list[tuple[dist.Work, torch.Tensor, torch.Tensor]] = []
        for t in mine:  # posted before any read: a sender's data lands as soon as it is sent
            read = reads[t.need]
            saved = dtype_from_name(read.record.dtype)
            dest = read.dest
            direct = dest.dtype == saved and dest.device == device and dest.is_contiguous()
            into = dest if direct else torch.empty(read.sub_shape, dtype=saved, device=device)
            self._recvs.append((dist.irecv(into, group=group, group_src=t.src, tag=TAG), into, dest))

    @classmethod
    def start(cls, reads: list[BoxRead], group: dist.ProcessGroup, block: Optional[int], who: str,
              share: bool, readable: Optional[frozenset[str]] = None,
              lookup: Optional[Lookup] = None) -> Optional["ReadExchange"]:
        """Agree on the plan with the group (collective); None when no rank reads for another.

        A rank passing ``share=False`` turns sharing off for the whole group (the
        decision is taken from the gathered data, so every rank takes the same).
        ``readable``: the files this rank reads from its node's copy (a tiered
        checkpoint; None: all): what a rank lacks there is read for it by one
        that has it, sharing on or off, and where no rank has it, by a rank that
        needs it, from a farther copy (the needs are gathered only where sharing
        is on or a rank needs such bytes: a gather of two flags per rank first);
        ``lookup`` finds the record and extent of a need that such a reader does
        not want itself.
        """
        start = time.perf_counter()
        agreement = shared_load(who)
        if readable is None:
            everyone = agreement.agree([need_of(r, block) for r in reads] if share else None, group)
            if any(n is None for n in everyone):
                return None
            transfers = plan_sharing(everyone, MAX_READ_GAP, ABSORB_MAX_BYTES)
        else:
            # (sharing on, needs bytes of a file it cannot read) first: without sharing and with nothing out of
            # reach (a restart from a memory tier), the needs are not gathered
            flags = agreement.agree((share, any(r.record.file not in readable for r in reads)), group)
            shared = all(s for s, _ in flags)
            if not shared and not any(stranded for _, stranded in flags):
                return None
            gathered = agreement.agree(([need_of(r, block) for r in reads], sorted(readable)), group)
            everyone = [n for n, _ in gathered]
            transfers = plan_sharing(everyone, MAX_READ_GAP, ABSORB_MAX_BYTES, [frozenset(r) for _, r in gathered],
                                     shared)
        if not transfers:
            return None
        ex = cls(reads, everyone, transfers, group, who, lookup)
        logger.debug("fastpersist: %s: shared load: reads %d boxes (%d for other ranks, %.3f GiB), receives %d "
                     "(%.3f GiB); planned in %.3f s", who, len(ex.reads), len(ex.outgoing), ex.sent_bytes / 2**30,
                     len(ex._recvs), ex.received_bytes / 2**30, time.perf_counter() - start)
        return ex

    @classmethod
    def recover(cls, reads: list[BoxRead], group: dist.ProcessGroup, block: Optional[int], who: str,
                reachable: Callable[[Iterable[str]], frozenset[str]], lookup: Lookup) -> Optional["ReadExchange"]:
        """The transfers bringing each rank of ``group`` (the whole job) the bytes it needs of files of which no
        copy opens here (``reachable(names)``: those of ``names`` of which one does); None, on every rank, when
        no rank needs any. Collective: a gather of one flag per rank and a broadcast of the needs of each rank
        that has some (``Agreement.agree_sparse``), then, only where there are some, a gather of which of those
        files each rank can read."""
        start = time.perf_counter()
        readable = reachable({r.record.file for r in reads})
        stranded = {i: need_of(r, block) for i, r in enumerate(reads) if r.record.file not in readable}
        agreement = shared_load(who)
        everyone = [needs or {} for needs in agreement.agree_sparse(stranded, group)]
        if not any(everyone):
            return None
        files = {n.file for needs in everyone for n in needs.values()}
        holders = agreement.agree(sorted(reachable(files)), group)
        transfers = plan_recovery(everyone, [frozenset(names) for names in holders])
        if not transfers:
            return None
        ex = cls(reads, everyone, transfers, group, who, lookup)
        (logger.info if ex._recvs else logger.debug)(
            "fastpersist: %s: %d ranks need bytes of files that only other nodes hold; this rank reads %d boxes of "
            "them for others (%.3f GiB) and receives %d (%.3f GiB); planned in %.3f s", who,
            sum(1 for needs in everyone if needs), len(ex.outgoing), ex.sent_bytes / 2**30, len(ex._recvs),
            ex.received_bytes / 2**30, time.perf_counter() - start)
        return ex

    def placed(self, dest: torch.Tensor) -> bool:
        """Note that ``dest`` (part of a read's destination) was filled; True if it is a send buffer's."""
        out = self._by_storage.get(dest.untyped_storage().data_ptr())
        if out is None:
            return False
        out.left -= dest.nbytes
        while self._next < len(self.outgoing) and self.outgoing[self._next].left == 0:
            o = self.outgoing[self._next]
            self._sends.append(dist.isend(o.buffer, group=self.group, group_dst=o.dst, tag=TAG))
            self._next += 1
        return True

    def complete(self, read: Callable[[], None], received: Callable[[int], None]) -> None:
        """Run this rank's reads (``read()``, calling :meth:`placed`), then the transfers (collective).

        ``received(nbytes)`` after each received sub-box is in place. Whichever
        rank fails, every rank raises (the failed one its own error), and the
        group is abandoned for sharing (see ``_abandoned``).
        """
        start = time.perf_counter()
        try:
            agreement = shared_load(self.who)
            try:
                read()
            except Exception as e:
                agreement.fail_together(e, self.group)
            agreement.agree(None, self.group)
        except Exception:
            _abandoned.append(self.group)
            raise
        if self._next != len(self.outgoing):
            raise FastPersistError(f"{self.who}: {len(self.outgoing) - self._next} sub-boxes read for other ranks "
                                   "were never completely read (internal error)")
        agreed = time.perf_counter()
        for work, into, dest in self._recvs:
            work.wait()
            if into is not dest:
                dest.copy_(into)
            received(dest.nbytes)
        for work in self._sends:
            work.wait()
        logger.debug("fastpersist: %s: shared load: reads and sends %.3f s, then receives %.3f s", self.who,
                     agreed - start, time.perf_counter() - agreed)
