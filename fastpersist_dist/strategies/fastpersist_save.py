"""``FastPersistSaveStrategy``: megatron's async save contract over our write path.

The adapter only sequences the pieces: stage (validate, host bytes), agree on
success across ranks, prepare the directory, place records, and hand back an
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

from ..commit import check_target_directory, finalize_save, invalidate, write_status
from ..config import WriteConfig
from ..errors import FastPersistError, SaveFailedError
from ..format import BACKEND, BACKEND_VERSION, ShardRecord, data_file_name
from ..plan import coverage_errors, place_in_rank_file
from ..staging import SnapshotPool, stage, to_host_bytes
from ..storage.writer import preload_ops, write_rank_file

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


def _agree(local_error: Optional[str], what: str) -> None:
    """Collective: raise the same error on every rank if any rank reported one."""
    errors: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, local_error)
    _raise_if(errors, what)


def _raise_if(failures: list[Optional[str]], what: str) -> None:
    failures = [f for f in failures if f]
    if failures:
        raise SaveFailedError(f"{what}; nothing was written: " + " | ".join(failures))


def _exchange_records(records: list[ShardRecord], local_error: Optional[str], what: str) -> list[ShardRecord]:
    """Collective: every rank's records (metadata only), or the same error on every rank."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (local_error, records))
    _raise_if([err for err, _ in gathered], what)
    return [r for _, recs in gathered for r in recs]


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
        self._writing: set[str] = set()  # directories of async saves not yet finalized

    @property
    def can_handle_sharded_objects(self) -> bool:
        """ShardedObjects go into our data files too (checksummed like tensors)."""
        return True

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Union[str, Path]) -> None:
        """Synchronous save: tensors are written from where they are, without a snapshot copy."""
        self._request(sharded_state_dict, checkpoint_dir, snapshot=False).execute_sync()

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
        error: Optional[str] = None
        staged: list = []
        try:
            staged = stage(sharded_state_dict, rank)
        except FastPersistError as e:
            error = str(e)
        if rank == 0 and error is None:
            error = check_target_directory(ckpt)
        what = f"cannot save checkpoint {ckpt}"
        all_records = _exchange_records([s.record for s in staged], error, what)
        _raise_if(coverage_errors(all_records), what)
        prep_error = None
        if rank == 0:
            try:
                invalidate(ckpt)
            except OSError as e:
                prep_error = f"rank 0: preparing {ckpt} failed: {e}"
        _agree(prep_error, what)
        finalize_fns = [partial(finalize_save, ckpt, self.config.checksum_block_bytes)]
        if snapshot:
            # The writer is done with the buffer and directory once finalize runs, whatever the outcome.
            finalize_fns[:0] = [partial(self._pool.release, self._pool.snapshot(staged)),
                                partial(self._writing.discard, target)]
            self._writing.add(target)
            preload_ops(self.config)
        else:
            to_host_bytes(staged)
        records = place_in_rank_file([s.record for s in staged], rank)
        shards = [(r, s.data) for r, s in zip(records, staged)]
        return AsyncRequest(
            async_fn=_write_and_report, async_fn_args=(ckpt, shards, self.config, rank, os.getpid()),
            finalize_fns=finalize_fns,
        )
