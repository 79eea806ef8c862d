"""``FastPersistSaveStrategy``: megatron's async save contract over our write path.

The adapter only sequences the pieces: stage (describe what this rank holds),
exchange descriptions and agree on a write plan across ranks (one collective),
prepare the directory, take host bytes of this rank's share, and hand back an
``AsyncRequest`` whose ``async_fn`` writes the data file and whose finalize
commits the index. ``save`` runs the very same request synchronously.
"""

from __future__ import annotations

import gc
import logging
import os
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.mapping import ShardedStateDict
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.base import AsyncSaveShardedStrategy

from ..commit import (
    agree,
    check_target_directory,
    finalize_save,
    gather_or_fail,
    invalidate,
    raise_if,
    write_status,
)
from ..config import WriteConfig
from ..errors import FastPersistError, SaveFailedError
from ..format import BACKEND, BACKEND_VERSION, data_file_name
from ..plan import PlanCache, PlanError, place_in_rank_file
from ..staging import SnapshotPool, assign, stage, to_host_bytes
from ..storage.writer import preload_ops, write_rank_file
from ..timing import Phases

logger = logging.getLogger(__name__)


def _write_and_report(checkpoint_dir: str, shards: list, config: WriteConfig, rank: int, owner_pid: int) -> None:
    """The async part: write this rank's file and leave a status; never raises (see commit.py).

    Run in a process forked from the trainer (any async caller), torch's OpenMP
    pool inherited from the parent deadlocks on the first parallel copy, so the
    writer then uses one intra-op thread: it is I/O-bound anyway.
    """
    if os.getpid() != owner_pid:
        torch.set_num_threads(1)
    path = os.path.join(checkpoint_dir, data_file_name(rank))
    try:
        result = write_rank_file(path, shards, config, rank)
    except BaseException as e:  # noqa: BLE001 - reported to every rank at finalize
        logger.error("fastpersist: rank %d failed writing %s: %s", rank, path, e)
        write_status(checkpoint_dir, rank, None, e)
        return
    write_status(checkpoint_dir, rank, result, None)


def _exchange(outgoing: Any, local_error: Optional[str], what: str) -> list[Any]:
    """Collective: every rank's ``outgoing`` (shard metadata), or the same error on every rank."""
    gathered = gather_or_fail((local_error, outgoing), what)
    raise_if([err for err, _ in gathered], what)
    return [out for _, out in gathered]


def _log_plan(plan: list[list], reused: bool) -> None:
    per_rank = [sum(r.length for r in records) for records in plan]
    mean = sum(per_rank) / len(per_rank)
    logger.info(
        "fastpersist: write plan %s: %d records, bytes per rank %s (max/mean %.3f)",
        "reused" if reused else "made", sum(map(len, plan)), per_rank, max(per_rank) / mean if mean else 1.0,
    )


