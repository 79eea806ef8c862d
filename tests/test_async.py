"""Asynchronous saves: the call returns after staging, the state may change at once, commit at finalize."""

from __future__ import annotations

import logging
import os
import signal
import time
from functools import partial

import pytest
import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor

from fastpersist_dist import SaveFailedError
from fastpersist_dist.compat import megatron_async_queue_class
from fastpersist_dist.engine.async_queue import AsyncSaveQueue
from fastpersist_dist.engine.writer_process import writer_client
from fastpersist_dist.format.records import INDEX_FILE, data_file_name
from fastpersist_dist.tools.bench.baselines import torch_dist_cpu_shims
from fastpersist_dist.tools.ranks import run_ranks

from .helpers import ASYNC_KW, global_tensor, logged, make_dir, native_strategy, proc_status_kib, sharded
from .states import async_save, async_state, load_and_compare, mutate, snapshot

pytestmark = pytest.mark.engine


def start_first_save(rank: int, world: int, path: str):
    """A fresh state, its values at save time, and one async save of it scheduled to ``path``."""
    sd = async_state(rank, world)
    before = snapshot(sd)
    strategy = native_strategy()
    strategy.load_ops()  # as a trainer would at start-up
    queue = AsyncSaveQueue()
    queue.schedule(async_save(sd, path, strategy))
    return sd, before, strategy, queue


def _mutate_right_after_save(rank: int, world: int, root: str) -> None:
    sd, before, _, queue = start_first_save(rank, world, f"{root}/c")
    mutate(sd, 0)  # training goes on at once
    assert not os.path.exists(f"{root}/c/metadata.json") and not os.path.exists(f"{root}/c/{INDEX_FILE}")
    assert queue.maybe_finalize(blocking=True) == [1]
    load_and_compare(sd, before, f"{root}/c")


@pytest.mark.contract
def test_checkpoint_holds_state_at_save_call(tmp_path):
    for world in (2, 4):
        run_ranks(world, _mutate_right_after_save, str(tmp_path / f"w{world}"))


def _three_in_a_row(rank: int, world: int, root: str) -> list[bool]:
    sd = async_state(rank, world)
    queue = AsyncSaveQueue()
    expected, buffers = [], []
    for step in range(3):
        expected.append(snapshot(sd))
        # A fresh strategy per save, as in `save(..., sharded_strategy=FastPersistSaveStrategy())`
        request = async_save(sd, f"{root}/step{step}", native_strategy())
        buffers.append(request.finalize_fns[0].args[0][1].id)  # the snapshot buffer leased
        queue.schedule(request)
        mutate(sd, step)
        if step == 0:
            queue.maybe_finalize(blocking=True)  # step 1 then reuses step 0's buffer
        else:
            queue.maybe_finalize(blocking=False)  # step 2 may start while step 1 still writes
    queue.close()
    assert queue.pending == 0
    for step in range(3):
        load_and_compare(sd, expected[step], f"{root}/step{step}")
    return [buffers[1] == buffers[0]]


def test_three_consecutive_async_checkpoints_with_a_fresh_strategy_each(tmp_path):
    for reused in run_ranks(2, _three_in_a_row, str(tmp_path)):
        assert reused == [True]


def _two_in_flight(rank: int, world: int, root: str) -> tuple[list[str], list[tuple]]:
    sd = async_state(rank, world)
    records = logged("fastpersist_dist.engine.staging", logging.INFO)
    queue = AsyncSaveQueue()
    expected, buffers = [], []
    for step in range(4):
        expected.append(snapshot(sd))
        request = async_save(sd, f"{root}/step{step}", native_strategy())
        buffers.append(request.finalize_fns[0].args[0][1].id)  # the snapshot buffer leased
        queue.schedule(request)
        mutate(sd, step)
        if step in (1, 3):  # step 1 (3) was saved while step 0 (2) was not finalized: both buffers return now
            queue.close()
    for step in range(4):
        load_and_compare(sd, expected[step], f"{root}/step{step}")
    return [r.getMessage() for r in records if "snapshot buffer" in r.getMessage()], buffers


