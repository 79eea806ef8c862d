"""Crashes, hangs, a full disk, read-only and missing directories: real processes, real files.

Ranks are forked by :func:`run_faulty`, which, unlike ``run_ranks``, expects some
ranks to die: a rank is killed with SIGKILL at a deterministic point (while
its data file is written: the kernel signals it at a fixed file size through
RLIMIT_FSIZE; or after writing, by itself), and the test checks what the
survivors raise, that they raise at all (the harness deadline bounds every
wait), and what the directory holds afterwards. Small filesystems are tmpfs
mounts (we run as root); those tests skip, saying why, where mounting is refused.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import pickle
import resource
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Any, Iterable

import pytest
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.core import CheckpointingException

from fastpersist_dist import (
    AsyncSaveQueue,
    FastPersistError,
    FastPersistLoadStrategy,
    IncompleteCheckpointError,
    SaveFailedError,
    TierConfig,
    checkpoint_state,
    wait_copies,
    wait_durable,
)
from fastpersist_dist.engine.directory import prepare_checkpoint_dir
from fastpersist_dist.engine.writer_process import writer_client
from fastpersist_dist.format.index_pages import part_file_name
from fastpersist_dist.format.records import INDEX_FILE, data_file_name, is_data_file, status_file_name
from fastpersist_dist.format.tiers import local_copy_dir
from fastpersist_dist.storage.deepspeed_ops import aio_module, ensure_fast_file_writer_usable
from fastpersist_dist.storage.files import TMP_SUFFIX, reserve_room, written_through_name
from fastpersist_dist.storage.writer import confirm_on_disk, prepare_direct_writes, write_rank_file
from fastpersist_dist.tools.inspect import format_report, inspect_checkpoint
from fastpersist_dist.tools.ranks import Outcome, run_ranks
from fastpersist_dist.tools.verify import verify_checkpoint
from fastpersist_dist.util.config import MiB, WriteConfig

from .faults import KILL_AT, KILLABLE, Raised, die_at_file_size, random_records, run_faulty, save_error
from .helpers import (
    ASYNC_KW,
    COMMON_STATE_OBJECT,
    assert_same,
    flip_bit,
    global_tensor,
    load,
    logged,
    make_dir,
    native_strategy,
    save,
    sharded,
)

pytestmark = pytest.mark.engine

logger = logging.getLogger(__name__)

BIG = (2048, 4096)  # float32: 16 MiB per rank of 2
HUGE = (16384, 8192)  # float32: 256 MiB per rank of 2
SMALL = (64, 256)
DEAD_PEER = "a rank died or timed out"


def _sd(key: str, shape: tuple[int, int], rank: int, world: int, salt: int, split: Any = 0) -> dict:
    return {key: sharded(key, global_tensor(key, shape, salt=salt), rank, world, split)}


def _files(path: str, pattern: str = "fastpersist") -> list[str]:
    return sorted(n for n in os.listdir(path) if pattern in n)


# --------------------------------------------------------------------------- checks after a crash


def _load_and_verify(rank: int, world: int, path: str, key: str, shape: tuple[int, int], salt: int) -> None:
    want = global_tensor(key, shape, salt=salt)
    req = {key: ShardedTensor.from_rank_offsets(key, torch.zeros_like(want), replica_id=rank)}
    assert_same(load(req, path)[key], want, f"{path}:{key}")
    report = verify_checkpoint(path)
    assert report.ok, report.problems


def _refused(rank: int, world: int, path: str, key: str, shape: tuple[int, int], metadata: bool) -> list[str]:
    """Every way to open ``path`` refuses it; returns the messages."""
    req = {key: ShardedTensor.from_rank_offsets(key, torch.zeros(shape), replica_id=rank)}
    messages = []
    with pytest.raises(IncompleteCheckpointError) as ours:
        FastPersistLoadStrategy().load(req, path)
    messages.append(str(ours.value))
    # megatron refuses a directory without metadata.json before asking any strategy;
    # after a failed overwrite the old metadata.json is there and our loader refuses.
    expected = IncompleteCheckpointError if metadata else CheckpointingException
    with pytest.raises(expected) as theirs:
        load(req, path)
    messages.append(str(theirs.value))
    return messages


def _assert_incomplete_and_prev_intact(new: str, prev: str, key: str, shape: tuple[int, int], metadata: bool) -> None:
    assert not os.path.exists(os.path.join(new, INDEX_FILE))
    assert os.path.exists(os.path.join(new, "metadata.json")) == metadata
    ours, theirs = run_ranks(1, _refused, new, key, shape, metadata)[0]
    assert "this checkpoint is incomplete" in ours and new in ours, ours
    assert ("this checkpoint is incomplete" if metadata else "is not a distributed checkpoint") in theirs, theirs
    problems = verify_checkpoint(new).problems
    assert any("this checkpoint is incomplete" in p for p in problems), problems
    run_ranks(1, _load_and_verify, prev, "s", SMALL, 1)


def _assert_survivors_raised(outcomes: dict[int, Outcome], victim: int, new: str) -> None:
    """The victim died of SIGKILL; every other rank raised SaveFailedError (the harness deadline bounds the wait)."""
    assert outcomes[victim].kind == "killed" and outcomes[victim].value == signal.SIGKILL, outcomes[victim]
    for r, o in outcomes.items():
        if r == victim:
            continue
        assert o.kind == "ok", o.value
        e = o.value
        logger.info("rank %d raised %s after %.2f s: %s", r, e.kind, e.seconds, e.message)
        assert e.kind == "SaveFailedError" and DEAD_PEER in e.message, e
        assert new in e.message and f"rank {r}:" in e.message, e
        if r == 0:
            assert "nothing was committed" in e.message, e


# --------------------------------------------------------------------------- 1. SIGKILL


def _die_while_writing(rank: int, world: int, root: str, victim: int) -> Raised:
    save(_sd("s", SMALL, rank, world, 1), f"{root}/prev")
    if rank == victim:
        die_at_file_size(KILL_AT)
    return save_error(lambda: save(_sd("w", BIG, rank, world, 2), f"{root}/new", **KILLABLE))


def _die_after_writing(rank: int, world: int, root: str, victim: int) -> Raised:
    save(_sd("s", SMALL, rank, world, 1), f"{root}/prev")
    make_dir(f"{root}/new")
    request = dist_checkpointing.save(_sd("w", BIG, rank, world, 2), f"{root}/new",
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
    _assert_survivors_raised(outcomes, victim, new)
    size, full = os.path.getsize(os.path.join(new, data_file_name(victim))), BIG[0] * BIG[1] * 4 // 2
    if die is _die_while_writing:
        assert 0 < size <= KILL_AT < full, size  # killed in the middle of its file
    else:
        with open(os.path.join(new, status_file_name(victim))) as f:  # reported, never committed
            records = json.load(f)["records"]
        assert size == sum(r["length"] for r in records), size  # fully written: its tensor half ...
        assert sum(r["length"] for r in records if r["kind"] == "tensor") == full  # ... (+ megatron's common_state)
    _assert_incomplete_and_prev_intact(new, f"{root}/prev", "w", BIG, metadata=False)


def _overwrite_and_die(rank: int, world: int, root: str, victim: int) -> Raised:
    save(_sd("s", SMALL, rank, world, 1), f"{root}/prev")
    save(_sd("w", BIG, rank, world, 1), f"{root}/ckpt")
    if rank == victim:
        die_at_file_size(KILL_AT)
    return save_error(lambda: save(_sd("w", BIG, rank, world, 2), f"{root}/ckpt", **KILLABLE))


def test_overwrite_killed_half_way_is_refused_not_mixed(tmp_path):
    root, victim = str(tmp_path), 1
    outcomes = run_faulty(2, _overwrite_and_die, root, victim)
    ckpt = f"{root}/ckpt"
    _assert_survivors_raised(outcomes, victim, ckpt)
    # rank 0's file holds new bytes, rank 1's is cut short: with the old index this would load
    # half-new data. The index was removed before the first byte was written, so nothing loads.
    assert os.path.getsize(os.path.join(ckpt, data_file_name(victim))) <= KILL_AT
    _assert_incomplete_and_prev_intact(ckpt, f"{root}/prev", "w", BIG, metadata=True)


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
    queue.schedule(dist_checkpointing.save(_sd("w", BIG, rank, world, 3), f"{root}/again",
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
    assert _files(new) == [], "a failed save removes its data files"
    run_ranks(2, _load_and_verify, f"{root}/again", "w", BIG, 3)


def _writer_killed_writing_through(rank: int, world: int, root: str) -> tuple[Raised, list[str]]:
    strategy = native_strategy(tiers=TierConfig(f"{root}/local", write_through=True))
    queue, ckpt = AsyncSaveQueue(), f"{root}/new"
    make_dir(ckpt)
    big = {"w": sharded("w", torch.ones(HUGE), rank, world, 0)}
    queue.schedule(dist_checkpointing.save(big, ckpt, sharded_strategy=strategy, async_sharded_save=True, **ASYNC_KW))
    if rank == 1:  # SIGKILL the writer process in the middle of both writes
        writer = writer_client().pid
        copy = f"{ckpt}/{data_file_name(rank)}.{writer}{TMP_SUFFIX}"
        while not os.path.exists(copy) or not os.path.getsize(copy):
            time.sleep(0.001)
        os.kill(writer, signal.SIGSTOP)
        assert not os.path.exists(f"{local_copy_dir(f'{root}/local', ckpt)}/{status_file_name(rank)}"), \
            "the writer finished the local file before it could be stopped mid-write"
        os.kill(writer, signal.SIGKILL)
    error = save_error(lambda: queue.maybe_finalize(blocking=True))
    wait_copies()
    dist.barrier()  # both ranks' drains done: each lists what either may have left
    queue.close()
    return error, sorted(os.listdir(ckpt))


def test_async_writer_killed_writing_through_leaves_no_copy_in_the_persistent_directory(tmp_path):
    """A tiered save writing through to the persistent directory; rank 1's writer dies mid-write: the save
    fails on every rank, and neither rank's copy stays there (rank 1's drain waits for the dead writer's
    lock and removes its copy under way; rank 0's removes the copy its writer finished)."""
    outcomes = run_faulty(2, _writer_killed_writing_through, str(tmp_path))
    for o in outcomes.values():
        assert o.kind == "ok", o.value
        error, left = o.value
        assert error.kind == "SaveFailedError" and "rank 1: the writer process" in error.message, error
        assert not [n for n in left if n.endswith(TMP_SUFFIX) or is_data_file(n)], left