@contextmanager
def _gc_paused() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class FastPersistSaveStrategy(AsyncSaveShardedStrategy):
    """Writes each rank's main-replica shards through DeepSpeed DeepNVMe.

    Knobs are those of :class:`fastpersist_dist.config.WriteConfig`, given
    either as ``config=`` or as keyword arguments.
    """

    def __init__(
        self,
        backend: str = BACKEND,
        version: int = BACKEND_VERSION,
        config: Optional[WriteConfig] = None,
        **knobs: Any,
    ):
        super().__init__(backend, version)
        if config is not None and knobs:
            raise ValueError("pass either config= or individual knobs, not both")
        self.config = config or WriteConfig(**knobs)
        self._pool = SnapshotPool()
        self._plans = PlanCache()
        self._writing: set[str] = set()  # directories of async saves not yet finalized

    def load_ops(self) -> None:
        """Load DeepSpeed's native ops in this process now (seconds, once per process).

        ``async_save`` does it before forking its writer, so the first async save
        of a process blocks that much longer; call this at start-up to move the
        cost out of the first checkpoint.
        """
        preload_ops(self.config)

    @property
    def can_handle_sharded_objects(self) -> bool:
        """ShardedObjects go into our data files too (checksummed like tensors)."""
        return True

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Union[str, Path]) -> None:
        """Synchronous save: tensors are written from where they are, without a snapshot copy.

        Not ``AsyncRequest.execute_sync``: its bare barrier between the write and
        the commit would meet a dead rank with gloo's raw error; finalize's own
        collectives synchronize and report it as ``SaveFailedError``.
        """
        request = self._request(sharded_state_dict, checkpoint_dir, snapshot=False)
        request.async_fn(*request.async_fn_args, **(request.async_fn_kwargs or {}))
        for finalize in request.finalize_fns:
            finalize()

    def async_save(
        self,
        sharded_state_dict: ShardedStateDict,
        checkpoint_dir: Union[str, Path],
        async_strategy: Optional[str] = None,
    ) -> AsyncRequest:
        """Stage a snapshot of every shard and return the request that writes and commits it.

        ``async_strategy`` is accepted for newer megatron-core callers; the request
        runs under whichever caller schedules it.
        """
        return self._request(sharded_state_dict, checkpoint_dir, snapshot=True)

    def _request(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Union[str, Path], snapshot: bool) -> AsyncRequest:
        # A full garbage collection over a trainer's heap, triggered by the many small
        # objects of the metadata exchange, cost 0.36 s of a 0.7 s blocking save here.
        with _gc_paused():
            return self._build_request(sharded_state_dict, checkpoint_dir, snapshot)

    def _build_request(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Union[str, Path], snapshot: bool) -> AsyncRequest:
        ckpt = str(checkpoint_dir)
        rank = dist.get_rank()
        target = os.path.realpath(ckpt)
        if target in self._writing:  # the same on every rank: finalize is collective
            raise SaveFailedError(
                f"rank {rank}: {ckpt} is still being written by an earlier async save of this strategy; "
                "finalize that one first (e.g. AsyncSaveQueue.maybe_finalize(blocking=True)); its data files were "
                "not touched (megatron's save() rewrites common.pt before calling the strategy)"
            )
        phases = Phases()
        error: Optional[str] = None
        staged: list = []
        try:
            staged = stage(sharded_state_dict, rank)
        except FastPersistError as e:
            error = str(e)
        if error is None:  # every rank: a node-local directory may be missing or read-only on one node only
            error = check_target_directory(ckpt)
        what = f"cannot save checkpoint {ckpt}"
        phases.mark("describe")
        gathered = _exchange(self._plans.outgoing(rank, [s.record for s in staged]), error, what)
        try:
            plan = self._plans.plan(gathered, self.config.balance)
        except PlanError as e:  # the same on every rank: the plan is a function of the gathered data
            raise SaveFailedError(f"{what}; nothing was written: {e}") from None
        if rank == 0:
            _log_plan(plan, self._plans.reused)
        staged = assign(staged, plan[rank], rank)
        phases.mark("exchange+plan")
        prep_error = None
        if rank == 0:
            try:
                invalidate(ckpt)
            except OSError as e:
                prep_error = f"rank 0: preparing {ckpt} failed: {e}"
        agree(prep_error, what)
        phases.mark("invalidate")
        finalize_fns = [partial(finalize_save, ckpt, self.config.checksum_block_bytes)]
        if snapshot:
            # The writer is done with the buffer and directory once finalize runs, whatever the outcome.
            finalize_fns[:0] = [partial(self._pool.release, self._pool.snapshot(staged)),
                                partial(self._writing.discard, target)]
            self._writing.add(target)
            phases.mark("snapshot")
            self.load_ops()
            phases.mark("load ops")
        else:
            to_host_bytes(staged)
            phases.mark("host bytes")
        logger.info("fastpersist: rank %d prepared its share of %s: %s", rank, ckpt, phases)
        records = place_in_rank_file([s.record for s in staged], rank)
        shards = [(r, s.data) for r, s in zip(records, staged)]
        return AsyncRequest(
            async_fn=_write_and_report, async_fn_args=(ckpt, shards, self.config, rank, os.getpid()),
            finalize_fns=finalize_fns,
        )
