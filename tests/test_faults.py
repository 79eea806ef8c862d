"""Crashes and hangs: real processes, real files.

Ranks are forked by :func:`run_faulty`, which, unlike ``run_ranks``, expects some
ranks to die: a rank is killed with SIGKILL at a point it has reached (while
its data file is written: the kernel signals it at a fixed file size through
RLIMIT_FSIZE; or once a file or status it wrote is there), and the test checks
what the survivors raise, that they raise at all (the harness deadline bounds
every wait), and what the directory holds afterwards.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing

from fastpersist_dist import (
    AsyncSaveQueue,
    FastPersistError,
    TierConfig,
    checkpoint_state,
    wait_copies,
    wait_durable,
)
from fastpersist_dist.engine.writer_process import writer_client
from fastpersist_dist.format.records import INDEX_FILE, data_file_name, is_data_file, status_file_name
from fastpersist_dist.format.tiers import TIERS_FILE, local_copy_dir
from fastpersist_dist.storage.files import TMP_SUFFIX
from fastpersist_dist.storage.readback import confirm_on_disk
from fastpersist_dist.storage.writer import write_rank_file
from fastpersist_dist.tools.ranks import run_ranks
from fastpersist_dist.util.config import MiB, WriteConfig

from .faults import (
    BIG,
    DEAD_PEER,
    HUGE,
    KILLABLE,
    KILL_AT,
    SMALL,
    Raised,
    assert_incomplete_and_prev_intact,
    assert_survivors_raised,
    die_at_file_size,
    fault_state,
    files_named,
    load_and_verify,
    random_records,
    run_faulty,
    save_error,
)
from .helpers import (
    ASYNC_KW,
    flip_bit,
    logged,
    make_dir,
    native_strategy,
    save,
    sharded,
)

pytestmark = pytest.mark.engine

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------- 1. SIGKILL


def _die_while_writing(rank: int, world: int, root: str, victim: int) -> Raised:
    save(fault_state("s", SMALL, rank, world, 1), f"{root}/prev")
    if rank == victim:
        die_at_file_size(KILL_AT)
    return save_error(lambda: save(fault_state("w", BIG, rank, world, 2), f"{root}/new", **KILLABLE))


def _die_after_writing(rank: int, world: int, root: str, victim: int) -> Raised:
    save(fault_state("s", SMALL, rank, world, 1), f"{root}/prev")
    make_dir(f"{root}/new")
    request = dist_checkpointing.save(fault_state("w", BIG, rank, world, 2), f"{root}/new",
                                      sharded_strategy=native_strategy(), async_sharded_save=True, **ASYNC_KW)
    request.async_fn(*request.async_fn_args, **(request.async_fn_kwargs or {}))  # data file + status written
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)

    def finalize() -> None:
        for fn in request.finalize_fns:
            fn()

    return save_error(finalize)


@pytest.mark.parametrize("victim", [0, 1])
@pytest.mark.parametrize("die", [_die_while_writing, _die_after_writing], ids=["while_writing", "before_commit"])
def test_rank_killed_commits_nothing(tmp_path, victim, die):
    root = str(tmp_path)
    outcomes = run_faulty(2, die, root, victim)
    new = f"{root}/new"
    assert_survivors_raised(outcomes, victim, new)
    size, full = os.path.getsize(os.path.join(new, data_file_name(victim))), BIG[0] * BIG[1] * 4 // 2
    if die is _die_while_writing:
        assert 0 < size <= KILL_AT < full, size  # killed in the middle of its file
    else:
        with open(os.path.join(new, status_file_name(victim))) as f:  # reported, never committed
            records = json.load(f)["records"]
        assert size == sum(r["length"] for r in records), size  # fully written: its tensor half ...
        assert sum(r["length"] for r in records if r["kind"] == "tensor") == full  # ... (+ megatron's common_state)
    assert_incomplete_and_prev_intact(new, f"{root}/prev", "w", BIG, metadata=False)


def _overwrite_and_die(rank: int, world: int, root: str, victim: int) -> Raised:
    save(fault_state("s", SMALL, rank, world, 1), f"{root}/prev")
    save(fault_state("w", BIG, rank, world, 1), f"{root}/ckpt")
    if rank == victim:
        die_at_file_size(KILL_AT)
    return save_error(lambda: save(fault_state("w", BIG, rank, world, 2), f"{root}/ckpt", **KILLABLE))


def test_overwrite_killed_half_way_is_refused_not_mixed(tmp_path):
    root, victim = str(tmp_path), 1
    outcomes = run_faulty(2, _overwrite_and_die, root, victim)
    ckpt = f"{root}/ckpt"
    assert_survivors_raised(outcomes, victim, ckpt)
    # rank 0's file holds new bytes, rank 1's is cut short: with the old index this would load
    # half-new data. The index was removed before the first byte was written, so nothing loads.
    assert os.path.getsize(os.path.join(ckpt, data_file_name(victim))) <= KILL_AT
    assert_incomplete_and_prev_intact(ckpt, f"{root}/prev", "w", BIG, metadata=True)


def _async_writer_killed(rank: int, world: int, root: str) -> tuple[Raised, None]:
    strategy, queue = native_strategy(), AsyncSaveQueue()
    make_dir(f"{root}/new")
    big = {"w": sharded("w", torch.ones(HUGE), rank, world, 0)}  # long enough a write to stop it in the middle
    queue.schedule(dist_checkpointing.save(big, f"{root}/new", sharded_strategy=strategy, async_sharded_save=True,
                                           **ASYNC_KW))
    if rank == 1:  # SIGKILL the writer process mid-write (e.g. the OOM killer)
        writer, data = writer_client().pid, f"{root}/new/{data_file_name(rank)}"
        while not os.path.exists(data):
            time.sleep(0.001)
        os.kill(writer, signal.SIGSTOP)
        written = os.path.getsize(data)
        assert written < HUGE[0] * HUGE[1] * 4 // world and not os.path.exists(f"{root}/new/{status_file_name(1)}"), \
            f"the writer finished ({written} bytes) before it could be stopped mid-write"
        os.kill(writer, signal.SIGKILL)
    error = save_error(lambda: queue.maybe_finalize(blocking=True))
    make_dir(f"{root}/again")  # the trainers survived: the next save works (rank 1 with a new writer)
    queue.schedule(dist_checkpointing.save(fault_state("w", BIG, rank, world, 3), f"{root}/again",
                                           sharded_strategy=strategy, async_sharded_save=True, **ASYNC_KW))
    queue.close()
    return error, None


def test_async_writer_killed_fails_on_every_rank_and_the_next_save_works(tmp_path):
    root = str(tmp_path)
    outcomes = run_faulty(2, _async_writer_killed, root)
    new = f"{root}/new"
    for o in outcomes.values():
        assert o.kind == "ok", o.value
        e = o.value[0]
        assert e.kind == "SaveFailedError" and "was NOT saved" in e.message, e
        assert ("rank 1: the writer process" in e.message and
                f"of {os.path.join(new, data_file_name(1))} died before it finished" in e.message), e
    assert files_named(new) == [], "a failed save removes its data files"
    run_ranks(2, load_and_verify, f"{root}/again", "w", BIG, 3)


def _tiered_writer_killed(rank: int, world: int, root: str) -> tuple[Raised, list[str]]:
    strategy = native_strategy(tiers=TierConfig(f"{root}/local"))
    queue, ckpt = AsyncSaveQueue(), f"{root}/new"
    make_dir(ckpt)
    big = {"w": sharded("w", torch.ones(HUGE), rank, world, 0)}
    queue.schedule(dist_checkpointing.save(big, ckpt, sharded_strategy=strategy, async_sharded_save=True, **ASYNC_KW))
    if rank == 1:  # SIGKILL the writer process in the middle of its local write
        writer = writer_client().pid
        local = local_copy_dir(f"{root}/local", ckpt)
        data = f"{local}/{data_file_name(rank)}"
        while not os.path.exists(data) or not os.path.getsize(data):
            time.sleep(0.001)
        os.kill(writer, signal.SIGSTOP)
        assert not os.path.exists(f"{local}/{status_file_name(rank)}"), \
            "the writer finished the local file before it could be stopped mid-write"
        os.kill(writer, signal.SIGKILL)
    error = save_error(lambda: queue.maybe_finalize(blocking=True))
    wait_copies()
    dist.barrier()  # both ranks' drains done: each lists what either may have left
    queue.close()
    return error, sorted(os.listdir(ckpt))


def test_async_writer_killed_in_a_tiered_save_leaves_no_copy_in_the_persistent_directory(tmp_path):
    """A tiered save; rank 1's writer dies mid-write: the save fails on every rank, and neither rank's copy stays
    in the persistent directory (rank 0's drain removes the copy it made of its written file)."""
    outcomes = run_faulty(2, _tiered_writer_killed, str(tmp_path))
    for o in outcomes.values():
        assert o.kind == "ok", o.value
        error, left = o.value
        assert error.kind == "SaveFailedError" and "rank 1: the writer process" in error.message, error
        assert not [n for n in left if n.endswith(TMP_SUFFIX) or is_data_file(n)], left


def _killed_before_its_local_commit(rank: int, world: int, root: str, victim: int) -> Raised:
    """A durable tiered checkpoint, then an async tiered one whose writes are done on every rank when rank
    ``victim`` is SIGKILLed: the local commit, made beside training once every writer is done, finds it gone."""
    strategy = native_strategy(tiers=TierConfig(f"{root}/local"))
    save(fault_state("s", SMALL, rank, world, 1), f"{root}/prev", strategy)
    assert wait_durable(f"{root}/prev", timeout=120)
    make_dir(f"{root}/new")
    request = dist_checkpointing.save(fault_state("w", BIG, rank, world, 2), f"{root}/new", sharded_strategy=strategy,
                                      async_sharded_save=True, **ASYNC_KW)
    request.async_fn(*request.async_fn_args, **(request.async_fn_kwargs or {}))  # handed to the rank's writer
    status = os.path.join(local_copy_dir(f"{root}/local", f"{root}/new"), status_file_name(rank))
    while not os.path.exists(status):  # its write is done
        time.sleep(0.01)
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    return save_error(lambda: [fn() for fn in request.finalize_fns])


@pytest.mark.parametrize("victim", [0, 1])
def test_a_rank_killed_before_the_local_commit_of_a_tiered_save_loses_nothing_durable(tmp_path, victim):
    """The survivor's save fails naming the dead peer; nothing of the new checkpoint is committed in any tier,
    and the durable one before it loads."""
    root = str(tmp_path)
    outcomes = run_faulty(2, _killed_before_its_local_commit, root, victim)
    assert outcomes[victim].kind == "killed", outcomes[victim]
    survivor = outcomes[1 - victim]
    assert survivor.kind == "ok" and survivor.value.kind == "SaveFailedError", survivor.value
    assert DEAD_PEER in survivor.value.message and f"{root}/new" in survivor.value.message, survivor.value
    local = local_copy_dir(f"{root}/local", f"{root}/new")
    for where in (f"{root}/new", local):
        assert not {INDEX_FILE, TIERS_FILE} & set(os.listdir(where)), os.listdir(where)
    assert checkpoint_state(f"{root}/new") is None and checkpoint_state(f"{root}/prev") == "durable"
    run_ranks(1, load_and_verify, f"{root}/prev", "s", SMALL, 1)


def _trainer_killed(rank: int, world: int, root: str, pid_file: str) -> Raised:
    queue = AsyncSaveQueue()
    make_dir(f"{root}/new")
    queue.schedule(dist_checkpointing.save(fault_state("w", BIG, rank, world, 2), f"{root}/new",
                                           sharded_strategy=native_strategy(), async_sharded_save=True, **ASYNC_KW))
    if rank == 1:
        writer = writer_client().pid
        data = f"{root}/new/{data_file_name(rank)}"
        while not os.path.exists(data):  # the writer opens its file after arming its parent-death signal
            time.sleep(0.01)
        os.kill(writer, signal.SIGSTOP)  # certainly still in progress when its trainer dies
        with open(pid_file, "w") as f:
            f.write(str(writer))
        os.kill(os.getpid(), signal.SIGKILL)
    return save_error(lambda: queue.maybe_finalize(blocking=True))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_killed_trainer_takes_its_async_writer_along(tmp_path):
    root, pid_file = str(tmp_path), str(tmp_path / "writer.pid")
    outcomes = run_faulty(2, _trainer_killed, root, pid_file)
    assert outcomes[1].kind == "killed", outcomes[1]
    e = outcomes[0].value
    logger.info("rank 0 raised %s after %.2f s: %s", e.kind, e.seconds, e.message)
    assert e.kind == "SaveFailedError" and DEAD_PEER in e.message and "it was not committed" in e.message, e
    with open(pid_file) as f:
        writer = int(f.read())
    try:
        end = time.monotonic() + 30  # the kernel's parent-death signal, not a timing assertion
        while _alive(writer) and time.monotonic() < end:
            time.sleep(0.05)
        assert not _alive(writer), f"the writer {writer} of the killed trainer is still alive (orphaned)"
    finally:
        if _alive(writer):
            os.kill(writer, signal.SIGKILL)
    assert not os.path.exists(f"{root}/new/{INDEX_FILE}")


def _freeze_after_writing(rank: int, world: int, root: str) -> Raised:
    make_dir(f"{root}/new")
    request = dist_checkpointing.save(fault_state("w", SMALL, rank, world, 2), f"{root}/new",
                                      sharded_strategy=native_strategy(), async_sharded_save=True, **ASYNC_KW)
    request.async_fn(*request.async_fn_args, **(request.async_fn_kwargs or {}))
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # hung, not dead: its sockets stay open

    def finalize() -> None:
        for fn in request.finalize_fns:
            fn()

    return save_error(finalize)


def test_hung_rank_is_bounded_by_the_process_group_timeout(tmp_path):
    root = str(tmp_path)
    outcomes = run_faulty(2, _freeze_after_writing, root, pg_timeout=10, wait_for={0})
    assert outcomes[1].kind == "stopped"
    e = outcomes[0].value
    logger.info("rank 0 raised after %.2f s with a 10 s process-group timeout: %s", e.seconds, e.message)
    assert e.kind == "SaveFailedError" and DEAD_PEER in e.message and "nothing was committed" in e.message, e
    assert not os.path.exists(f"{root}/new/{INDEX_FILE}")


# --------------------------------------------------------------------------- 2. read-back


def _readback(rank: int, world: int, root: str) -> None:
    # In a forked process: the aio handle and torch's thread pool stay out of the pytest process.
    rank, block = 3, MiB
    path = os.path.join(root, data_file_name(rank))
    lengths = [5 * MiB // 2, 0, 3 * MiB + 5]  # blocks in file order: r0 0..2 (last short), r2 0..3 (last 5 bytes)
    result = write_rank_file(path, random_records(lengths, rank), WriteConfig(checksum_block_mb=1), rank)
    assert result.mode == "direct" and os.path.getsize(path) == sum(lengths)
    records = result.records
    assert confirm_on_disk(path, records, block, rank) == MiB + 5  # default: first and last block of the file
    assert confirm_on_disk(path, records, block, rank, stride=1) == sum(lengths)

    flip_bit(path, lengths[0] + MiB + 7)  # inside block 1 of r2: not sampled by default
    assert confirm_on_disk(path, records, block, rank) == MiB + 5
    with pytest.raises(FastPersistError) as info:
        confirm_on_disk(path, records, block, rank, stride=1)
    message = str(info.value)
    assert f"rank {rank}: read-back of {path} at byte offset {lengths[0] + MiB}" in message, message
    assert "(block 1 of 'r2'" in message and "does not match the bytes written" in message, message

    flip_bit(path, sum(lengths) - 1)  # the 5-byte tail, which DeepSpeed writes without O_DIRECT
    with pytest.raises(FastPersistError, match=f"at byte offset {sum(lengths) - 5} \\(block 3 of 'r2'"):
        confirm_on_disk(path, records, block, rank)


def test_readback_compares_sampled_blocks_with_what_was_streamed(tmp_path):
    run_ranks(1, _readback, str(tmp_path))



def _writer_killed_after_its_status(rank: int, world: int, local: str, root: str
                                    ) -> tuple[bool, list[str], list[int]]:
    strategy = native_strategy(tiers=TierConfig(local))
    queue, ckpt = AsyncSaveQueue(), f"{root}/new"
    said = logged("fastpersist_dist.engine.writer_process", logging.WARNING)
    make_dir(ckpt)
    queue.schedule(dist_checkpointing.save(fault_state("w", BIG, rank, world, 5), ckpt, sharded_strategy=strategy,
                                           async_sharded_save=True, **ASYNC_KW))
    if rank == 1:  # SIGKILL the writer once its status is left, whether or not its answer reached the trainer
        writer = writer_client().pid
        status = f"{local_copy_dir(local, ckpt)}/{status_file_name(rank)}"
        while not os.path.exists(status):
            time.sleep(0.001)
        os.kill(writer, signal.SIGKILL)
    queue.maybe_finalize(blocking=True)
    durable = wait_durable(ckpt, timeout=120)
    wait_copies()
    dist.barrier()
    load_and_verify(rank, world, ckpt, "w", BIG, 5)
    queue.close()
    return durable, sorted(os.listdir(ckpt)), [r.levelno for r in said]


def test_async_writer_killed_after_leaving_its_status_loses_nothing(shm_dir, tmp_path):
    """Rank 1's writer dies right after leaving its good status: its answer to the trainer may or may not have
    gone out. Either way the status stands (the trainer reads it where the answer is lost): the save commits on
    every rank, the drain copies both files, and the checkpoint becomes durable and loads; no rank reports a
    failed write (an ERROR); rank 1 at most warns that its writer died."""
    outcomes = run_faulty(2, _writer_killed_after_its_status, shm_dir, str(tmp_path))
    for rank, o in outcomes.items():
        assert o.kind == "ok", o.value
        durable, left, levels = o.value
        assert durable, rank
        assert not [n for n in left if n.endswith(TMP_SUFFIX)] and data_file_name(1) in left, left
        assert set(levels) <= ({logging.WARNING} if rank == 1 else set()), (rank, levels)


