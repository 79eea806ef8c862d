"""One save, from a sharded state dict to a write job and its commit. Version-agnostic.

The steps: stage (describe what this rank holds), exchange descriptions and
agree on a write plan across ranks (one collective, cached across saves),
invalidate the old checkpoint, take the elements of this rank's share (a
snapshot of them in host memory for async saves; a synchronous write copies
what is not host memory as it reaches it), frame each record for the checkpoint format and
place it in the rank's data file. An async save of an unchanged structure
copies by the cached plan while the agreement (directory checks, exchange,
invalidation) runs beside the copy on a thread. The result is a :class:`SaveJob`: the
function that writes the file (in the trainer or in an async writer process)
and the collective finalize steps that commit it. megatron adapters wrap it
into the request type of their megatron-core.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Optional, TypeVar

import torch
import torch.distributed as dist

from ..format.kinds import CheckpointFormat
from ..format.records import ShardRecord
from ..plan.writes import Outgoing, PlanCache, PlanError, place_in_rank_file
from ..storage import host_copy
from ..storage.sinks import preload_ops
from ..storage.writer import WriteItem
from ..util.config import WriteConfig
from ..util.errors import FastPersistError, SaveFailedError
from ..util.per_process import PerProcess
from ..util.timing import Phases
from .agreement import Failed, before_writing, failure
from .commit import finalize_save
from .directory import check_shared_directory, check_target_directory, invalidate
from .staging import Lease, SnapshotPool, StagedShard, assign, stage, to_elements
from .status import write_and_report
from .tiers.background import begin_save
from .tiers.save import TieredSave
from .tiers.topology import describe_node
from .writer_process import WriterJob, describe_items, write_in_writer, writer_client

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class SaveJob:
    """What is left of a save once staged: ``write(*args)`` on this rank, then every ``finalize`` on all ranks."""

    write: Callable[..., None]
    args: tuple
    finalize: list[Callable[[], None]]

    def run(self) -> None:
        """Write and commit now, in this process.

        No barrier between the two: finalize's own collectives synchronize and
        report a dead rank as ``SaveFailedError`` rather than gloo's raw error.
        """
        self.write(*self.args)
        for fn in self.finalize:
            fn()


def _log_plan(plan: list[list], reused: bool, ranks: Optional[list[int]]) -> None:
    per_rank = [sum(r.length for r in records) for records in plan]
    mean = sum(per_rank) / len(per_rank)
    logger.debug(
        "fastpersist: write plan %s%s: %d records, bytes per rank %s (max/mean %.3f)",
        "reused" if reused else "made", "" if ranks is None else f" for ranks {ranks}", sum(map(len, plan)),
        per_rank, max(per_rank) / mean if mean else 1.0,
    )


def _items(staged: list[StagedShard], fmt: CheckpointFormat, rank: int,
           separation_hint: Optional[str] = None) -> list[WriteItem]:
    """Frame every record for ``fmt`` and place them back to back in the rank's data file; the keys beginning with
    ``separation_hint`` after all others, as one range (that a removal of the prefix frees as one hole)."""
    if separation_hint:
        staged = sorted(staged, key=lambda s: s.record.key.startswith(separation_hint))  # stable: order kept
    frames = [fmt.frame(s.record) for s in staged]
    records = place_in_rank_file([s.record for s in staged], fmt.data_file(rank),
                                 [(len(p), len(q)) for p, q in frames])
    return [WriteItem(r, s.data, p, q) for r, s, (p, q) in zip(records, staged, frames)]


def _on_callers_device(fn: Callable[[], T]) -> Callable[[], T]:
    """``fn`` to run on another thread, on this thread's current accelerator device.

    The current device is per thread, and object collectives over NCCL stage
    their bytes on it: on a fresh thread, device 0 for every rank of a node.
    Only where this process has initialized its accelerator (one using NCCL has): asking
    for the current device would otherwise initialize it, in a trainer whose
    state lives in host memory.
    """
    accelerator = torch.accelerator.current_accelerator()  # compiled in; neither initializes nor poisons fork
    module = None if accelerator is None else torch.get_device_module(accelerator)
    if module is None or not getattr(module, "is_initialized", lambda: False)():
        return fn
    index = torch.accelerator.current_device_index()

    def on_device() -> T:
        torch.accelerator.set_device_index(index)
        return fn()

    return on_device


@dataclass
class _ProcessWide:
    """What every save of this process shares, whichever strategy instance runs it.

    A fresh strategy per save (``sharded_strategy=FastPersistSaveStrategy()``)
    then reuses the snapshot buffer and the write plan, and an async save into a
    directory still being written is refused whoever issued the first one.
    """

    pool: SnapshotPool = field(default_factory=lambda: SnapshotPool(writer_client().add_buffer,
                                                                    writer_client().drop_buffer))
    plans: dict[Optional[tuple[int, ...]], PlanCache] = field(default_factory=dict)  # per group (None: world)
    writing: set[str] = field(default_factory=set)  # directories of async saves not yet finalized

    def plan_cache(self, ranks: Optional[tuple[int, ...]]) -> PlanCache:
        """The plan cache of the saves planned over ``ranks`` (a cache holds one group's structure)."""
        return self.plans.setdefault(ranks, PlanCache())


# This process's shared save state (a forked child starts its own: buffers are shared memory).
_process_wide = PerProcess(_ProcessWide).get


class SaveEngine:
    """Saves with one configuration and format; plan, buffers and writer are per process."""

    def __init__(self, config: WriteConfig, fmt: CheckpointFormat, group: Optional[dist.ProcessGroup] = None):
        self.config = config
        self.fmt = fmt
        self.group = group  # ranks that exchange shard lists and plan together (None: the world)

    def load_ops(self) -> None:
        """Load DeepSpeed's native ops and the snapshot's streaming copy here; start the rank's writer process
        and wait until it serves with this configuration's aio handle and bounce buffer.

        Seconds, once per process; without it the first async save becomes durable that much later.
        """
        preload_ops(self.config)
        host_copy.prepare()
        writer_client().wait_ready(self.config)

    @property
    def plan_reused(self) -> bool:
        """Whether the last save reused the cached write plan (same shard structure, no re-planning)."""
        return _process_wide().plan_cache(self._ranks()).reused

    def _ranks(self) -> Optional[tuple[int, ...]]:
        """The global ranks of the planning group, or None for the whole world."""
        return None if self.group is None else tuple(dist.get_process_group_ranks(self.group))

    def _me(self) -> int:
        """This rank's index in the planning group."""
        me = dist.get_rank(self.group)
        if me < 0:
            raise ValueError(f"rank {dist.get_rank()} is not a member of the strategy's parallel_group")
        return me

    def _outgoing(self, held: list[ShardRecord]) -> Outgoing:
        """What this rank sends in the plan exchange (:meth:`PlanCache.outgoing`: its digest, records if new)."""
        return _process_wide().plan_cache(self._ranks()).outgoing(self._me(), held)

    def _plan(self, out: Outgoing, error: Optional[str], what: str) -> list[ShardRecord]:
        """Collective: what this rank writes (``out``: its :meth:`_outgoing`), planned within its group; or the
        same error on every rank.

        Shard lists travel within the group only; a group's failure (a rank's
        error, or no valid plan) is then agreed over the world, so every rank
        raises it before anything is invalidated.
        """
        me = self._me()
        ranks = self._ranks()
        plans = _process_wide().plan_cache(ranks)
        agreement = before_writing(what)
        gathered = agreement.gather(failure(error) or out, self.group)
        failures = [v.error for v in gathered if isinstance(v, Failed)]
        plan: list[list[ShardRecord]] = []
        if not failures:
            try:  # the same in the whole group: the plan is a function of the gathered data
                plan = plans.plan(gathered, self.config.balance, ranks)
            except PlanError as e:
                failures = [str(e)]
        if self.group is not None:
            failures = [f for group_failures in agreement.gather(failures) for f in group_failures]
        agreement.raise_if(failures)
        if me == 0:
            _log_plan(plan, plans.reused, ranks)
        return plan[me]

    def _stage(self, sharded_state_dict: dict, rank: int) -> tuple[list[StagedShard], Optional[str]]:
        """This rank's shards, or the error that every rank will raise after the plan exchange."""
        try:
            return stage(sharded_state_dict, rank, self.fmt), None
        except FastPersistError as e:
            return [], str(e)

    def reserve_snapshot(self, sharded_state_dict: dict) -> None:
        """Collective: plan the saves of this state and allocate their snapshot buffer now, without copying.

        Allocating and mapping the buffer is most of the first async save call
        of a process (docs/async.md); done at start-up, that call copies only.
        """
        rank = dist.get_rank()
        staged, error = self._stage(sharded_state_dict, rank)
        out = self._outgoing([s.record for s in staged])
        staged = assign(staged, self._plan(out, error, "cannot reserve a snapshot"), rank)
        _process_wide().pool.reserve(staged)

    def prepare(self, sharded_state_dict: dict, checkpoint_dir: str, snapshot: bool,
                aux_files: Optional[dict[str, bytes]] = None, refusal: Optional[str] = None,
                tier: Optional[TieredSave] = None) -> SaveJob:
        """Collective: everything up to the write. ``snapshot``: copy the data (async), else write from it.

        ``aux_files`` (name -> bytes) are committed by rank 0 with the checkpoint.
        ``refusal``: the caller's reason why this rank cannot go on; like a bad
        input, every rank then raises it after the plan exchange, before anything
        is touched. ``tier``: a tiered save (``engine/tiers/save.py``): each rank
        writes into its node's copy, committed there, then moved to
        ``checkpoint_dir`` in the background.
        """
        persistent, aux_files = str(checkpoint_dir), aux_files or {}
        rank = dist.get_rank()
        ckpt = tier.local if tier is not None else persistent
        shared = _process_wide()
        target = os.path.realpath(ckpt)
        if target in shared.writing:  # the same on every rank: finalize is collective
            raise SaveFailedError(
                f"rank {rank}: {ckpt} is still being written by an earlier async save of this process; "
                "finalize that one first (e.g. AsyncSaveQueue.maybe_finalize(blocking=True)); its data files were "
                "not touched"
            )
        phases = Phases()
        staged, error = self._stage(sharded_state_dict, rank)
        error = refusal or error
        out = self._outgoing([s.record for s in staged])
        phases.mark("describe")
        commit = partial(finalize_save, ckpt, self.config.checksum_block_bytes, self.fmt, aux_files, self.group,
                         tier is not None)
        if not snapshot:
            staged = assign(staged, self._agree(ckpt, out, error, phases, tier), rank)
            to_elements(staged)
            items = _items(staged, self.fmt, rank, self.config.separation_hint)
            phases.mark("frame")
            logger.debug("fastpersist: rank %d prepared its share of %s: %s", rank, ckpt, phases)
            return SaveJob(write_and_report, (ckpt, items, self.config, rank, self.fmt.data_file(rank)),
                           [self._committing(commit, tier, aux_files, follow=False)])
        staged, lease = self._snapshot(staged, out, ckpt, error, phases, tier)
        address, writer_pid = writer_client().ensure_running()
        items = _items(staged, self.fmt, rank, self.config.separation_hint)
        data_file = self.fmt.data_file(rank)
        job = WriterJob(ckpt, data_file, describe_items(items, lease[1]), self.config, rank)
        # The writer is done with the buffer and directory once finalize runs, whatever the outcome.
        finalize = [partial(shared.pool.release, lease), partial(shared.writing.discard, target),
                    self._committing(commit, tier, aux_files, follow=True)]
        shared.writing.add(target)
        phases.mark("frame")
        logger.debug("fastpersist: rank %d prepared its share of %s: %s", rank, ckpt, phases)
        return SaveJob(write_in_writer, (address, writer_pid, job), finalize)

    def _committing(self, commit: Callable[[], Any], tier: Optional[TieredSave], aux_files: dict[str, bytes],
                    follow: bool) -> Callable[[], Any]:
        """The commit step of a save whose write plan is agreed: a tiered save's drain is queued now, and so is
        the local commit of an async one (``follow``: the write runs in the writer process), which its finalize
        then waits for (``TieredSave.commit_when_written``)."""
        if tier is None:
            return commit
        committed = tier.drain_beside(self.fmt.data_file(dist.get_rank()))
        if follow:
            return tier.commit_when_written(commit, self.fmt, aux_files, committed)
        return partial(tier.commit, commit, self.fmt, aux_files, committed)

    def _agree(self, ckpt: str, out: Outgoing, error: Optional[str], phases: Phases,
               tier: Optional[TieredSave] = None) -> list[ShardRecord]:
        """Collective: check the directory, agree on the plan, invalidate the old checkpoint; what this rank writes.

        Raises the same ``SaveFailedError`` on every rank if any rank cannot go
        on; nothing on disk is touched before every rank has agreed. A tiered
        save's directory is each node's own: nothing to compare across ranks.
        Each rank first waits for its copies (``tiers/background.py``) of a
        tiered checkpoint saved into the same directory before, before the
        collectives: no rank removes a file while another's copies read it;
        and records that the save began, so that a removal of the directory
        asked for before keeps it (``tiers/removal.py``).
        """
        rank = dist.get_rank()
        if tier is not None:
            tier.begin()
        else:
            begin_save(ckpt, None, f"rank {rank} ({describe_node()})")
        if error is None:  # every rank: a node-local directory may be missing or read-only on one node only
            error = check_target_directory(ckpt)
        # collective: every rank
        not_shared = check_shared_directory(ckpt, self.config.require_shared_dir and tier is None)
        what = f"cannot save checkpoint {ckpt}"
        records = self._plan(out, error or not_shared, what)
        phases.mark("check+exchange+plan")
        prep_error = None
        rewritten = frozenset(self.fmt.data_file(r) for r in range(dist.get_world_size()))
        if tier is not None or rank == 0:
            try:
                invalidate(ckpt, rewritten) if tier is None else tier.invalidate(rewritten)
            except (OSError, FastPersistError) as e:  # e.g. an object store that cannot be reached
                prep_error = f"rank {rank}: preparing {ckpt} failed: {e}"
        before_writing(what).agree(failure(prep_error))
        phases.mark("invalidate")
        return records

    def _snapshot(self, staged: list[StagedShard], out: Outgoing, ckpt: str, error: Optional[str],
                  phases: Phases, tier: Optional[TieredSave]) -> tuple[list[StagedShard], Lease]:
        """Collective: agree (:meth:`_agree`) and copy this rank's share into a snapshot buffer.

        The write plan of a save of an unchanged structure is known before the
        exchange (the cached one), so the copy starts at once and the
        agreement's collectives and file-system calls run beside it on a
        thread; it is redone in the rare case that the plan changed (another
        rank's structure did). A rank that already knows it must refuse copies nothing.
        """
        rank = dist.get_rank()
        shared = _process_wide()
        pool = shared.pool
        guess = None if error else shared.plan_cache(self._ranks()).predicted(self._me(), out[0], self.config.balance)
        if guess is None:
            assigned = assign(staged, self._agree(ckpt, out, error, phases, tier), rank)
            return assigned, pool.snapshot(assigned, phases)
        beside = Phases()
        with ThreadPoolExecutor(1, thread_name_prefix="fastpersist-agree") as thread:
            agreed = thread.submit(_on_callers_device(partial(self._agree, ckpt, out, error, beside, tier)))
            assigned = assign(staged, guess, rank)
            lease = pool.snapshot(assigned, phases)
            try:
                records = agreed.result()
            except BaseException:
                pool.release(lease)
                raise
        phases.mark("agreement")  # what the copy did not hide
        logger.debug("fastpersist: rank %d agreed on %s beside its copy: %s", rank, ckpt, beside)
        if records != guess:
            logger.debug("fastpersist: rank %d: the write plan of %s changed; copying its share again", rank, ckpt)
            pool.release(lease)
            assigned = assign(staged, records, rank)
            lease = pool.snapshot(assigned, phases)
        return assigned, lease
