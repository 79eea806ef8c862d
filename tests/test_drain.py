"""The drain's edges: what rank 0 clears from a persistent directory, a save that is never committed, and a save
into the directory of a checkpoint still being drained.

Every rank's drain writes into the same directory at once (its data file, its marker); rank 0 also removes
what an earlier checkpoint of that name left. It must never remove what another rank of this checkpoint is
writing: for an async save each rank copies its data file once it is written and leaves its marker right after
the local commit, often while rank 0 is still clearing.
An async save whose finalize never runs is committed all the same once written, and durable by the exit; one
whose write reaches the writer only after the exit began is given up and leaves nothing.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import textwrap
import time
import uuid
from concurrent.futures import Future
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor

from fastpersist_dist import (FastPersistLoadStrategy, FastPersistSaveStrategy, TierConfig, checkpoint_state,
                              wait_copies, wait_durable)
from fastpersist_dist.format.checksum import digest_bytes
from fastpersist_dist.engine.tiers.drain import _committed_index, _remove_stale
from fastpersist_dist.engine.tiers.state import (POLL_OBJECT_STORE_S, POLL_S, drained_marker, failed_marker,
                                                 poll_pauses)
from fastpersist_dist.format.records import INDEX_FILE, is_data_file
from fastpersist_dist.format.tiers import LOCAL, TIERS_FILE, TierManifest
from fastpersist_dist.storage.files import TMP_SUFFIX
from fastpersist_dist.storage.persistent import PosixDir
from fastpersist_dist.util.errors import FastPersistError
from fastpersist_dist.util.events import COMMITTED_LOCALLY, DURABLE, WAITING_FOR_COPIES, event_of, field_of
from fastpersist_dist.tools.ranks import run_ranks
from fastpersist_dist.tools.verify import verify_checkpoint

from .faults import SMALL, fault_state, run_faulty
from .helpers import empty_like_request, global_tensor, hold_drains, load, logged, run_one_rank_script
from .tiers_driver import state

pytestmark = pytest.mark.engine


def _manifest(home: str, checkpoint_id: str) -> TierManifest:
    return TierManifest(checkpoint_id=checkpoint_id, checkpoint_dir=home, local_dir="/local", nodes=((0,), (1,)),
                        files={"__0_0.distcp": 0, "__1_0.distcp": 1}, index_files=(INDEX_FILE,),
                        index_xxh3_64="0" * 16, state=LOCAL, created=time.time())


def test_rank_0_clears_what_an_earlier_checkpoint_left_before_any_rank_copies(tmp_path):
    """Before its word to the other ranks no copy of this checkpoint is under way: every temporary file and
    marker there is an earlier save's; data files this checkpoint rewrites stay until replaced."""
    home = str(tmp_path)
    now, before = _manifest(home, "a" * 32), _manifest(home, "b" * 32)
    with open(os.path.join(home, TIERS_FILE), "wb") as f:
        f.write(now.to_json_bytes())
    kept = ["__0_0.distcp", "__1_0.distcp", INDEX_FILE, "common.pt", "metadata.json", TIERS_FILE]
    stale = ["__2_0.distcp", f"__2_0.distcp.123{TMP_SUFFIX}", f"__0_0.distcp.456{TMP_SUFFIX}",
             drained_marker(before, "__0_0.distcp"), drained_marker(before, "__1_0.distcp") + TMP_SUFFIX,
             failed_marker(before, "__1_0.distcp"), f"common.pt{TMP_SUFFIX}"]
    for name in kept + stale:
        if name != TIERS_FILE:
            open(os.path.join(home, name), "wb").close()
    _remove_stale(PosixDir(home), now)
    assert sorted(os.listdir(home)) == sorted(kept)
    _remove_stale(PosixDir(home), before)  # a newer save took the directory over: nothing of it goes
    assert sorted(os.listdir(home)) == sorted(kept)


@pytest.mark.parametrize("where, longest", [("/shared/ckpt", POLL_S), ("msc://s3/ckpt", POLL_OBJECT_STORE_S)])
def test_a_wait_looks_again_soon_then_less_and_less_often(where, longest):
    """Rank 0's wait for the other ranks' copies (and ``wait_durable``): what it waits for mostly ends just after
    it starts, so it looks again within a few milliseconds, then backs off to one look per ``longest``."""
    pauses = [p for p, _ in zip(poll_pauses(where), range(12))]
    assert pauses[0] == pytest.approx(longest / 16)
    assert all(b == pytest.approx(min(2 * a, longest)) for a, b in zip(pauses, pauses[1:]))
    assert pauses[-1] == longest and sum(pauses[:5]) < 2 * longest


