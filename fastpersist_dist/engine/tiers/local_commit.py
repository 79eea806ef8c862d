"""An async tiered save's local commit, made beside training as soon as every rank's writer is done
(docs/design.md, "The local commit"): each rank's committer waits for its own writer's status file, the ranks
agree in one all-reduce over a gloo group of their own, then commit over it; finalize takes the outcome.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from ...format.tiers import TierManifest
from ...util.errors import SaveFailedError
from ...util.per_process import PerProcess

logger = logging.getLogger(__name__)

POLL_S = 0.01  # how often a rank's committer looks for its own writer's status file

_groups: PerProcess[dict[int, dist.ProcessGroup]] = PerProcess(dict)


def commit_group() -> dist.ProcessGroup:
    """Collective on first use in a process (per world size): a gloo group of every rank for the local commits
    made beside training, whose collectives never interleave with the trainer's (which may run on NCCL)."""
    known = _groups.get()
    world = dist.get_world_size()
    if world not in known:
        known[world] = dist.new_group(backend="gloo")
    return known[world]


@dataclass
class LocalCommit:
    """One rank's part of an async tiered save's local commit."""

    rank: int
    checkpoint_dir: str  # the persistent tier's (for messages)
    status: str  # the status file this rank's writer leaves once done (engine/status.py)
    group: dist.ProcessGroup  # commit_group()
    commit: Callable[[], TierManifest]  # TieredSave.commit, its collectives over ``group``
    committed: "Future[TierManifest]"  # the drain's (TieredSave.drain_beside): told where none is made
    result: "Future[TierManifest]" = field(default_factory=Future)
    written: threading.Event = field(default_factory=threading.Event)  # finalize: every rank's write is over
    given_up: threading.Event = field(default_factory=threading.Event)  # the process exits

    def done_here(self) -> bool:
        """Whether this rank's write is over: its writer's status is there, or finalize said so."""
        return self.written.is_set() or os.path.exists(self.status)


def await_writers_and_commit(job: LocalCommit) -> None:
    """The wait for every writer, then the commit (see the module); its outcome in ``job.result``."""
    try:
        _wait_for_writers(job)
        job.result.set_result(job.commit())
    except BaseException as e:  # noqa: BLE001 - raised at finalize, on every rank alike
        logger.debug("fastpersist: rank %d: the local commit of %s failed: %s", job.rank, job.checkpoint_dir, e)
        try:  # where the commit was not reached, the drain learns it here
            job.committed.set_exception(e)
        except InvalidStateError:  # told by the commit itself, or by the exit
            pass
        job.result.set_exception(e)


def _wait_for_writers(job: LocalCommit) -> None:
    """Return once every rank's writer is done; raise ``SaveFailedError`` on every rank where a rank gave up or
    died first."""
    start = time.perf_counter()
    while not (job.done_here() or job.given_up.wait(POLL_S)):
        pass
    flags = torch.tensor([int(job.done_here()), int(job.given_up.is_set())], dtype=torch.int64)
    try:
        dist.all_reduce(flags, group=job.group)
    except RuntimeError as e:  # torch's DistError family: a rank died or timed out
        raise SaveFailedError(
            f"rank {job.rank}: async save of {job.checkpoint_dir} cannot be committed to the local tiers, a rank "
            f"died or timed out ({type(e).__name__}: {e}); it was not committed") from e
    world = dist.get_world_size(job.group)
    done, giving_up = (int(v) for v in flags.tolist())
    if done == world:
        logger.debug("fastpersist: rank %d: every writer of %s done, committing it to the local tiers (%.2f s)",
                     job.rank, job.checkpoint_dir, time.perf_counter() - start)
        return
    raise SaveFailedError(
        f"rank {job.rank}: async save of {job.checkpoint_dir} given up: the process of {giving_up} rank(s) "
        f"exited while {world - done} of {world} writers were still writing; it was not committed")


def finalize_step(job: LocalCommit, unfinished: Callable[[], list[Any]]) -> Callable[[], None]:
    """The save's finalize step: tell the commit that every rank's write is over, wait for it, raise its error.

    ``unfinished``: the commits queued and not finished, in order. Those ahead
    of this one (a request dropped unscheduled, whose finalize never runs) are
    told their writes are over too, so that this commit is not held behind
    them: each of them then fails on the status its writer never left. Those
    after it are left alone: their saves may still be writing.
    """
    def finalize() -> None:
        queued = unfinished()
        ahead = next((i for i, other in enumerate(queued) if other is job), 0)  # not there: done, as all before it
        for other in queued[:ahead]:
            other.written.set()
        job.written.set()
        job.result.result()

    return finalize
