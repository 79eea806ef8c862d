"""A full disk, read-only and missing directories, untrusted files, locked-memory limits: real processes, real
files. Small filesystems are tmpfs mounts (we run as root); those tests skip, saying why, where mounting is
refused.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import resource
import shutil
import subprocess
import tempfile
from typing import Any, Iterable

import pytest
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor

from fastpersist_dist import (
    AsyncSaveQueue,
    FastPersistError,
    FastPersistLoadStrategy,
    SaveFailedError,
    TierConfig,
    checkpoint_state,
    wait_copies,
    )
from fastpersist_dist.engine.directory import prepare_checkpoint_dir
from fastpersist_dist.format.index_pages import part_file_name
from fastpersist_dist.format.records import data_file_name, is_data_file
from fastpersist_dist.storage.deepspeed_ops import aio_module, ensure_fast_file_writer_usable
from fastpersist_dist.storage.files import TMP_SUFFIX, reserve_room
from fastpersist_dist.storage.sinks import prepare_direct_writes
from fastpersist_dist.storage.writer import write_rank_file
from fastpersist_dist.tools.inspect import format_report, inspect_checkpoint
from fastpersist_dist.tools.ranks import run_ranks
from fastpersist_dist.util.config import MiB, WriteConfig
from fastpersist_dist.util.events import RETRYING, event_of

from .faults import (
    BIG,
    SMALL,
    Raised,
    fault_state,
    files_named,
    load_and_verify,
    random_records,
    refusal_messages,
    run_faulty,
    save_error,
)
from .helpers import (
    ASYNC_KW,
    COMMON_STATE_OBJECT,
    global_tensor,
    load,
    logged,
    make_dir,
    native_strategy,
    save,
    )

pytestmark = pytest.mark.engine

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------- 3. full disk, 4. read-only


def _remount(mnt: str, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", mnt], check=True)


# rank 0 holds one 64 KiB row, rank 1 the other 12 MiB: rank 1 cannot fit in 8 MiB.
UNEVEN = (193, 16384)
UNEVEN_SPLIT = (1, 192)


def _fill_the_disk(rank: int, world: int, fs: str) -> tuple[Raised, list[str]]:
    save(fault_state("s", SMALL, rank, world, 1), f"{fs}/prev")
    save(fault_state("s", SMALL, rank, world, 1), f"{fs}/over")
    error = save_error(lambda: save(fault_state("u", UNEVEN, rank, world, 2, UNEVEN_SPLIT), f"{fs}/over"))
    messages = refusal_messages(rank, world, f"{fs}/over", "u", UNEVEN, metadata=True)
    leftovers = files_named(f"{fs}/over", "fastpersist_r")
    dist.barrier()
    save(fault_state("s", SMALL, rank, world, 3), f"{fs}/over")  # the space of the failed save was given back
    return error, [*messages, *leftovers]


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
    run_ranks(1, load_and_verify, f"{small_fs}/prev", "s", SMALL, 1)
    run_ranks(1, load_and_verify, f"{small_fs}/over", "s", SMALL, 3)


def _full_at_commit(rank: int, world: int, fs: str) -> Raised:
    save(fault_state("s", SMALL, rank, world, 1), f"{fs}/prev")
    make_dir(f"{fs}/new")
    request = dist_checkpointing.save(fault_state("w", (256, 4096), rank, world, 2), f"{fs}/new",
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
    assert files_named(f"{small_fs}/new") == [], "no index, no temp file, no data files"
    run_ranks(1, load_and_verify, f"{small_fs}/prev", "s", SMALL, 1)


RETRY_S = 5.0  # a refused copy's try can take a second on a loaded machine; it is tried again within retry_s only


def _persistent_tier_full(rank: int, world: int, fs: str, local: str, shape: tuple) -> dict:
    """A tiered async save of the tensor ``shape`` into a persistent directory on the tmpfs ``fs`` too small for
    it: the save commits locally, what does not fit is refused until ``retry_s`` ends, and it loads from the
    local tiers."""
    records = logged("fastpersist_dist", logging.INFO)
    tiers = TierConfig(local, retry_s=RETRY_S)
    queue, ckpt = AsyncSaveQueue(), f"{fs}/ckpt"
    make_dir(ckpt)
    queue.schedule(dist_checkpointing.save(fault_state("w", shape, rank, world, 4), ckpt,
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
            "said": [(r.levelname, r.getMessage()) for r in records if r.levelno >= logging.WARNING],
            "retried": [r.getMessage() for r in records if event_of(r) == RETRYING]}


def _found_no_room(got: dict, rank: int, copy: str, fs: str, why: str) -> bool:
    """Whether rank ``rank`` said its copy to ``copy`` found no room (``why``: part of the reason), was tried
    again, and that the checkpoint in ``fs`` stays in the local tiers, naming itself, its node and the file."""
    return (any(f"rank {rank} (" in m and f"no room for {copy}: " in m and why in m for m in got["retried"])
            and any(level == "ERROR" and f"rank {rank} (" in m and f"{fs}/ckpt stays in the local tiers" in m
                    and f"kept failing for {RETRY_S:.0f} s" in m for level, m in got["said"]))


def test_a_persistent_directory_without_room_leaves_the_checkpoint_local(small_fs, tmp_path):
    """The persistent directory has no room for a tiered save's files (each rank's file is twice the filesystem):
    the save still commits on the local tiers and loads from there (no copy starts where it would leave under
    ``COPY_HEADROOM_BYTES`` free, so the commit's files find room); each rank's copy is refused, tried again until ``retry_s`` has passed, and each
    rank says the checkpoint stays in the local tiers, naming itself, its node and the file; no data file or
    partial copy stays in the persistent directory."""
    outcomes = run_faulty(2, _persistent_tier_full, small_fs, str(tmp_path / "local"), BIG)
    for rank, o in outcomes.items():
        assert o.kind == "ok", o.value
        got = o.value
        assert got["state"] == "local" and got["equal"], got
        assert not [n for n in got["left"] if is_data_file(n) or n.endswith(TMP_SUFFIX)], got["left"]
        said = "\n".join(f"{level} {m}" for level, m in got["said"])
        copy = os.path.join(small_fs, "ckpt", data_file_name(rank))
        assert _found_no_room(got, rank, copy, small_fs, "bytes to write"), said
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


def test_copies_that_fit_only_one_at_a_time_never_fill_the_persistent_directory(small_fs, tmp_path, capfd):
    """Each rank's copy alone fits in the persistent directory with ``COPY_HEADROOM_BYTES`` to spare, both do
    not, and both start at once: each copy allocates its bytes before it writes, so the second finds the first's
    taken, or cannot allocate its own, and is refused before it writes (never a copy failing midway with a full
    filesystem, which would also fail whatever else is written there, the checkpoint's commit among it); the
    save commits locally and loads, one rank's copy is refused and reported, and no partial copy stays."""
    _remount(small_fs, "size=390m")
    outcomes = run_faulty(2, _persistent_tier_full, small_fs, str(tmp_path / "local"), ROOM_FOR_ONE)
    refused = []
    for rank, o in outcomes.items():
        assert o.kind == "ok", o.value
        got = o.value
        assert got["state"] == "local" and got["equal"], got
        assert not _filled(m for _, m in got["said"]), got["said"]
        assert not [n for n in got["left"] if n.endswith(TMP_SUFFIX)], got["left"]
        if _found_no_room(got, rank, os.path.join(small_fs, "ckpt", data_file_name(rank)), small_fs, " bytes "):
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
    sd = fault_state("s", SMALL, rank, world, 2)
    with pytest.raises(SaveFailedError) as prepared:
        prepare_checkpoint_dir(f"{fs}/ckpt")
    with pytest.raises(SaveFailedError) as created:
        prepare_checkpoint_dir(f"{fs}/missing")
    with pytest.raises(SaveFailedError) as strategy:
        native_strategy().save(sd, f"{fs}/ckpt")
    return [str(prepared.value), str(created.value), str(strategy.value)]


def _save_prev_and_ckpt(rank: int, world: int, fs: str) -> None:
    save(fault_state("s", SMALL, rank, world, 1), f"{fs}/prev")
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
    run_ranks(1, load_and_verify, f"{small_fs}/prev", "s", SMALL, 1)


def _missing(rank: int, world: int, root: str) -> list[str]:
    path = f"{root}/missing"
    with pytest.raises(SaveFailedError) as prepared:
        prepare_checkpoint_dir(path, create=False)
    with pytest.raises(SaveFailedError) as strategy:
        native_strategy().save(fault_state("s", SMALL, rank, world, 2), path)
    prepare_checkpoint_dir(path)  # creates it: then the save works
    dist_checkpointing.save(fault_state("s", SMALL, rank, world, 2), path, sharded_strategy=native_strategy())
    return [str(prepared.value), str(strategy.value)]


def test_missing_directory_fails_on_every_rank_before_writing(tmp_path):
    root = str(tmp_path)
    for prepared, strategy in run_ranks(2, _missing, root):
        for text in (prepared, strategy):
            assert f"checkpoint directory {root}/missing does not exist" in text, text
        assert "rank 0:" in prepared and "rank 1:" in prepared, prepared
    run_ranks(1, load_and_verify, f"{root}/missing", "s", SMALL, 2)


def _megatron_save_into(rank: int, world: int, path: str) -> Raised:
    return save_error(lambda: dist_checkpointing.save(fault_state("s", SMALL, rank, world, 2), path,
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
    run_ranks(1, lambda rank, world: save(fault_state("s", SMALL, rank, world, 1), path))
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