NEVER_FINALIZED = textwrap.dedent("""
    import os
    import sys

    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    from fastpersist_dist import ASYNC_SAVE_KWARGS, FastPersistSaveStrategy, TierConfig

    local, ckpt = sys.argv[1:3]
    dist.init_process_group("gloo")
    w = torch.arange(4 << 20, dtype=torch.float32)
    sd = {"w": ShardedTensor.from_rank_offsets("w", w, replica_id=0)}
    tiers = TierConfig(os.path.abspath(local))
    request = dist_checkpointing.save(sd, ckpt, sharded_strategy=FastPersistSaveStrategy(tiers=tiers),
                                      async_sharded_save=True, **ASYNC_SAVE_KWARGS)
    request.async_fn(*request.async_fn_args, **request.async_fn_kwargs)  # the write; its finalize never runs
    print("written", flush=True)
""")


def test_a_save_written_but_never_finalized_is_durable_by_the_exit(tmp_path):
    """The drain copies the data file once its writer is done; the script never finalizes and exits: the local
    commit came once the write was done all the same, and the exit waits for the copy, so the checkpoint is
    durable, with no temporary file left, and reads back whole."""
    ckpt, local = tmp_path / "persistent" / "step1", tmp_path / "local"
    ckpt.mkdir(parents=True)
    done = run_one_rank_script(NEVER_FINALIZED, str(local), str(ckpt))
    assert done.returncode == 0 and "written" in done.stdout, done.stderr[-3000:]
    assert checkpoint_state(str(ckpt)) == "durable", done.stderr[-3000:]
    assert not [n for n in os.listdir(ckpt) if n.endswith(TMP_SUFFIX)], os.listdir(ckpt)
    report = verify_checkpoint(str(ckpt))
    assert report.ok, report.problems



SAVED_LAST = textwrap.dedent("""
    import os
    import sys

    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    from fastpersist_dist import FastPersistSaveStrategy, TierConfig

    local, ckpt, numel, action = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    if ckpt.startswith("msc://"):
        from megatron.core.msc_utils import MultiStorageClientFeature

        MultiStorageClientFeature.enable()
    dist.init_process_group("gloo")
    w = torch.arange(numel, dtype=torch.float32)
    if action == "save":
        sd = {"w": ShardedTensor.from_rank_offsets("w", w, replica_id=0)}
        tiers = TierConfig(os.path.abspath(local), retry_s=5)  # a copy failing at every try gives up soon
        dist_checkpointing.save(sd, ckpt, sharded_strategy=FastPersistSaveStrategy(tiers=tiers))
        print("saved", flush=True)
    else:  # a plain load: the checkpoint names its local tier, gone here, so every byte comes from ckpt
        got = dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", torch.empty_like(w))}, ckpt)
        print("loaded", bool(torch.equal(got["w"], w)), flush=True)
""")


def _saved_last(local: str, ckpt: str, numel: int) -> None:
    """``SAVED_LAST`` run as the one rank of a process group: its output says it saved and nothing failed, and
    the checkpoint is durable once the process is gone: a directory verified whole; from an object store, with
    the local tier removed, a new process loads it from there alone, equal."""
    done = run_one_rank_script(SAVED_LAST, local, ckpt, str(numel), "save")
    assert done.returncode == 0 and "saved" in done.stdout, done.stderr[-3000:]
    assert "failed" not in done.stderr, done.stderr[-3000:]
    assert checkpoint_state(ckpt) == "durable", done.stderr[-3000:]
    if not ckpt.startswith("msc://"):
        report = verify_checkpoint(ckpt)
        assert report.ok, report.problems
        return
    shutil.rmtree(local)
    loaded = run_one_rank_script(SAVED_LAST, local, ckpt, str(numel), "load")
    assert loaded.returncode == 0 and "loaded True" in loaded.stdout, (loaded.stdout, loaded.stderr[-3000:])