def _trainer_killed(rank: int, world: int, root: str, pid_file: str) -> Raised:
    queue = AsyncSaveQueue()
    make_dir(f"{root}/new")
    queue.schedule(dist_checkpointing.save(_sd("w", BIG, rank, world, 2), f"{root}/new",
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
    request = dist_checkpointing.save(_sd("w", SMALL, rank, world, 2), f"{root}/new",
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


# --------------------------------------------------------------------------- 3. full disk, 4. read-only


def _remount(mnt: str, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", mnt], check=True)


# rank 0 holds one 64 KiB row, rank 1 the other 12 MiB: rank 1 cannot fit in 8 MiB.
UNEVEN = (193, 16384)
UNEVEN_SPLIT = (1, 192)


def _fill_the_disk(rank: int, world: int, fs: str) -> tuple[Raised, list[str]]:
    save(_sd("s", SMALL, rank, world, 1), f"{fs}/prev")
    save(_sd("s", SMALL, rank, world, 1), f"{fs}/over")
    error = save_error(lambda: save(_sd("u", UNEVEN, rank, world, 2, UNEVEN_SPLIT), f"{fs}/over"))
    refused = _refused(rank, world, f"{fs}/over", "u", UNEVEN, metadata=True)
    leftovers = _files(f"{fs}/over", "fastpersist_r")
    dist.barrier()
    save(_sd("s", SMALL, rank, world, 3), f"{fs}/over")  # the space of the failed save was given back
    return error, [*refused, *leftovers]


def test_disk_full_fails_on_every_rank_and_keeps_the_earlier_checkpoint(small_fs):
    outcomes = run_faulty(2, _fill_the_disk, small_fs)
    for o in outcomes.values():
        assert o.kind == "ok", o.value
        e, (ours, theirs, *leftovers) = o.value
        logger.info("disk full: %s", e.message)
        assert e.kind == "SaveFailedError" and "was NOT saved" in e.message, e
        assert "rank 1:" in e.message and os.path.join(small_fs, "over", data_file_name(1)) in e.message, e
        assert "this checkpoint is incomplete" in ours and "this checkpoint is incomplete" in theirs
        assert leftovers == [], "a failed save removes its data files"
    run_ranks(1, _load_and_verify, f"{small_fs}/prev", "s", SMALL, 1)
    run_ranks(1, _load_and_verify, f"{small_fs}/over", "s", SMALL, 3)


def _full_at_commit(rank: int, world: int, fs: str) -> Raised:
    save(_sd("s", SMALL, rank, world, 1), f"{fs}/prev")
    make_dir(f"{fs}/new")
    request = dist_checkpointing.save(_sd("w", (256, 4096), rank, world, 2), f"{fs}/new",
                                      sharded_strategy=native_strategy(), async_sharded_save=True, **ASYNC_KW)
    request.async_fn(*request.async_fn_args, **(request.async_fn_kwargs or {}))
    dist.barrier()
    filler = f"{fs}/filler"
    if rank == 0:  # the data fit; now nothing else does, not even the index
        fd = os.open(filler, os.O_CREAT | os.O_WRONLY)
        with pytest.raises(OSError, match="No space left"):
            while True:
                os.write(fd, b"\0" * MiB)
        os.close(fd)
    dist.barrier()

    def finalize() -> None:
        for fn in request.finalize_fns:
            fn()

    error = save_error(finalize)
    dist.barrier()
    if rank == 0:
        os.unlink(filler)
    return error


def test_disk_full_at_commit_commits_nothing(small_fs):
    outcomes = run_faulty(2, _full_at_commit, small_fs)
    for o in outcomes.values():
        assert o.kind == "ok", o.value
        e = o.value
        first = part_file_name(0)  # the planning group's index part comes first (then common.pt on 0.19, the index)
        assert e.kind == "SaveFailedError" and f"rank 0: committing {first} failed" in e.message, e
        assert "No space left on device" in e.message, e
    assert _files(f"{small_fs}/new") == [], "no index, no temp file, no data files"
    run_ranks(1, _load_and_verify, f"{small_fs}/prev", "s", SMALL, 1)


def _writer_killed_after_the_local_file(rank: int, world: int, local: str, root: str
                                        ) -> tuple[bool, list[str], list[int]]:
    # The copy's bounce buffer of 1 MiB, single: each of its O_DIRECT writes waits for the disk, so the copy to
    # the disk runs well behind the buffered write into memory.
    strategy = native_strategy(tiers=TierConfig(local, write_through=True), io_buffer_mb=1, double_buffer=False)
    queue, ckpt = AsyncSaveQueue(), f"{root}/new"
    said = logged("fastpersist_dist.engine.writer_process", logging.WARNING)
    make_dir(ckpt)
    state = _sd("w", HUGE, rank, world, 5)
    queue.schedule(dist_checkpointing.save(state, ckpt, sharded_strategy=strategy, async_sharded_save=True,
                                           **ASYNC_KW))
    if rank == 1:  # SIGKILL the writer once its local file is written, while it writes its copy
        writer = writer_client().pid
        status = f"{local_copy_dir(local, ckpt)}/{status_file_name(rank)}"
        while not os.path.exists(status):
            time.sleep(0.001)
        os.kill(writer, signal.SIGSTOP)
        assert not os.path.exists(written_through_name(f"{ckpt}/{data_file_name(rank)}")), \
            "the writer finished its copy before it could be stopped"
        os.kill(writer, signal.SIGKILL)
    queue.maybe_finalize(blocking=True)
    durable = wait_durable(ckpt, timeout=120)
    wait_copies()
    dist.barrier()
    _load_and_verify(rank, world, ckpt, "w", HUGE, 5)
    queue.close()
    return durable, sorted(os.listdir(ckpt)), [r.levelno for r in said]


def test_async_writer_killed_after_its_local_file_loses_only_its_write_through_copy(shm_dir, tmp_path):
    """Written through, the local file's status is left before the copy to the persistent directory is done; rank
    1's writer dies between the two (whether or not its answer that the file is written reached the trainer):
    the save commits on every rank all the same, rank 1's drain copies its file from the local tier instead
    (removing what the dead writer left), and the checkpoint becomes durable and loads. Rank 1 warns of the
    lost copy; no rank reports a failed write (an ERROR)."""
    outcomes = run_faulty(2, _writer_killed_after_the_local_file, shm_dir, str(tmp_path))
    for rank, o in outcomes.items():
        assert o.kind == "ok", o.value
        durable, left, levels = o.value
        assert durable, rank
        assert not [n for n in left if n.endswith(TMP_SUFFIX)] and data_file_name(1) in left, left
        assert logging.ERROR not in levels, (rank, levels)
    assert outcomes[1].value[2] == [logging.WARNING], outcomes[1].value[2]


def _persistent_tier_full(rank: int, world: int, fs: str, local: str, write_through: bool, shape: tuple) -> dict:
    """A tiered async save of the tensor ``shape`` into a persistent directory on the tmpfs ``fs`` too small for
    it: the save commits locally, what does not fit is refused until ``retry_s`` ends, and it loads from the
    local tiers."""
    records = logged("fastpersist_dist", logging.INFO)
    tiers = TierConfig(local, write_through=write_through, retry_s=1.0)
    queue, ckpt = AsyncSaveQueue(), f"{fs}/ckpt"
    make_dir(ckpt)
    queue.schedule(dist_checkpointing.save(_sd("w", shape, rank, world, 4), ckpt,
                                           sharded_strategy=native_strategy(tiers=tiers), async_sharded_save=True,
                                           **ASYNC_KW))
    queue.maybe_finalize(blocking=True)  # raises if the save failed
    assert wait_copies(timeout=120)
    dist.barrier()
    want = global_tensor("w", shape, salt=4)
    req = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros_like(want), replica_id=rank)}
    loaded = dist_checkpointing.load(req, ckpt, sharded_strategy=FastPersistLoadStrategy())["w"]
    queue.close()
    return {"state": checkpoint_state(ckpt), "equal": torch.equal(loaded, want), "left": sorted(os.listdir(ckpt)),
            "said": [(r.levelname, r.getMessage()) for r in records if r.levelno >= logging.WARNING]}


def _found_no_room(said: list[tuple[str, str]], rank: int, copy: str, fs: str, why: str) -> bool:
    """Whether rank ``rank`` said its copy to ``copy`` found no room (``why``: part of the reason), was tried
    again, and that the checkpoint in ``fs`` stays in the local tiers, naming itself, its node and the file."""
    return (any(level == "WARNING" and f"rank {rank} (" in m and f"no room for {copy}: " in m and why in m
                and "trying again" in m for level, m in said)
            and any(level == "ERROR" and f"rank {rank} (" in m and f"{fs}/ckpt stays in the local tiers" in m
                    and "kept failing for 1 s" in m for level, m in said))


@pytest.mark.parametrize("write_through", [False, True], ids=["drained", "written through"])
def test_a_persistent_directory_without_room_leaves_the_checkpoint_local(small_fs, tmp_path, write_through):
    """The persistent directory has no room for a tiered save's files (each rank's file, to be copied by the
    drain or written through by its writer, is twice the filesystem): the save still commits on the local
    tiers and loads from there (no copy starts where it would leave under ``COPY_HEADROOM_BYTES`` free, so the
    commit's files find room); each rank's copy is refused, tried again until ``retry_s`` has passed, and each
    rank says the checkpoint stays in the local tiers, naming itself, its node and the file; no data file or
    partial copy stays in the persistent directory."""
    outcomes = run_faulty(2, _persistent_tier_full, small_fs, str(tmp_path / "local"), write_through, BIG)
    for rank, o in outcomes.items():
        assert o.kind == "ok", o.value
        got = o.value
        assert got["state"] == "local" and got["equal"], got
        assert not [n for n in got["left"] if is_data_file(n) or n.endswith(TMP_SUFFIX)], got["left"]
        said = "\n".join(f"{level} {m}" for level, m in got["said"])
        copy = os.path.join(small_fs, "ckpt", data_file_name(rank))
        assert _found_no_room(got["said"], rank, copy, small_fs, "bytes to write"), said
    shown = format_report(inspect_checkpoint(f"{small_fs}/ckpt"))  # why it is not durable, file by file
    for rank in range(2):
        assert [line for line in shown.splitlines() if f"copy of {data_file_name(rank)} to the persistent tier FAILED"
                in line and f"rank {rank} (" in line and "no room for" in line], shown


def _filled(lines: Iterable[str]) -> list[str]:
    """The messages of ``lines`` where a write found the filesystem full (not a copy refused before it began, when
    allocating its room)."""
    return [line for line in lines if "No space left on device" in line and "allocating its" not in line]


# float32, 200 MiB per rank of 2: the 390 MiB filesystem below holds one rank's file and the headroom, not both,
# and a copy checking the room before the other has written 126 MiB finds room for itself.
ROOM_FOR_ONE = (25600, 4096)


@pytest.mark.parametrize("write_through", [False, True], ids=["drained", "written through"])
def test_copies_that_fit_only_one_at_a_time_never_fill_the_persistent_directory(small_fs, tmp_path, capfd,
                                                                                 write_through):
    """Each rank's copy alone fits in the persistent directory with ``COPY_HEADROOM_BYTES`` to spare, both do
    not, and both start at once: each copy allocates its bytes before it writes, so the second finds the first's
    taken, or cannot allocate its own, and is refused before it writes (never a copy failing midway with a full
    filesystem, which would also fail whatever else is written there, the checkpoint's commit among it); the
    save commits locally and loads, one rank's copy is refused and reported, and no partial copy stays."""
    _remount(small_fs, "size=390m")
    outcomes = run_faulty(2, _persistent_tier_full, small_fs, str(tmp_path / "local"), write_through, ROOM_FOR_ONE)
    refused = []
    for rank, o in outcomes.items():
        assert o.kind == "ok", o.value
        got = o.value
        assert got["state"] == "local" and got["equal"], got
        assert not _filled(m for _, m in got["said"]), got["said"]
        assert not [n for n in got["left"] if n.endswith(TMP_SUFFIX)], got["left"]
        if _found_no_room(got["said"], rank, os.path.join(small_fs, "ckpt", data_file_name(rank)), small_fs, " bytes "):
            refused.append(rank)
    assert len(refused) == 1, outcomes
    written = capfd.readouterr().err  # the ranks' and their writers' own logs
    assert not _filled(written.splitlines()), written


def _reserve_at_once(path: str, nbytes: int, start: Any, decided: Any, results: Any) -> None:
    """Reserve ``nbytes`` for ``path`` the moment ``start`` lets every process go; a process that got its room
    holds it (as a copy being written would) until ``decided`` says every other process has its answer."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    start.wait()
    try:
        reserve_room(fd, path, nbytes, f"pid {os.getpid()}")
        results.put(("allocated", os.fstat(fd).st_blocks * 512))
        decided.wait(60)
    except FastPersistError as e:
        results.put(("refused", str(e), os.fstat(fd).st_blocks * 512))
    finally:
        os.close(fd)
        os.unlink(path)


def test_room_reserved_at_the_same_moment_goes_to_exactly_one_copy(small_fs):
    """Three processes reserve room for copies at the same instant on a filesystem that holds one (with
    ``COPY_HEADROOM_BYTES`` to spare): an allocation takes its blocks a few at a time, so each can find the
    others' blocks taken; round after round exactly one gets its room whole and the others are refused, naming
    their file, with nothing allocated."""
    _remount(small_fs, "size=200m")
    nbytes = 100 << 20
    ctx = multiprocessing.get_context("fork")  # the children run only files.reserve_room: no threads, no aio
    for round_ in range(4):
        start, decided, results = ctx.Barrier(3), ctx.Event(), ctx.Queue()
        paths = [os.path.join(small_fs, f"copy{i}.r{round_}") for i in range(3)]
        procs = [ctx.Process(target=_reserve_at_once, args=(p, nbytes, start, decided, results)) for p in paths]
        for p in procs:
            p.start()
        got = [results.get(timeout=60) for _ in procs]
        decided.set()
        for p in procs:
            p.join(60)
            assert p.exitcode == 0, (round_, got)
        assert sorted(g[0] for g in got) == ["allocated", "refused", "refused"], (round_, got)
        assert [g[1] for g in got if g[0] == "allocated"] == [nbytes], (round_, got)
        for g in got:
            if g[0] == "refused":
                assert "no room for " + small_fs in g[1] and g[2] == 0, (round_, got)
        assert os.listdir(small_fs) == [], (round_, os.listdir(small_fs))


def _read_only(rank: int, world: int, fs: str) -> list[str]:
    sd = _sd("s", SMALL, rank, world, 2)
    with pytest.raises(SaveFailedError) as prepared:
        prepare_checkpoint_dir(f"{fs}/ckpt")
    with pytest.raises(SaveFailedError) as created:
        prepare_checkpoint_dir(f"{fs}/missing")
    with pytest.raises(SaveFailedError) as strategy:
        native_strategy().save(sd, f"{fs}/ckpt")
    return [str(prepared.value), str(created.value), str(strategy.value)]


def _save_prev_and_ckpt(rank: int, world: int, fs: str) -> None:
    save(_sd("s", SMALL, rank, world, 1), f"{fs}/prev")
    make_dir(f"{fs}/ckpt")


def test_read_only_directory_fails_on_every_rank_before_writing(small_fs):
    run_ranks(2, _save_prev_and_ckpt, small_fs)
    _remount(small_fs, "ro")
    ckpt = f"{small_fs}/ckpt"
    for prepared, created, strategy in run_ranks(2, _read_only, small_fs):
        for r in range(2):
            assert f"rank {r}: checkpoint directory {ckpt} is not writable: Read-only file system" in prepared, prepared
        assert f"rank 0: cannot create {small_fs}/missing: Read-only file system" in created, created
        assert f"cannot save checkpoint {ckpt}; nothing was written" in strategy, strategy
        assert "Read-only file system" in strategy, strategy
    assert os.listdir(f"{small_fs}/ckpt") == []
    run_ranks(1, _load_and_verify, f"{small_fs}/prev", "s", SMALL, 1)


def _missing(rank: int, world: int, root: str) -> list[str]:
    path = f"{root}/missing"
    with pytest.raises(SaveFailedError) as prepared:
        prepare_checkpoint_dir(path, create=False)
    with pytest.raises(SaveFailedError) as strategy:
        native_strategy().save(_sd("s", SMALL, rank, world, 2), path)
    prepare_checkpoint_dir(path)  # creates it: then the save works
    dist_checkpointing.save(_sd("s", SMALL, rank, world, 2), path, sharded_strategy=native_strategy())
    return [str(prepared.value), str(strategy.value)]


def test_missing_directory_fails_on_every_rank_before_writing(tmp_path):
    root = str(tmp_path)
    for prepared, strategy in run_ranks(2, _missing, root):
        for text in (prepared, strategy):
            assert f"checkpoint directory {root}/missing does not exist" in text, text
        assert "rank 0:" in prepared and "rank 1:" in prepared, prepared
    run_ranks(1, _load_and_verify, f"{root}/missing", "s", SMALL, 2)


def _megatron_save_into(rank: int, world: int, path: str) -> Raised:
    return save_error(lambda: dist_checkpointing.save(_sd("s", SMALL, rank, world, 2), path,
                                                       sharded_strategy=native_strategy()))


@pytest.mark.contract
@pytest.mark.parametrize("case", ["missing", "read_only"])
def test_megatron_save_into_unusable_directory_fails_on_rank_0_and_unblocks_the_rest(request, tmp_path, case):
    if case == "read_only":
        fs = request.getfixturevalue("small_fs")
        path = f"{fs}/ckpt"
        os.makedirs(path)
        _remount(fs, "ro")
    else:
        path = str(tmp_path / "ckpt")
    outcomes = run_faulty(2, _megatron_save_into, path)
    e = outcomes[0].value
    # megatron lists the directory (missing: FileNotFoundError naming it) on rank 0 before any
    # strategy runs; up to 0.18 it also writes common.pt there (read-only: torch.save's RuntimeError,
    # which names no file), 0.19 leaves it to us: our directory check fails on every rank, naming it.
    if case == "missing":
        assert e.kind == "FileNotFoundError" and path in e.message, e
    elif not COMMON_STATE_OBJECT:
        assert "Read-only file system" in e.message and "save_common" in e.trace, e
    else:
        assert e.kind == "SaveFailedError" and "is not writable: Read-only file system" in e.message, e
    other = outcomes[1]
    assert other.kind == "ok", other.value  # rank 1 raised too (it waited in a collective for rank 0)
    logger.info("rank 1 raised %s after %.2f s: %s", other.value.kind, other.value.seconds, other.value.message)
    assert not os.path.exists(path) or os.listdir(path) == []


# --------------------------------------------------------------------------- 5. untrusted common.pt


def _load_hostile_common(rank: int, world: int, path: str) -> None:
    req = {"s": ShardedTensor.from_rank_offsets("s", torch.zeros(SMALL), replica_id=rank)}
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        load(req, path)


@pytest.mark.contract
def test_hostile_common_pt_is_refused_by_torch_weights_only(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(1, lambda rank, world: save(_sd("s", SMALL, rank, world, 1), path))
    torch.save({"hook": os.getcwd}, os.path.join(path, "common.pt"))  # any global outside the allow-list
    run_ranks(1, _load_hostile_common, path)


def _memlock_limited(rank: int, world: int, root: str) -> list[str]:
    ensure_fast_file_writer_usable()  # as root: loading the ops takes a lock file in their build directory
    aio_module()
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (8 * MiB, 8 * MiB))  # a desktop's default
    os.setuid(65534)  # nobody: root's CAP_IPC_LOCK would ignore the limit
    prepare_direct_writes(WriteConfig(direct_io="on"))  # a writer process at load_ops: the write says why
    path = os.path.join(root, data_file_name(rank))
    lengths = [3 * MiB, 7]
    result = write_rank_file(path, random_records(lengths, rank), WriteConfig(), rank)
    assert result.mode == "buffered" and os.path.getsize(path) == sum(lengths)
    with pytest.raises(FastPersistError) as info:
        write_rank_file(path, random_records(lengths, rank), WriteConfig(direct_io="on"), rank)
    return [str(info.value)]


def test_bounce_buffer_over_memlock_limit_falls_back_or_says_why():
    root = tempfile.mkdtemp(prefix="fastpersist-memlock-")
    os.chmod(root, 0o777)
    try:
        message = run_ranks(1, _memlock_limited, root)[0][0]
    finally:
        shutil.rmtree(root)
    assert "direct_io='on' but the 256 MiB bounce buffer exceeds RLIMIT_MEMLOCK (8 MiB)" in message, message
