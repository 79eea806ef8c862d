"""A node's local tier: which copies it keeps, and a tier in memory overwriting retired data files in place.

Real directories, manifests and persistent homes; the writes through the engine's own writer on the tmpfs at
/dev/shm, where a new file's pages are allocated and an old one's freed, and where a retired file is
overwritten instead.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import textwrap
import time

import pytest
import torch
from megatron.core import dist_checkpointing

from fastpersist_dist import FastPersistLoadStrategy, FastPersistSaveStrategy, TierConfig, wait_copies, wait_durable
from fastpersist_dist.engine.tiers.retention import reading, retain
from fastpersist_dist.format.records import INDEX_FILE
from fastpersist_dist.format.tiers import DURABLE, LOCAL, TIERS_FILE, TierManifest, local_copy_dir
from fastpersist_dist.storage.persistent import PosixDir
from fastpersist_dist.storage.recycle import POOL_DIR, pool_dir, retire, take
from fastpersist_dist.storage.writer import write_rank_file
from fastpersist_dist.tools.ranks import run_ranks
from fastpersist_dist.util.config import MiB, WriteConfig

from .faults import random_records
from .helpers import empty_like_request, logged, run_one_rank_script
from .tiers_driver import state

pytestmark = pytest.mark.engine

FILES = {"__0_0.distcp": 0, "__1_0.distcp": 1}


def _copy(local_dir: str, home: str, age: int, persistent: bool = True, durable: bool = False, held: bool = True
          ) -> tuple[str, TierManifest]:
    """A node's copy of checkpoint ``home`` made ``age`` seconds ago (its manifest, two data files of 1 and 2 MiB),
    and the persistent tier's manifest (``durable`` or local), unless ``held`` is False: the checkpoint was
    removed from there."""
    manifest = TierManifest(checkpoint_id=os.path.basename(home) * 4, checkpoint_dir=home, local_dir=local_dir,
                            nodes=((0, 1),), files=FILES, index_files=(INDEX_FILE,), index_xxh3_64="0" * 16,
                            state=LOCAL, created=time.time() - age, persistent=persistent)
    copy = local_copy_dir(local_dir, home)
    os.makedirs(copy)
    for i, name in enumerate(sorted(FILES)):
        with open(os.path.join(copy, name), "wb") as f:
            f.write(bytes([i + 1]) * ((i + 1) * MiB))
    with open(os.path.join(copy, TIERS_FILE), "wb") as f:
        f.write(manifest.to_json_bytes())
    if held:
        held_there = manifest.with_state(DURABLE, time.time()) if durable else manifest
        PosixDir(home).write(TIERS_FILE, held_there.to_json_bytes())
    return copy, manifest


def _kept(local_dir: str) -> list[str]:
    return sorted(n for n in os.listdir(local_dir) if n != POOL_DIR)


def test_the_newest_copies_the_newest_durable_one_those_not_durable_being_replicated_or_read_are_kept(tmp_path):
    """keep_local=1: every copy but the newest goes, unless it is the newest durable one, not durable yet, being
    replicated or read; the copy of a checkpoint the persistent tier no longer holds (its directory removed,
    overwritten by another save, tiered or not) goes whatever state it had, but not one whose save has not yet
    written its manifest there."""
    local, homes = str(tmp_path / "local"), tmp_path / "persistent"
    durable_old, _ = _copy(local, str(homes / "s1"), 60, durable=True)
    removed, _ = _copy(local, str(homes / "s1r"), 58, held=False)  # removed from the persistent tier, never durable
    overwritten, replaced = _copy(local, str(homes / "s1o"), 56)
    newer = dataclasses.replace(replaced, checkpoint_id="0123456789abcdef", state=DURABLE)  # another save's there
    PosixDir(str(homes / "s1o")).write(TIERS_FILE, newer.to_json_bytes())
    resaved, _ = _copy(local, str(homes / "s1w"), 54, held=False)  # saved there again without tiers: an index
    PosixDir(str(homes / "s1w")).write(INDEX_FILE, b"{}")
    local_only, _ = _copy(local, str(homes / "s2"), 50, persistent=False)
    replicating, queued = _copy(local, str(homes / "s2r"), 45, persistent=False)  # its replicas not sent yet
    durable_newest, _ = _copy(local, str(homes / "s3"), 40, durable=True)
    being_read, _ = _copy(local, str(homes / "s4"), 35, persistent=False)  # kept while a load reads it
    draining, _ = _copy(local, str(homes / "s5"), 30)  # persistent, not durable yet: perhaps the only copy
    starting, _ = _copy(local, str(homes / "s5s"), 25, held=False)  # its save has not written the manifest there
    PosixDir(str(homes / "s5s")).write("metadata.json", b"{}")
    current, manifest = _copy(local, str(homes / "s6"), 0)
    with reading(being_read):
        retain(TierConfig(local, keep_local=1), manifest, replicating=frozenset({queued.checkpoint_id}))
    kept = [replicating, durable_newest, being_read, draining, starting, current]
    assert _kept(local) == sorted(os.path.basename(p) for p in kept), _kept(local)
    assert not any(os.path.exists(p) for p in (durable_old, removed, overwritten, resaved, local_only))
    retain(TierConfig(local, keep_local=1), manifest)  # the load is over, the replication done
    assert not os.path.exists(being_read) and not os.path.exists(replicating)


def test_a_copy_of_a_removed_checkpoint_goes_even_among_the_newest(tmp_path):
    """keep_local=3: the copies of checkpoints whose directory was removed from the persistent tier (one saved to
    it, one local-only: a framework's cleanup of its non-persistent checkpoints) go at once, being of no
    checkpoint; the others stay."""
    local, homes = str(tmp_path / "local"), tmp_path / "persistent"
    removed, _ = _copy(local, str(homes / "s1"), 30, durable=True)
    removed_local_only, _ = _copy(local, str(homes / "s2"), 20, persistent=False)
    kept, _ = _copy(local, str(homes / "s3"), 10, durable=True)
    current, manifest = _copy(local, str(homes / "s4"), 0)
    for gone in ("s1", "s2"):
        shutil.rmtree(homes / gone)
    retain(TierConfig(local, keep_local=3), manifest)
    assert _kept(local) == sorted(os.path.basename(p) for p in (kept, current)), _kept(local)
    assert not os.path.exists(removed) and not os.path.exists(removed_local_only)


def test_a_retired_copy_in_memory_leaves_its_data_files_for_the_next_writes_to_overwrite(shm_dir, tmp_path):
    local, homes = os.path.join(shm_dir, "local"), tmp_path / "persistent"
    old, _ = _copy(local, str(homes / "s1"), 60, persistent=False)
    inodes = {os.stat(os.path.join(old, n)).st_ino for n in FILES}
    current, manifest = _copy(local, str(homes / "s2"), 0, persistent=False)
    pool = pool_dir(local)
    retain(TierConfig(local, keep_local=1), manifest, pool, limit=1)
    assert not os.path.exists(old) and _kept(local) == [os.path.basename(current)]
    (kept,) = os.listdir(pool)  # one file per writer of the node (limit), the other removed
    assert os.stat(os.path.join(pool, kept)).st_ino in inodes
    pooled = os.stat(os.path.join(pool, kept))
    run_ranks(1, _overwrite, os.path.join(shm_dir, "next"), pool, pooled.st_ino, pooled.st_size)
    assert os.listdir(pool) == []


def _overwrite(rank: int, world: int, directory: str, pool: str, inode: int, pooled_bytes: int) -> None:
    """Two writes into ``directory`` taking from ``pool``: the first overwrites the pooled file (same inode, cut to
    its own length, every byte its own), the second, the pool empty, writes a new file."""
    os.makedirs(directory)
    items = random_records([MiB // 2 + 3, 7], rank)  # shorter than the pooled file: its tail must go
    expected = b"".join(bytes(item.data.numpy()) for item in items)
    assert len(expected) < pooled_bytes
    records = logged(level=logging.DEBUG)
    for name, reused in (("a.bin", True), ("b.bin", False)):
        path = os.path.join(directory, name)
        records.clear()
        result = write_rank_file(path, items, WriteConfig(checksum_block_mb=1), rank, reuse_from=pool)
        assert result.mode == "buffered"
        assert (os.stat(path).st_ino == inode) == reused, name
        with open(path, "rb") as f:
            assert f.read() == expected, name
        assert any("over a retired file" in r.getMessage() for r in records) == reused, name


def test_retire_keeps_at_most_limit_files_and_each_taker_gets_a_different_one(shm_dir):
    pool = pool_dir(shm_dir)
    sources = []
    for i in range(3):
        sources.append(os.path.join(shm_dir, f"f{i}"))
        with open(sources[-1], "wb") as f:
            f.write(b"x")
    assert retire(pool, sources, limit=2) == 2
    assert not any(os.path.exists(s) for s in sources) and len(os.listdir(pool)) == 2
    assert take(pool, os.path.join(shm_dir, "a")) and take(pool, os.path.join(shm_dir, "b"))
    assert not take(pool, os.path.join(shm_dir, "c"))
    assert os.stat(os.path.join(shm_dir, "a")).st_ino != os.stat(os.path.join(shm_dir, "b")).st_ino


def _train(rank: int, world: int, local: str, root: str, steps: int) -> list[str]:
    """Tiered saves of ``steps`` steps into a local tier in memory (keep_local=1), each waited durable, then every
    step loaded back; the DEBUG lines of this rank's writes."""
    records = logged("fastpersist_dist.storage.writer", logging.DEBUG)
    strategy = FastPersistSaveStrategy(tiers=TierConfig(local, keep_local=1))
    for step in range(steps):
        ckpt = os.path.join(root, f"step{step}")
        if rank == 0:
            os.makedirs(ckpt)
        torch.distributed.barrier()
        dist_checkpointing.save(state(rank, world, step, rows=2048), ckpt, sharded_strategy=strategy)
        assert wait_durable(ckpt, timeout=120) and wait_copies(timeout=120)
    for step in range(steps):
        want = state(rank, world, step, rows=2048)
        loaded = dist_checkpointing.load({k: empty_like_request(v) for k, v in want.items()},
                                         os.path.join(root, f"step{step}"),
                                         sharded_strategy=FastPersistLoadStrategy(local_dir=local))
        assert all(torch.equal(loaded[k], v.data) for k, v in want.items()), step
    return [r.getMessage() for r in records if " wrote " in r.getMessage()]


def test_tiered_saves_in_memory_overwrite_the_files_of_the_copies_they_retire(shm_dir, tmp_path):
    """keep_local=1, each save durable before the next: the copy of step k-2 is retired at step k's commit (step
    k-1's is the newest durable one then), so from step 3 on each rank overwrites one of its files; every step
    loads back with its own values, from the local tier or the persistent one."""
    local = os.path.join(shm_dir, "local")
    logs = run_ranks(2, _train, local, str(tmp_path), 5)
    for lines in logs:
        assert len(lines) == 5, lines
        assert ["over a retired file" in line for line in lines] == [False, False, False, True, True], lines
    assert len(os.listdir(pool_dir(local))) <= 2


RETIRING_PROCESS = textwrap.dedent("""
    import os
    import sys

    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    from fastpersist_dist import FastPersistSaveStrategy, TierConfig, wait_copies
    from fastpersist_dist.storage.recycle import pool_dir

    local, root = sys.argv[1:3]
    dist.init_process_group("gloo")
    sd = {"w": ShardedTensor.from_rank_offsets("w", torch.arange(1 << 20, dtype=torch.float32), replica_id=0)}
    strategy = FastPersistSaveStrategy(tiers=TierConfig(local, keep_local=1, persistent=False))
    for step in range(2):
        os.makedirs(f"{root}/step{step}")
        dist_checkpointing.save(sd, f"{root}/step{step}", sharded_strategy=strategy)
    assert wait_copies(timeout=60)
    print("retired:", len(os.listdir(pool_dir(local))), flush=True)
""")


def test_retired_files_no_save_took_are_removed_when_the_process_exits(shm_dir, tmp_path):
    """Two local checkpoints keeping one copy: the second save retires the first one's data file, which no
    later save takes; the process's exit removes it."""
    local = os.path.join(shm_dir, "local")
    done = run_one_rank_script(RETIRING_PROCESS, local, str(tmp_path))
    assert done.returncode == 0 and "retired: 1" in done.stdout, done.stdout + done.stderr[-3000:]
    assert not os.path.exists(pool_dir(local)) or os.listdir(pool_dir(local)) == []
    assert _kept(local) == [os.path.basename(local_copy_dir(local, str(tmp_path / "step1")))]

