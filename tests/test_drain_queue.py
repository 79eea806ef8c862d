"""Rank 0's drain at scale: it learns that the other ranks' copies are over from the process group's store, not
by listing the persistent tier, and the queue of checkpoints waiting for the persistent tier is bounded."""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future

import pytest
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing

from fastpersist_dist import FastPersistLoadStrategy, FastPersistSaveStrategy, checkpoint_state, wait_copies, wait_durable
from fastpersist_dist.engine.tiers.background import drainer
from fastpersist_dist.storage.persistent import PosixDir
from fastpersist_dist.tools.ranks import run_ranks
from fastpersist_dist.util.events import NOT_DRAINED, event_of, field_of

from .helpers import empty_like_request, hold_drains, logged
from .tiers_driver import state

pytestmark = pytest.mark.engine


def _drained_while_rank_1_is_held(rank: int, world: int, root: str) -> dict:
    """A tiered save while a job queued ahead on rank 1's drain thread holds its copy back for a while; rank 0's
    drain thread's listings of the persistent directory counted meanwhile, and once rank 1's copy is done."""
    ckpt, local = os.path.join(root, "persistent", "step1"), os.path.join(root, "local")
    held = hold_drains(root, rank, world) if rank == 1 else Future()
    listings: list[float] = []
    names = PosixDir.names

    def counted(self: PosixDir) -> list[str]:
        if threading.current_thread().name == drainer().name and self.url == ckpt:
            listings.append(time.monotonic())
        return names(self)

    PosixDir.names = counted  # type: ignore[method-assign]
    if rank == 0:
        os.makedirs(ckpt)
    dist.barrier()
    dist_checkpointing.save(state(rank, world, 1), ckpt, sharded_strategy=FastPersistSaveStrategy(local_dir=local))
    time.sleep(1.0)  # rank 1's copy held back: rank 0's drain waits for it
    held_state, while_held = checkpoint_state(ckpt), len(listings)
    dist.barrier()
    if rank == 1:
        held.set_exception(RuntimeError("released"))
    durable = wait_durable(ckpt, timeout=120)
    PosixDir.names = names  # type: ignore[method-assign]
    return {"held_state": held_state, "while_held": while_held, "listings": len(listings), "durable": durable}


def test_rank_0_waits_for_the_other_ranks_copies_without_listing_the_persistent_tier(tmp_path):
    """While another rank's copy is under way rank 0's drain looks at the process group's store, not at the
    persistent directory (on an object store each look is a LIST request): it lists it once to clear what an
    earlier checkpoint left and once to read the markers when every rank is done, and the checkpoint is durable."""
    results = run_ranks(2, _drained_while_rank_1_is_held, str(tmp_path))
    assert results[0]["held_state"] == "local" and results[0]["durable"], results
    assert results[0]["while_held"] <= 1 and results[0]["listings"] == 2, results


def _saved_while_the_drain_is_held(rank: int, world: int, root: str) -> dict:
    """Three tiered saves while a job queued ahead on rank 0's drain thread holds the copies back (a persistent
    tier slower than the saves), the hold let go and the copies done, then a fourth save; each checkpoint's state
    and values."""
    local = os.path.join(root, "local")
    held = hold_drains(root, rank, world) if rank == 0 else Future()
    records = logged("fastpersist_dist", logging.WARNING)
    strategy = FastPersistSaveStrategy(local_dir=local, keep_local=4)

    def save(step: int) -> str:
        ckpt = os.path.join(root, "persistent", f"s{step}")
        if rank == 0:
            os.makedirs(ckpt)
        dist.barrier()
        dist_checkpointing.save(state(rank, world, step), ckpt, sharded_strategy=strategy)
        return ckpt

    saved = [save(step) for step in (1, 2, 3)]
    while_held = [checkpoint_state(c) for c in saved]
    dist.barrier()
    if rank == 0:
        held.set_exception(RuntimeError("released"))
    wait_copies(timeout=120)  # the copies of the first two done: none waits at the next save's local commit
    saved.append(save(4))
    wait_copies(timeout=120)
    dist.barrier()
    out: dict = {"while_held": while_held, "states": [checkpoint_state(c) for c in saved], "equal": []}
    for step, ckpt in enumerate(saved, 1):
        want = state(rank, world, step)
        loaded = dist_checkpointing.load({k: empty_like_request(v) for k, v in want.items()}, ckpt,
                                         sharded_strategy=FastPersistLoadStrategy())
        out["equal"].append(all(torch.equal(loaded[k], v.data) for k, v in want.items()))
    out["not_drained"] = [field_of(r, "checkpoint") for r in records if event_of(r) == NOT_DRAINED]
    return out


def test_a_persistent_tier_slower_than_the_saves_keeps_the_checkpoint_beyond_the_backlog_local(tmp_path):
    """The copies of two checkpoints held back on rank 0: the third save is committed to the local tiers and stays
    there, not drained, with a warning naming it; the first two become durable once the copies go on, and the next
    save is drained again. Every checkpoint loads with the values saved."""
    results = run_ranks(2, _saved_while_the_drain_is_held, str(tmp_path))
    s3 = os.path.join(tmp_path, "persistent", "s3")
    assert results[0]["not_drained"] == [s3] and results[1]["not_drained"] == [], results
    for r in results:
        assert r["while_held"] == ["local"] * 3, r
        assert r["states"] == ["durable", "durable", "local", "durable"] and all(r["equal"]), r
