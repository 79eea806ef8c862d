"""An async tiered save's local commit, made beside training once every rank's writer is done: before the
training loop's next finalize, off the trainer's thread, within planning groups as without, and not held behind an
earlier request that was never scheduled. (A write that fails fails the commit on every rank:
``tests/test_faults.py``, a writer killed while it writes.)
"""

from __future__ import annotations

import logging
import os
import signal
import time

import pytest
from megatron.core import dist_checkpointing

from fastpersist_dist import FastPersistLoadStrategy, TierConfig, checkpoint_state, wait_durable
from fastpersist_dist.engine.async_queue import AsyncSaveQueue
from fastpersist_dist.engine.tiers.background import _committer
from fastpersist_dist.engine.writer_process import writer_client
from fastpersist_dist.format.index_pages import PART_FILE_RE, part_file_name
from fastpersist_dist.tools.ranks import run_ranks
from fastpersist_dist.tools.verify import verify_checkpoint
from fastpersist_dist.util.events import COMMITTED_LOCALLY, event_of

from .helpers import logged, native_strategy
from .states import async_save, async_state, check_loaded, dp_group, load_and_compare, mutate, snapshot, \
    template, tp_dp_state

pytestmark = pytest.mark.engine

DEADLINE_S = 120  # what the waits below allow the background work; a save this small takes well under a second


def _committed_before_finalize(rank: int, world: int, root: str) -> dict:
    """One async tiered save, scheduled; the loop goes on without ever finalizing until it is durable."""
    records = logged("fastpersist_dist", logging.INFO)
    sd = async_state(rank, world)
    want = snapshot(sd)
    strategy = native_strategy(tiers=TierConfig(f"{root}/local"))
    queue, ckpt = AsyncSaveQueue(), f"{root}/persistent/step1"
    queue.schedule(async_save(sd, ckpt, strategy))
    mutate(sd, 0)  # training goes on
    durable = wait_durable(ckpt, timeout=DEADLINE_S)
    state_before_finalize = checkpoint_state(ckpt)
    load_and_compare(sd, want, ckpt)  # a plain load, before finalize: megatron's metadata.json is there already
    finalized = queue.maybe_finalize(blocking=True)
    commits = [r for r in records if event_of(r) == COMMITTED_LOCALLY]
    return {"durable": durable, "state": state_before_finalize, "finalized": finalized,
            "threads": sorted({r.threadName for r in commits})}


def test_an_async_save_is_committed_and_durable_before_its_finalize(tmp_path):
    """Neither rank calls finalize: the local commit comes on its own once both writers are done (on the commit
    thread, not the trainer's), and the drain makes the checkpoint durable; finalize then only takes the
    outcome."""
    outcomes = run_ranks(2, _committed_before_finalize, str(tmp_path))
    assert all(o["durable"] and o["state"] == "durable" and o["finalized"] == [1] for o in outcomes), outcomes
    assert outcomes[0]["threads"] == ["fastpersist-commit"], outcomes  # rank 0 logs the commit


def _in_dp_groups(rank: int, world: int, root: str) -> dict:
    strategy = native_strategy(parallel_group=dp_group(rank), tiers=TierConfig(f"{root}/local"))
    queue, ckpt = AsyncSaveQueue(), f"{root}/persistent/step1"
    queue.schedule(async_save(tp_dp_state(rank, 1), ckpt, strategy))
    durable = wait_durable(ckpt, timeout=DEADLINE_S)
    queue.maybe_finalize(blocking=True)
    check_loaded(dist_checkpointing.load(template(tp_dp_state(rank, 1)), ckpt,
                                         sharded_strategy=FastPersistLoadStrategy()), rank, 1)
    return {"durable": durable}


def test_planning_groups_commit_their_parts_beside_training(tmp_path):
    """TP=2 x DP=2 planning in DP groups: each group's first rank gets its members' statuses point to point over
    the commit group and commits the group's index part; the checkpoint is durable before finalize and loads."""
    root = str(tmp_path)
    assert run_ranks(4, _in_dp_groups, root) == [{"durable": True}] * 4
    ckpt = f"{root}/persistent/step1"
    assert sorted(n for n in os.listdir(ckpt) if PART_FILE_RE.match(n)) == [part_file_name(0), part_file_name(1)]
    report = verify_checkpoint(ckpt)
    assert report.ok, report.problems


def _dropped_then_saved(rank: int, world: int, root: str) -> dict:
    """An async tiered save whose request is never scheduled (so never written), then one that is."""
    sd = async_state(rank, world)
    strategy = native_strategy(tiers=TierConfig(f"{root}/local"))
    async_save(sd, f"{root}/persistent/dropped", strategy)  # its request dropped: no write, no status, ever
    queue = AsyncSaveQueue()
    queue.schedule(async_save(sd, f"{root}/persistent/kept", strategy))
    start = time.monotonic()
    finalized = queue.maybe_finalize(blocking=True)
    return {"finalized": finalized, "seconds": time.monotonic() - start,
            "kept": wait_durable(f"{root}/persistent/kept", timeout=DEADLINE_S)}


def test_a_request_never_scheduled_does_not_hold_the_next_saves_commit(tmp_path):
    """Commits run in the order of the saves; the first save's request is dropped, so its writer never leaves a
    status: the second save's finalize tells the first commit that its write is over (it fails on its missing
    status), and the second is committed and becomes durable."""
    outcomes = run_ranks(2, _dropped_then_saved, str(tmp_path))
    assert all(o["finalized"] == [1] and o["kept"] for o in outcomes), outcomes
    assert checkpoint_state(str(tmp_path / "persistent" / "dropped")) is None


def _finalized_while_the_next_one_writes(rank: int, world: int, root: str) -> dict:
    """Save A, committed and durable, not finalized; save B scheduled, its writer held stopped; then A finalized."""
    sd = async_state(rank, world)
    strategy = native_strategy(tiers=TierConfig(f"{root}/local"))
    queue = AsyncSaveQueue()
    queue.schedule(async_save(sd, f"{root}/persistent/a", strategy))
    assert wait_durable(f"{root}/persistent/a", timeout=DEADLINE_S)
    want = snapshot(sd)
    queue.schedule(async_save(sd, f"{root}/persistent/b", strategy))
    writer = writer_client().pid
    os.kill(writer, signal.SIGSTOP)  # B's write cannot end before A's finalize
    try:
        finalized = queue.maybe_finalize(blocking=False)  # A only: B's writer is still busy
        # B's local commit, queued and not run: A's finalize must not have told it that B's writes are over
        (b_commit,) = [job for job in _committer.get().open_jobs() if job.checkpoint_dir.endswith("/persistent/b")]
        released = b_commit.written.is_set()
        state_while_stopped = checkpoint_state(f"{root}/persistent/b")
    finally:
        os.kill(writer, signal.SIGCONT)
    finalized += queue.maybe_finalize(blocking=True)
    load_and_compare(sd, want, f"{root}/persistent/b")
    return {"finalized": finalized, "b released": released, "b while its writer was stopped": state_while_stopped}


def test_finalizing_a_committed_save_leaves_the_next_ones_commit_waiting_for_its_writers(tmp_path):
    """Save A is committed beside training and finalized only once save B is on its way: A's finalize must not
    take B's write for over (it marks only commits queued ahead of its own, and A's is done), or B's commit
    would run before its writers left their statuses and fail."""
    outcomes = run_ranks(2, _finalized_while_the_next_one_writes, str(tmp_path))
    assert outcomes == [{"finalized": [1, 2], "b released": False, "b while its writer was stopped": None}] * 2, \
        outcomes