def test_a_synchronous_save_as_the_last_thing_a_script_does_is_durable_by_the_exit(tmp_path):
    """The copy to the persistent tier starts at the local commit, while the script is already exiting: the
    interpreter then starts no thread (Python 3.12 refuses any), so the copy's read-ahead must run on a thread kept
    from before, or it fails at every try until ``retry_s`` runs out."""
    ckpt = tmp_path / "persistent" / "step1"
    ckpt.mkdir(parents=True)
    _saved_last(str(tmp_path / "local"), str(ckpt), 4 << 20)


@pytest.mark.slow
def test_a_synchronous_save_to_object_storage_as_the_last_thing_a_script_does_is_durable_by_the_exit(tmp_path, s3):
    """The same into S3 (msc://, boto3), with a data file above msc's multipart threshold (64 MiB): boto3 sends
    the parts of such a file from threads of its own, which an exiting interpreter does not start."""
    _saved_last(str(tmp_path / "local"), f"msc://s3/{uuid.uuid4().hex}/step1", 20 << 20)


LATE_WRITE = textwrap.dedent("""
    import atexit
    import os
    import sys

    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    from fastpersist_dist import ASYNC_SAVE_KWARGS, FastPersistSaveStrategy, TierConfig

    local, ckpt = sys.argv[1:3]
    caller = {}

    def write_late():  # registered before the save: runs after fastpersist's own exit hook
        os.write(caller["go"], b"x")
        _, status = os.waitpid(caller["pid"], 0)
        print("written late", os.waitstatus_to_exitcode(status), flush=True)

    atexit.register(write_late)
    dist.init_process_group("gloo")
    w = torch.arange(4 << 20, dtype=torch.float32)
    sd = {"w": ShardedTensor.from_rank_offsets("w", w, replica_id=0)}
    tiers = TierConfig(os.path.abspath(local))
    request = dist_checkpointing.save(sd, ckpt, sharded_strategy=FastPersistSaveStrategy(tiers=tiers),
                                      async_sharded_save=True, **ASYNC_SAVE_KWARGS)
    wait, go = os.pipe()
    pid = os.fork()
    if pid == 0:  # a forking async caller, as megatron's: its write starts once the trainer is exiting
        os.close(go)
        os.read(wait, 1)
        request.async_fn(*request.async_fn_args, **request.async_fn_kwargs)
        os._exit(0)
    os.close(wait)
    caller.update(go=go, pid=pid)
    print("exiting", flush=True)
""")


def test_an_async_write_that_starts_after_the_exit_began_leaves_nothing(tmp_path):
    """An async save never finalized, whose write reaches the rank's writer only after the process began to exit
    (its drain given up before anything was written): the writer is stopped before the drain gives up, so the
    late job fails and no copy appears in the persistent directory."""
    ckpt, local = tmp_path / "persistent" / "step1", tmp_path / "local"
    ckpt.mkdir(parents=True)
    done = run_one_rank_script(LATE_WRITE, str(local), str(ckpt))
    assert done.returncode == 0 and "written late 0" in done.stdout, done.stderr[-3000:]
    assert "stopped as the trainer exited with this save not finalized" in done.stderr, done.stderr[-3000:]
    assert not [n for n in os.listdir(ckpt) if n.endswith(TMP_SUFFIX) or is_data_file(n)], os.listdir(ckpt)
    assert checkpoint_state(str(ckpt)) is None


