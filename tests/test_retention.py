"""A node's local tier: which copies it keeps, and a tier in memory keeping one copy loading every step back.

Real directories, manifests and persistent homes; the writes through the engine's own writer on the tmpfs at
/dev/shm.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time

import pytest
import torch
from megatron.core import dist_checkpointing

from fastpersist_dist import FastPersistLoadStrategy, FastPersistSaveStrategy, TierConfig, wait_copies, wait_durable
from fastpersist_dist.engine.tiers.retention import reading, retain
from fastpersist_dist.format.records import INDEX_FILE
from fastpersist_dist.format.tiers import DURABLE, LOCAL, TIERS_FILE, TierManifest, local_copy_dir
from fastpersist_dist.storage.persistent import PosixDir
from fastpersist_dist.tools.ranks import run_ranks
from fastpersist_dist.util.config import MiB

from .helpers import empty_like_request
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
    return sorted(os.listdir(local_dir))


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


def _train(rank: int, world: int, local: str, root: str, steps: int) -> list[str]:
    """Tiered saves of ``steps`` steps into a local tier in memory (keep_local=1), each waited durable, then every
    step loaded back; the local copies kept."""
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
    return _kept(local)


def test_tiered_saves_in_memory_keeping_one_copy_load_every_step_back(shm_dir, tmp_path):
    """keep_local=1, each save durable before the next: the copy of step k-2 is removed at step k's commit (step
    k-1's is the newest durable one then); every step loads back with its own values, from the local tier or the
    persistent one, and the local tier keeps the last two copies."""
    local = os.path.join(shm_dir, "local")
    for kept in run_ranks(2, _train, local, str(tmp_path), 5):
        assert kept == sorted(os.path.basename(local_copy_dir(local, str(tmp_path / f"step{k}"))) for k in (3, 4)), \
            kept