def test_a_save_issued_before_the_last_is_finalized_says_that_it_allocated_a_buffer(tmp_path):
    """Its call pays for a new buffer (0.29 s per 0.5 GiB here): the log says why, and how to avoid it.
    Both buffers are kept, so saves that overlap again reuse them instead of allocating in every other call."""
    for messages, buffers in run_ranks(2, _two_in_flight, str(tmp_path)):
        assert len(messages) == 1, messages  # step 1 only: step 0 makes the first, steps 2 and 3 reuse both
        assert "because 1 earlier one(s) still hold theirs; 2 are kept for later saves" in messages[0], messages
        assert "finalize each save before the next one" in messages[0], messages
        assert buffers[0] != buffers[1] and set(buffers[2:]) == set(buffers[:2]), buffers


def _structures(rank: int) -> list[dict]:
    """Steps 0-3 of one rank: a, b replicated; from step 1 rank 1 also holds c alone; at step 2 it holds a bad one."""
    def replicated(key: str) -> ShardedTensor:
        return ShardedTensor.from_rank_offsets(key, global_tensor(key, (64, 64)), replica_id=rank)

    steps = [{"a": replicated("a"), "b": replicated("b")} for _ in range(4)]
    if rank == 1:
        for sd in steps[1:]:
            sd["c"] = ShardedTensor.from_rank_offsets("c", global_tensor("c", (256, 64)), replica_id=0)
        steps[2]["bad"] = ShardedTensor.from_rank_offsets("bad", torch.zeros(2), replica_id=0)
        steps[2]["bad"].data = [1.0, 2.0]
    return steps


def _plan_changes_beside_the_copy(rank: int, world: int, root: str) -> tuple[list[str], bool]:
    records = logged("fastpersist_dist.engine.save", logging.DEBUG)
    queue, buffers = AsyncSaveQueue(), {}
    for step, sd in enumerate(_structures(rank)):
        before = snapshot(sd) if step != 2 else None
        make_dir(f"{root}/s{step}")
        save = partial(dist_checkpointing.save, sd, f"{root}/s{step}", sharded_strategy=native_strategy(),
                       async_sharded_save=True, validate_access_integrity=False, **ASYNC_KW)
        if step == 2:  # rank 0's structure is unchanged, so it copies its share before rank 1's refusal arrives
            with pytest.raises(SaveFailedError, match="rank 1: ShardedTensor 'bad' holds list"):
                save()
            continue
        request = save()
        buffers[step] = request.finalize_fns[0].args[0][1].id
        queue.schedule(request)
        mutate(sd, step)
        queue.close()
        load_and_compare(sd, before, f"{root}/s{step}")
    recopied = [r.getMessage() for r in records if "changed; copying its share again" in r.getMessage()]
    return recopied, buffers[3] == buffers[1]  # the refused save returned the buffer it had copied into


def test_a_plan_that_changes_under_an_unchanged_rank_is_copied_again_and_a_refusal_returns_the_buffer(tmp_path):
    """A save of an unchanged structure copies by the cached plan while the ranks agree on a thread (it hides
    the collectives and the directory's file-system calls behind the copy); the agreed plan decides."""
    (recopied0, reused0), (recopied1, reused1) = run_ranks(2, _plan_changes_beside_the_copy, str(tmp_path))
    assert len(recopied0) == 1 and "/s1" in recopied0[0], recopied0  # step 1: c moved a or b to rank 0
    assert recopied1 == []  # rank 1's own structure changed: it waited for the plan
    assert reused0 and reused1
    assert not os.path.exists(tmp_path / "s2" / INDEX_FILE)


def _background_write_fails(rank: int, world: int, root: str) -> str:
    sd, good, strategy, queue = start_first_save(rank, world, f"{root}/good")
    queue.close()
    request = async_save(sd, f"{root}/bad", strategy)
    if rank == 1:  # the writer process cannot replace a directory by its data file: its write fails
        os.mkdir(f"{root}/bad/fastpersist_r00001.bin")
    queue.schedule(request)
    with pytest.raises(SaveFailedError) as info:
        queue.maybe_finalize(blocking=True)
    assert queue.pending == 0
    load_and_compare(sd, good, f"{root}/good")  # the previous checkpoint is untouched
    return str(info.value)