def _saved_twice_into_one_directory(rank: int, world: int, root: str, second: str) -> dict:
    """A tiered save, then a save into the same directory (tiered or not: ``second``) while rank 1 has not yet
    copied its file of the first: a job queued ahead of that copy on rank 1's drain thread holds it until the
    second save says it waits (or has returned, where it does not)."""
    ckpt, local = os.path.join(root, "persistent", "latest"), os.path.join(root, "local")
    records = logged("fastpersist_dist", logging.DEBUG)
    held = hold_drains(root, rank, world) if rank == 1 else Future()

    class Release(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if event_of(record) == WAITING_FOR_COPIES and field_of(record, "checkpoint") == ckpt:
                release()

    def release() -> None:
        if not held.done():
            held.set_exception(RuntimeError("released"))

    logging.getLogger("fastpersist_dist").addHandler(Release())
    if rank == 0:
        os.makedirs(ckpt)
    dist.barrier()
    strategy = FastPersistSaveStrategy(local_dir=local, keep_local=2)
    dist_checkpointing.save(state(rank, world, 1), ckpt, sharded_strategy=strategy)
    try:
        dist_checkpointing.save(state(rank, world, 2), ckpt,
                                sharded_strategy=strategy if second == "tiered" else FastPersistSaveStrategy())
    finally:
        release()
    assert wait_durable(ckpt, timeout=120) and wait_copies(timeout=120)
    dist.barrier()
    if rank == 0:  # the load below reads the persistent tier only
        shutil.rmtree(local)
    dist.barrier()
    want = state(rank, world, 2)
    loaded = dist_checkpointing.load({k: empty_like_request(v) for k, v in want.items()}, ckpt,
                                     sharded_strategy=FastPersistLoadStrategy())
    return {"equal": all(torch.equal(loaded[k], v.data) for k, v in want.items()),
            "waited": any(event_of(r) == WAITING_FOR_COPIES for r in records),
            "problems": [r.getMessage() for r in records if r.levelno >= logging.WARNING],
            "events": [event_of(r) for r in records if event_of(r) in (COMMITTED_LOCALLY, DURABLE)
                       and field_of(r, "checkpoint") == ckpt]}


@pytest.mark.parametrize("second", ["tiered", "without tiers"])
def test_a_save_into_the_directory_of_a_checkpoint_still_draining_waits_for_its_copies(tmp_path, second):
    """Saving into the same directory again (a fixed "latest" directory) while the copies of the tiered checkpoint
    saved there before are under way: each rank waits for its own before the save touches a file, so the first
    becomes durable, then the second, which is what the persistent tier holds; nothing is logged as a failure (the
    drain of the first once read its index from a node copy the second had already removed)."""
    results = run_ranks(2, _saved_twice_into_one_directory, str(tmp_path), second)
    for result in results:
        assert result["equal"] and result["waited"] and not result["problems"], result
    events = [COMMITTED_LOCALLY, DURABLE] * (2 if second == "tiered" else 1)
    assert results[0]["events"] == events, results[0]["events"]


def test_the_drain_commits_only_the_index_its_local_commit_wrote(tmp_path):
    """Rank 0's drain takes the index it commits from its node's copy: where another save has rewritten or
    removed it there, it refuses, naming the file and the checkpoint."""
    index = tmp_path / INDEX_FILE
    index.write_bytes(b'{"records": []}')
    m = _manifest(str(tmp_path / "persistent"), "c1")
    with pytest.raises(FastPersistError, match=f"{index} is not the index of checkpoint c1 any more"):
        _committed_index(m, str(tmp_path))
    ours = replace(m, index_xxh3_64=digest_bytes(index.read_bytes()))
    assert _committed_index(ours, str(tmp_path)) == {INDEX_FILE: index.read_bytes()}
    index.unlink()
    with pytest.raises(FastPersistError, match="cannot read this node's copy of its index"):
        _committed_index(ours, str(tmp_path))


def _peer_gone_before_its_copy(rank: int, world: int, root: str) -> dict:
    """Rank 1's drain held back, its process killed once the save is committed locally."""
    if rank == 1:
        hold_drains(root, rank, world)
    ckpt = f"{root}/ckpt"
    os.makedirs(ckpt, exist_ok=True)
    tiers = TierConfig(f"{root}/local", retry_s=0)  # a silent peer is given up after the least silence
    dist_checkpointing.save(fault_state("w", SMALL, rank, world, 1), ckpt,
                            sharded_strategy=FastPersistSaveStrategy(tiers=tiers))
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return {"copies_done": wait_copies(), "state": checkpoint_state(ckpt)}


def test_a_rank_gone_during_the_drain_leaves_the_checkpoint_local_and_the_survivors_go_on(tmp_path):
    """Rank 0 copies its file, then waits for a rank whose process died before its copy: once that rank showed no
    sign of life for the silence, rank 0's drain gives the checkpoint up, local, and its process goes on; the
    checkpoint loads from the local tier."""
    root = str(tmp_path)
    outcomes = run_faulty(2, _peer_gone_before_its_copy, root)
    assert outcomes[1].kind == "killed", outcomes[1]
    assert outcomes[0].kind == "ok" and outcomes[0].value == {"copies_done": True, "state": LOCAL}, outcomes[0]
    assert run_ranks(1, _loads_as_saved, f"{root}/ckpt") == [True]


def _loads_as_saved(rank: int, world: int, ckpt: str) -> bool:
    want = global_tensor("w", SMALL, salt=1)
    got = load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros_like(want), replica_id=rank)}, ckpt)
    return bool(torch.equal(got["w"], want))
