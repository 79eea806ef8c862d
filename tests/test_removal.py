"""A framework's retention removing tiered checkpoints (``remove_checkpoint``): never the newest durable one.

Two ranks on one node, tiered saves into a local tier beside a persistent directory, each checkpoint inside a
directory of its own as NeMo lays them out (``<name>/weights``); the removal asked for on rank 0, as NeMo's
``save_top_k`` does, right after the next save's local commit.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future
from typing import Optional

import pytest
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing

from fastpersist_dist import (
    FastPersistLoadStrategy,
    FastPersistSaveStrategy,
    TierConfig,
    checkpoint_state,
    compat,
    prepare_checkpoint_dir,
    remove_checkpoint,
    wait_copies,
    wait_durable,
)
from fastpersist_dist.format.kinds import checkpoint_format
from fastpersist_dist.format.tiers import local_copy_dir
from fastpersist_dist.tools.ranks import run_ranks

from .helpers import empty_like_request, hold_drains, logged
from .tiers_driver import state

pytestmark = pytest.mark.engine


def _save(rank: int, world: int, root: str, name: str, step: int, tiers: Optional[TierConfig],
          strategy: Optional[FastPersistSaveStrategy] = None) -> str:
    ckpt = os.path.join(root, "persistent", name, "weights")
    prepare_checkpoint_dir(ckpt)
    dist_checkpointing.save(state(rank, world, step), ckpt,
                            sharded_strategy=strategy or FastPersistSaveStrategy(tiers=tiers))
    return ckpt


def _removed_while_watching(path: str, successor: str) -> list[str]:
    """``remove_checkpoint(path)`` on this rank, then, until its background work is done, the state of
    ``successor`` each time ``path`` is seen gone."""
    remove_checkpoint(path)
    seen = []
    while True:
        done = wait_copies(timeout=0)
        if not os.path.exists(path):
            seen.append(checkpoint_state(successor))
        if done:
            return seen
        time.sleep(0.001)


def _retention(rank: int, world: int, root: str) -> dict:
    local = os.path.join(root, "local")
    tiers = TierConfig(local, keep_local=1)
    warnings = logged("fastpersist_dist", logging.INFO)
    out: dict = {}
    s1 = _save(rank, world, root, "s1", 1, tiers)
    assert wait_durable(s1, timeout=120)
    s2 = _save(rank, world, root, "s2", 2, tiers)
    if rank == 0:  # s1 given up while s2 is still on its way to the persistent tier
        out["s2_seen"] = _removed_while_watching(os.path.dirname(s1), s2)
    dist.barrier()
    out["s1_left"] = os.path.exists(os.path.dirname(s1))
    # s3's copy to the persistent tier fails for good (rank 1's data file cannot be put in place there: a
    # directory has its name), so s3 stays local and s2, the newest durable checkpoint, must stay too
    s3_dir = os.path.join(root, "persistent", "s3", "weights")
    if rank == 0:
        os.makedirs(os.path.join(s3_dir, checkpoint_format(compat.DEFAULT_FORMAT).data_file(1)))
    dist.barrier()
    s3 = _save(rank, world, root, "s3", 3, TierConfig(local, keep_local=1, retry_s=0))
    if rank == 0:
        out["s3_seen"] = _removed_while_watching(os.path.dirname(s2), s3)
    assert wait_copies(timeout=120)
    dist.barrier()
    out["states"] = [checkpoint_state(c) for c in (s2, s3)]
    out["s1_local_copy"] = os.path.exists(local_copy_dir(local, s1))
    want = state(rank, world, 2)
    loaded = dist_checkpointing.load({k: empty_like_request(v) for k, v in want.items()}, s2,
                                     sharded_strategy=FastPersistLoadStrategy())
    out["s2_equal"] = all(torch.equal(loaded[k], v.data) for k, v in want.items())
    out["messages"] = [r.getMessage() for r in warnings if "remove" in r.getMessage() or "kept" in r.getMessage()]
    return out


def test_a_removal_waits_for_the_next_checkpoint_to_be_durable_and_never_takes_the_newest_durable_one(tmp_path):
    """s1 removed (on rank 0) right after s2's local commit: gone only once s2 is durable, and its local copy with
    the next commit; s2 removed after s3's commit, whose copy to the persistent tier failed: s2 stays, the newest
    durable checkpoint, whole, and the warning names s3."""
    first, second = run_ranks(2, _retention, str(tmp_path))
    s2 = str(tmp_path / "persistent" / "s2")
    assert first["s2_seen"] and set(first["s2_seen"]) == {"durable"}, first  # s1 was gone only once s2 was durable
    assert not first["s1_left"] and not second["s1_left"]
    assert not first["s3_seen"], first  # s2 never went
    assert first["states"] == ["durable", "local"], first
    assert not first["s1_local_copy"] and first["s2_equal"] and second["s2_equal"], (first, second)
    assert any(m.startswith(f"fastpersist: removed {tmp_path}/persistent/s1, once ") for m in first["messages"])
    kept = [m for m in first["messages"] if m.startswith(f"fastpersist: {s2} was to be removed and is kept")]
    assert len(kept) == 1 and f"{tmp_path}/persistent/s3/weights, is local, not durable" in kept[0], first


def _saved_again_before_its_removal_ran(rank: int, world: int, root: str, prepared: bool) -> dict:
    """p saved without tiers; on rank 0 a job queued on the drain thread holds back the drain of the tiered save q
    behind it, so the removal of p asked for next waits; p is then saved again with another state, the job let go
    (``prepared``: between ``prepare_checkpoint_dir`` and the save, where the removal then runs; else after the
    save)."""
    held = hold_drains(root, rank, world) if rank == 0 else Future()
    messages = logged("fastpersist_dist", logging.WARNING)
    plain = FastPersistSaveStrategy()
    p = _save(rank, world, root, "p", 1, None, plain)
    q = _save(rank, world, root, "q", 2, TierConfig(os.path.join(root, "local")))
    if rank == 0:
        remove_checkpoint(os.path.dirname(p))
    dist.barrier()

    def let_go() -> None:
        if rank == 0:
            held.set_exception(RuntimeError("released"))
        assert wait_copies(timeout=120)
        dist.barrier()

    if prepared:
        prepare_checkpoint_dir(p)
        let_go()
    dist_checkpointing.save(state(rank, world, 3), p, sharded_strategy=plain)
    if not prepared:
        let_go()
    want = state(rank, world, 3)
    loaded = dist_checkpointing.load({k: empty_like_request(v) for k, v in want.items()}, p,
                                     sharded_strategy=FastPersistLoadStrategy())
    return {"equal": all(torch.equal(loaded[k], v.data) for k, v in want.items()), "q": checkpoint_state(q),
            "messages": [r.getMessage() for r in messages]}


@pytest.mark.parametrize("prepared", [True, False], ids=["prepare_checkpoint_dir", "save"])
def test_a_removal_keeps_a_directory_saved_again_after_it_was_asked_for(tmp_path, prepared):
    """A checkpoint directory saved again (by ``prepare_checkpoint_dir``, or by the save itself) after its removal
    was asked for and before it ran holds the newer checkpoint: the removal keeps it, saying so, and it loads."""
    first, second = run_ranks(2, _saved_again_before_its_removal_ran, str(tmp_path), prepared)
    assert first["equal"] and second["equal"] and first["q"] == "durable", (first, second)
    p, again = tmp_path / "persistent" / "p", tmp_path / "persistent" / "p" / "weights"
    kept = [m for m in first["messages"] if m.startswith(f"fastpersist: {p} was to be removed and is kept: this "
                                                         f"process began saving into {again} after")]
    assert len(kept) == 1 and len(first["messages"]) == 1 and not second["messages"], (first, second)