def test_background_write_error_surfaces_at_finalize_on_all_ranks(tmp_path):
    messages = run_ranks(2, _background_write_fails, str(tmp_path))
    for m in messages:
        assert "was NOT saved" in m and "rank 1:" in m and "fastpersist_r00001.bin" in m, m
    assert not os.path.exists(tmp_path / "bad" / "metadata.json")
    assert not os.path.exists(tmp_path / "bad" / INDEX_FILE)


def _waiter_of(writer: int) -> int:
    """The pid of this trainer's child that waits for ``writer`` (stopped) in an interpreter of its own: the
    process megatron's queue forked, replaced by a fresh one. Fails after a minute without one."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/children") as f:
                for child in f.read().split():
                    with open(f"/proc/{child}/cmdline", "rb") as c:
                        argv = c.read().split(b"\0")
                    if argv[1:4] == [b"-S", b"-I", b"-c"] and argv[-2:-1] == [str(writer).encode()]:
                        return int(child)
        time.sleep(0.01)
    raise AssertionError(f"no child of {os.getpid()} waits for writer {writer} in an interpreter of its own")


def _megatron_queue(rank: int, world: int, root: str) -> None:
    sd = async_state(rank, world)
    queue = megatron_async_queue_class()()
    expected = []
    with torch_dist_cpu_shims():  # its temporal caller calls torch.cuda unconditionally
        for step in range(2):  # a fresh strategy per save; the second save starts before the first is finalized
            expected.append(snapshot(sd))
            request = async_save(sd, f"{root}/m{step}", native_strategy())
            writer = writer_client().pid
            if step == 0:  # the first held until the process the queue forked for it is seen replaced
                os.kill(writer, signal.SIGSTOP)
            queue.schedule_async_request(request)
            mutate(sd, step)
            if step == 0:
                try:
                    _waiter_of(writer)
                finally:
                    os.kill(writer, signal.SIGCONT)
        assert not os.path.exists(f"{root}/m0/metadata.json")  # megatron's finalize writes it
        queue.maybe_finalize_async_calls(blocking=True)
        queue.close()
    for step in range(2):
        load_and_compare(sd, expected[step], f"{root}/m{step}")


@pytest.mark.contract
def test_megatron_async_calls_queue_forks_the_caller_and_our_writer_writes(tmp_path):
    """megatron's own queue (its temporal caller forks the trainer for each request): the values of the call
    are saved, and the forked process waits for our writer as a fresh interpreter, sharing no page with the
    trainer (while a fork lives, each page the trainer writes is copied)."""
    run_ranks(2, _megatron_queue, str(tmp_path))


def _megatron_queue_writer_killed(rank: int, world: int, root: str) -> str:
    sd = async_state(rank, world)
    queue = megatron_async_queue_class()()
    with torch_dist_cpu_shims():
        request = async_save(sd, f"{root}/m", native_strategy())
        writer = writer_client().pid
        if rank == 1:  # killed before it wrote: the process waiting for it reads the end of the connection
            os.kill(writer, signal.SIGSTOP)
        queue.schedule_async_request(request)
        if rank == 1:
            _waiter_of(writer)
            os.kill(writer, signal.SIGKILL)
        with pytest.raises(SaveFailedError) as info:
            queue.maybe_finalize_async_calls(blocking=True)
        queue.close()
    assert not os.path.exists(f"{root}/m/metadata.json")
    return str(info.value)


@pytest.mark.contract
def test_a_writer_killed_under_megatrons_queue_fails_the_save_at_finalize_on_every_rank(tmp_path):
    path = os.path.join(tmp_path, "m", data_file_name(1))
    for message in run_ranks(2, _megatron_queue_writer_killed, str(tmp_path)):
        assert "rank 1: the writer process" in message and f"of {path} died before it finished" in message, message


def _parallel_work_then_async_save(rank: int, world: int, root: str) -> None:
    torch.set_num_threads(2)
    torch.ones(1 << 24).mul_(2).sum()  # the trainer's OpenMP pool is up when the writer forks
    big = global_tensor("big", (32 * world, 1 << 19))  # 64 MiB per rank: copied in parallel chunks
    sd = {"big": sharded("big", big, rank, world, 0)}
    before = snapshot(sd)
    queue = AsyncSaveQueue()
    queue.schedule(async_save(sd, f"{root}/c", native_strategy()))
    mutate(sd, 0)
    queue.close()
    load_and_compare(sd, before, f"{root}/c")


def test_forked_writer_does_not_deadlock_after_parallel_work(tmp_path):
    run_ranks(2, _parallel_work_then_async_save, str(tmp_path), deadline=240)


def _from_a_directory_with_another_checkout(rank: int, world: int, root: str) -> None:
    # A checkout of another version in the working directory (here one that cannot be imported): the writer
    # process, started from there, still runs this package.
    decoy = os.path.join(root, "cwd", "fastpersist_dist")
    os.makedirs(decoy, exist_ok=True)
    with open(os.path.join(decoy, "__init__.py"), "w") as f:
        f.write("raise ImportError('a checkout of another version')\n")
    os.chdir(os.path.dirname(decoy))
    sd, before, _, queue = start_first_save(rank, world, f"{root}/c")
    assert queue.maybe_finalize(blocking=True) == [1]
    load_and_compare(sd, before, f"{root}/c")


def test_the_writer_runs_the_trainer_s_package_whatever_the_working_directory_holds(tmp_path):
    run_ranks(2, _from_a_directory_with_another_checkout, str(tmp_path))


def _same_directory_twice(rank: int, world: int, root: str) -> str:
    sd, before, strategy, queue = start_first_save(rank, world, f"{root}/c")
    mutate(sd, 0)
    with pytest.raises(SaveFailedError) as info:
        async_save(sd, f"{root}/c", strategy)  # would interleave with the running writer
    queue.close()
    load_and_compare(sd, before, f"{root}/c")  # the first save is intact
    queue.schedule(async_save(sd, f"{root}/c", strategy))  # once finalized, the directory is free again
    queue.close()
    return str(info.value)


def test_second_save_into_a_directory_still_being_written_is_refused(tmp_path):
    for m in run_ranks(2, _same_directory_twice, str(tmp_path)):
        assert "still being written by an earlier async save" in m and "data files were not touched" in m, m


def _reserved_at_start_up(rank: int, world: int, root: str) -> tuple[bool, bool, int]:
    sd = async_state(rank, world)
    native_strategy().load_ops(sd)  # start-up, collective: plan, allocate and share the snapshot buffer
    reserved = set(writer_client()._buffers)
    before = snapshot(sd)
    strategy = native_strategy()  # a fresh strategy per save
    request = async_save(sd, f"{root}/c", strategy)
    leased = request.finalize_fns[0].args[0][1].id
    queue = AsyncSaveQueue()
    queue.schedule(request)
    mutate(sd, 0)
    queue.close()
    load_and_compare(sd, before, f"{root}/c")
    return leased in reserved, strategy.plan_reused, len(reserved)


def test_load_ops_with_the_state_reserves_the_first_save_s_buffer_and_plan(tmp_path):
    for leased_reserved, plan_reused, n in run_ranks(2, _reserved_at_start_up, str(tmp_path)):
        assert (leased_reserved, plan_reused, n) == (True, True, 1)


def _locked_in_writer_after_load_ops(rank: int, world: int, buffer_mb: int) -> int:
    native_strategy(io_buffer_mb=buffer_mb).load_ops()  # start-up, before any save
    return proc_status_kib("VmLck", writer_client().pid) * 1024


def test_load_ops_readies_the_writer_s_bounce_buffer_of_that_configuration(tmp_path):
    """The writer holds the configuration's locked bounce buffer before the first save: made in the first job
    instead, it would delay the first async save while the training loop keeps the cores busy."""
    assert run_ranks(1, _locked_in_writer_after_load_ops, 64) == [64 << 20]
