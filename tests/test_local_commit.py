"""An async tiered save's local commit, made beside training once every rank's writer is done: before the
training loop's next finalize, off the trainer's thread, within planning groups as without, and not held behind an
earlier request that was never scheduled, nor behind an earlier save's write-through copy. (A write that fails
fails the commit on every rank: ``tests/test_faults.py``, a writer killed while it writes through.)
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import pytest
import torch.distributed as dist
from megatron.core import dist_checkpointing

from fastpersist_dist import FastPersistLoadStrategy, TierConfig, checkpoint_state, wait_copies, wait_durable
from fastpersist_dist.engine.async_queue import AsyncSaveQueue
from fastpersist_dist.engine.writer_process import writer_client
from fastpersist_dist.format.index_pages import PART_FILE_RE, part_file_name
from fastpersist_dist.format.records import data_file_name, status_file_name
from fastpersist_dist.format.tiers import local_copy_dir
from fastpersist_dist.storage.files import TMP_SUFFIX, written_through_name
from fastpersist_dist.tools.ranks import run_ranks
from fastpersist_dist.tools.verify import verify_checkpoint

from .helpers import ASYNC_KW, assert_same, global_tensor, load, logged, make_dir, native_strategy, sharded
from .states import async_save, async_state, check_loaded, dp_group, load_and_compare, mutate, snapshot, \
    template, tp_dp_state

pytestmark = pytest.mark.engine

DEADLINE_S = 120  # what the waits below allow the background work; a save this small takes well under a second


def _committed_before_finalize(rank: int, world: int, root: str, write_through: bool) -> dict:
    """One async tiered save, scheduled; the loop goes on without ever finalizing until it is durable."""
    records = logged("fastpersist_dist", logging.INFO)
    sd = async_state(rank, world)
    want = snapshot(sd)
    strategy = native_strategy(tiers=TierConfig(f"{root}/local", write_through=write_through))
    queue, ckpt = AsyncSaveQueue(), f"{root}/persistent/step1"
    queue.schedule(async_save(sd, ckpt, strategy))
    mutate(sd, 0)  # training goes on
    durable = wait_durable(ckpt, timeout=DEADLINE_S)
    state_before_finalize = checkpoint_state(ckpt)
    load_and_compare(sd, want, ckpt)  # a plain load, before finalize: megatron's metadata.json is there already
    finalized = queue.maybe_finalize(blocking=True)
    commits = [r for r in records if "committed to the local tiers" in r.getMessage()]
    return {"durable": durable, "state": state_before_finalize, "finalized": finalized,
            "threads": sorted({r.threadName for r in commits})}


@pytest.mark.parametrize("write_through", [False, True], ids=["copied", "written through"])
def test_an_async_save_is_committed_and_durable_before_its_finalize(tmp_path, write_through):
    """Neither rank calls finalize: the local commit comes on its own once both writers are done (on the commit
    thread, not the trainer's), and the drain makes the checkpoint durable; finalize then only takes the outcome.
    Before, the commit waited for finalize, and so did the copy to the persistent tier."""
    outcomes = run_ranks(2, _committed_before_finalize, str(tmp_path), write_through)
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
        time.sleep(0.5)  # many rounds of B's commit, none of which may take B's write for over
        state_while_stopped = checkpoint_state(f"{root}/persistent/b")
    finally:
        os.kill(writer, signal.SIGCONT)
    finalized += queue.maybe_finalize(blocking=True)
    load_and_compare(sd, want, f"{root}/persistent/b")
    return {"finalized": finalized, "b while its writer was stopped": state_while_stopped}


def test_finalizing_a_committed_save_leaves_the_next_ones_commit_waiting_for_its_writers(tmp_path):
    """Save A is committed beside training and finalized only once save B is on its way: A's finalize must not
    take B's write for over (it marks only commits queued ahead of its own, and A's is done), or B's commit
    would run before its writers left their statuses and fail."""
    outcomes = run_ranks(2, _finalized_while_the_next_one_writes, str(tmp_path))
    assert outcomes == [{"finalized": [1, 2], "b while its writer was stopped": None}] * 2, outcomes


def _taken_while_an_earlier_copy_is_written(rank: int, world: int, local: str, root: str) -> dict:
    """Save A (256 MiB per rank) written through, its copy to the disk slow (a single bounce buffer of 1 MiB: each
    O_DIRECT write waits for the disk); on rank 1 the writer is stopped once A's local file is there and its copy
    is not, and save B handed to it before it goes on."""
    records = logged("fastpersist_dist.engine.writer_process", logging.INFO)
    strategy = native_strategy(tiers=TierConfig(local, write_through=True), io_buffer_mb=1, double_buffer=False)
    queue, saves = AsyncSaveQueue(), {"a": (f"{root}/a", (16384, 8192)), "b": (f"{root}/b", (64, 256))}
    states = {k: {k: sharded(k, global_tensor(k, shape), rank, world, 0)} for k, (_, shape) in saves.items()}
    for path, _ in saves.values():
        make_dir(path)
    dist.barrier()
    a, b = saves["a"][0], saves["b"][0]
    queue.schedule(dist_checkpointing.save(states["a"], a, sharded_strategy=strategy, async_sharded_save=True,
                                           **ASYNC_KW))
    a_copy_pending = None
    if rank == 1:
        writer = writer_client().pid
        while not os.path.exists(f"{local_copy_dir(local, a)}/{status_file_name(rank)}"):
            time.sleep(0.001)
        os.kill(writer, signal.SIGSTOP)
        a_copy_pending = not os.path.exists(written_through_name(f"{a}/{data_file_name(rank)}"))
        threading.Timer(0.5, os.kill, (writer, signal.SIGCONT)).start()  # B's job reaches it meanwhile
    queue.schedule(dist_checkpointing.save(states["b"], b, sharded_strategy=strategy, async_sharded_save=True,
                                           **ASYNC_KW))
    queue.maybe_finalize(blocking=True)
    durable = [wait_durable(path, timeout=DEADLINE_S) for path, _ in saves.values()]
    wait_copies()
    dist.barrier()
    for key, (path, shape) in saves.items():
        want = global_tensor(key, shape)
        assert_same(load({key: sharded(key, want.clone().zero_(), rank, world, None)}, path)[key], want, path)
        assert verify_checkpoint(path).ok, path
    queue.close()
    return {"a copy pending": a_copy_pending, "durable": durable, "left": [os.listdir(p) for p, _ in saves.values()],
            "said": [r.getMessage() for r in records if r.levelno >= logging.INFO]}


def test_a_save_handed_over_while_an_earlier_one_is_written_through_commits_without_waiting_for_that_copy(
        shm_dir, tmp_path):
    """Rank 1's writer takes save B as soon as A's local file is written, while A's write-through copy goes on,
    and makes no copy of B (its drain copies B's file from the local tier): the local commit of each save waits
    for its local files only, not for the persistent tier's copies of the saves before it (with a persistent tier
    slower than the saves come, they would queue behind the copies). Both checkpoints become durable and load."""
    outcomes = run_ranks(2, _taken_while_an_earlier_copy_is_written, shm_dir, str(tmp_path))
    assert outcomes[1]["a copy pending"], "rank 1's writer finished its copy before it could be stopped"
    for o in outcomes:
        assert o["durable"] == [True, True], o
        assert not [n for left in o["left"] for n in left if n.endswith(TMP_SUFFIX)], o["left"]
    said = " | ".join(outcomes[1]["said"])
    assert f"{data_file_name(1)} is not written through" in said and "still writing an earlier save's copy" in said \
        and "the drain copies it from the local tier" in said, said
