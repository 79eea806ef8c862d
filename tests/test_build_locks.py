"""A process killed while loading DeepSpeed's ops leaves torch's build lock behind: the next save must not hang.

Each save here runs in a fresh interpreter (the pytest process has the ops loaded, and forked ranks
inherit them) with its own copy of the venv's op cache, so that its first load of the ops meets the lock
that a killed process left there, as every later job on that machine would.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from fastpersist_dist.storage import build_locks
from fastpersist_dist.storage.host_copy import _remove_partial_builds

pytestmark = pytest.mark.stack  # the ops each venv builds

ROOT = Path(__file__).resolve().parent.parent

# Holds torch's build lock of an op as a load of the ops by this package does (torch's FileBaton, its
# descriptor open and flocked), then sleeps: killed, it leaves the lock as a process killed in the middle
# of a build does.
HOLD = """
import os, sys, time
from torch.utils.file_baton import FileBaton
from fastpersist_dist.storage.build_locks import _batons_flocked
with _batons_flocked():
    assert FileBaton(os.path.join(sys.argv[1], "lock")).try_acquire()
print("held", flush=True)
time.sleep(600)
"""

# One rank's save in a fresh interpreter: its first save loads the ops.
SAVE = """
import logging, sys
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
from fastpersist_dist.tools.ranks import run_ranks
from tests.helpers import global_tensor, native_strategy, save, sharded

def one(rank, world, path, direct_io):
    save({"w": sharded("w", global_tensor("w", (64, 8)), rank, world, 0)}, path, native_strategy(direct_io=direct_io))
    return "saved"

print(run_ranks(1, one, sys.argv[1], sys.argv[2])[0], flush=True)
"""


@pytest.fixture
def ops_copy(tmp_path: Path) -> Iterator[str]:
    """A copy of this venv's built ops (up to date: a load builds nothing), for one test's processes. Beside the
    original, at the same depth: a build through ccache with a base directory (CI's) records the headers in its
    dependency files relative to the op's directory, which elsewhere would name no file and rebuild the op."""
    copy = os.path.join(sys.prefix, f"torch_ext-{tmp_path.name}-{os.getpid()}")
    shutil.copytree(os.path.join(sys.prefix, "torch_ext"), copy, ignore=shutil.ignore_patterns("lock"))
    try:
        yield copy
    finally:
        shutil.rmtree(copy, ignore_errors=True)


def _hold_lock(op_dir: str) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLD, op_dir], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert holder.stdout.readline().strip() == "held"
    return holder


def _save(ops: str, path: str, direct_io: str, **env: str) -> subprocess.CompletedProcess:
    run_env = {**os.environ, "TORCH_EXTENSIONS_DIR": ops, "PYTHONPATH": str(ROOT), **env}
    return subprocess.run([sys.executable, "-c", SAVE, path, direct_io], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env=run_env)


def test_a_lock_left_by_a_killed_process_is_cleared_and_the_next_save_works(ops_copy, tmp_path):
    lock = os.path.join(ops_copy, "utils", build_locks.LOCK_NAME)
    holder = _hold_lock(os.path.dirname(lock))
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert os.path.exists(lock)  # what the killed process left
    started = time.monotonic()
    done = _save(ops_copy, str(tmp_path / "ckpt"), "on")
    assert done.returncode == 0 and done.stdout.strip().endswith("saved"), done.stderr[-3000:]
    assert time.monotonic() - started < 120
    assert f"removed {lock}, a build lock of DeepSpeed's ops left by a process that died" in done.stderr
    assert not os.path.exists(lock)


def test_a_held_lock_is_waited_for_a_bounded_time_then_refused_naming_it(ops_copy, tmp_path):
    lock = os.path.join(ops_copy, "utils", build_locks.LOCK_NAME)
    holder = _hold_lock(os.path.dirname(lock))  # alive: a build in progress, as far as anyone can tell
    try:
        started = time.monotonic()
        done = _save(ops_copy, str(tmp_path / "ckpt"), "on", **{build_locks.WAIT_ENV: "7"})
        waited = time.monotonic() - started
    finally:
        holder.kill()
        holder.wait()
    assert done.returncode != 0 and waited < 120, done.stdout
    assert f"waiting for {lock}, held by pid {holder.pid}" in done.stderr  # said after a few seconds, at INFO
    assert f"waited more than 7 s for {lock}, held by pid {holder.pid}" in done.stderr, done.stderr[-3000:]
    assert f"rm {lock}" in done.stderr and "SaveFailedError" in done.stderr


def test_a_lock_of_a_build_in_progress_is_held_by_its_compiler_after_the_builder_died(tmp_path):
    """A killed builder's compiler processes run on in the op's directory: the lock is not stale until they end."""
    op_dir = tmp_path / "op"
    op_dir.mkdir()
    holder = _hold_lock(str(op_dir))
    compiler = subprocess.Popen(["sleep", "600"], cwd=op_dir)  # stands where an orphaned c++ would run
    try:
        holder.kill()
        holder.wait()
        lock = str(op_dir / build_locks.LOCK_NAME)
        verdict = build_locks.judge(lock)
        assert verdict is not None and not verdict.stale and verdict.holders == (compiler.pid,), verdict
    finally:
        compiler.kill()
        compiler.wait()
    assert build_locks.clear_stale(str(tmp_path), "test") == [] and not os.path.exists(lock)


def test_the_flock_tells_a_live_holder_from_a_dead_one(tmp_path):
    """What a process that cannot be looked at (another machine's, on a shared directory) still shows: its flock."""
    op_dir = tmp_path / "op"
    op_dir.mkdir()
    lock = str(op_dir / build_locks.LOCK_NAME)
    holder = _hold_lock(str(op_dir))
    try:
        assert build_locks.flocked(lock) and not build_locks.judge(lock).stale
    finally:
        holder.kill()
        holder.wait()
    assert not build_locks.flocked(lock) and build_locks.judge(lock).stale


def test_partial_builds_of_dead_processes_are_removed_from_the_cache(tmp_path):
    path = tmp_path / "stream_copy-0123.so"
    dead = subprocess.Popen(["true"])
    dead.wait()
    left = tmp_path / f"stream_copy-0123.so.{dead.pid}.tmp"
    mine = tmp_path / f"stream_copy-0123.so.{os.getpid()}.tmp"  # a live process's build in progress
    for p in (left, mine):
        p.write_bytes(b"partial")
    _remove_partial_builds(str(path))
    assert not left.exists() and mine.exists()
