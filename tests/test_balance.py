"""Data-parallel writes on real ranks: TP=2 x DP=2, replicated shards split over their holders, any-sharding loads."""

from __future__ import annotations

import json
import os

import pytest
import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.core import CheckpointingException

from fastpersist_dist import FastPersistSaveStrategy
from fastpersist_dist.engine.async_queue import AsyncSaveQueue
from fastpersist_dist.engine.index_reader import read_index
from fastpersist_dist.format.index_pages import PART_FILE_RE, part_file_name
from fastpersist_dist.format.records import INDEX_FILE, data_file_name
from fastpersist_dist.tools.ranks import run_ranks
from fastpersist_dist.tools.verify import verify_checkpoint

from .helpers import (
    ASYNC_KW,
    assert_same,
    load,
    make_dir,
    native_strategy,
    save,
    sharded,
)
from .states import DP, SHAPES, TP, check_loaded, dp_group, full, template, tp_dp_state

pytestmark = pytest.mark.contract


def _save_twice_and_load(rank: int, world: int, root: str) -> list:
    strategy = native_strategy()
    save(tp_dp_state(rank, 0), f"{root}/a", strategy)
    first_reused = strategy.plan_reused
    save(tp_dp_state(rank, 1), f"{root}/b", strategy)  # same structure, new values: the plan is reused
    check_loaded(load(template(tp_dp_state(rank, 1)), f"{root}/b"), rank, 1)
    check_loaded(load(template(tp_dp_state(rank, 0)), f"{root}/a"), rank, 0)
    return [first_reused, strategy.plan_reused]


def _load_other_sharding(rank: int, world: int, root: str) -> None:
    """2 ranks: every tensor split on its last axis, or whole (replicated) where it is 1-D."""
    want = {}
    for key in SHAPES:
        g = full(key, 1)
        want[key] = sharded(key, g, rank, world, g.dim() - 1) if g.dim() > 1 else sharded(key, g, rank, world, None)
    loaded = load(template(want), f"{root}/b")
    for key, sh in want.items():
        assert_same(loaded[key], sh.data, f"resharded '{key}'")
    objects = {f"tp_obj{t}": ShardedObject("tp_obj", None, (TP,), (t,), replica_id=rank) for t in range(TP)}
    loaded = load(objects, f"{root}/b")
    assert [loaded[f"tp_obj{t}"] for t in range(TP)] == [{"tp": t, "step": 1} for t in range(TP)]


def test_tp2_dp2_every_rank_writes_its_share_and_loads_reshard(tmp_path):
    root = str(tmp_path)
    reused = run_ranks(TP * DP, _save_twice_and_load, root)
    assert reused == [[False, True]] * (TP * DP)
    index = read_index(os.path.join(root, "b"), "test")
    sizes = [index.files[data_file_name(r)] for r in range(TP * DP)]
    assert max(sizes) / (sum(sizes) / len(sizes)) <= 1.10, sizes  # 1 MiB split granularity on 11 MiB per rank
    writers = {}
    for r in index.records:
        writers.setdefault(r.key, set()).add(r.file)
        if r.key == "rank_obj":
            assert r.file == data_file_name(r.global_offset[0])
    assert len(writers["huge"]) == TP * DP  # replicated on all four ranks: all four write a piece
    assert len(writers["emb"]) == DP * TP and len(writers["uneven"]) >= DP
    assert any(r.flattened_range for r in index.records if r.key == "uneven")
    report = verify_checkpoint(os.path.join(root, "b"))
    assert report.ok, report.problems
    run_ranks(2, _load_other_sharding, root)
    run_ranks(1, _load_other_sharding, root)


def _unbalanced(rank: int, world: int, root: str) -> None:
    save(tp_dp_state(rank), root, native_strategy(balance=False))
    check_loaded(load(template(tp_dp_state(rank)), root), rank, 0)


def test_without_balance_only_main_replicas_write(tmp_path):
    path = str(tmp_path / "c")
    run_ranks(TP * DP, _unbalanced, path)
    records = read_index(path, "test").records
    assert all(r.flattened_range is None for r in records)
    second_dp_rank = {data_file_name(r) for r in range(TP, TP * DP)}
    assert {r.key for r in records if r.file in second_dp_rank} == {"rank_obj"}  # nothing replicated


def _async_balanced(rank: int, world: int, path: str) -> None:
    sd = tp_dp_state(rank, 2)
    queue = AsyncSaveQueue()
    make_dir(path)
    queue.schedule(dist_checkpointing.save(sd, path, sharded_strategy=native_strategy(),
                                           async_sharded_save=True, **ASYNC_KW))
    for sh in sd.values():  # training goes on: the snapshot holds the pieces as they were
        if isinstance(sh, ShardedTensor):
            sh.data.add_(1)
    assert queue.maybe_finalize(blocking=True) == [1]
    check_loaded(load(template(tp_dp_state(rank, 2)), path), rank, 2)


def test_async_save_snapshots_only_this_ranks_pieces(tmp_path):
    path = str(tmp_path / "d")
    run_ranks(TP * DP, _async_balanced, path)
    assert verify_checkpoint(path).ok


def _save_in_dp_groups(rank: int, world: int, root: str, checkpoint_format: str) -> bool:
    strategy = FastPersistSaveStrategy(checkpoint_format, parallel_group=dp_group(rank))
    save(tp_dp_state(rank, 0), f"{root}/a", strategy)
    save(tp_dp_state(rank, 1), f"{root}/b", strategy)
    check_loaded(load(template(tp_dp_state(rank, 1)), f"{root}/b"), rank, 1)
    return strategy.plan_reused


@pytest.mark.parametrize("checkpoint_format", ["fastpersist", "torch_dist"])
def test_dp_groups_are_planned_apart(tmp_path, checkpoint_format):
    """TP=2 x DP=2 with parallel_group = the DP group: ranks {0, 2} and {1, 3} exchange and plan apart."""
    root = str(tmp_path)
    assert run_ranks(TP * DP, _save_in_dp_groups, root, checkpoint_format) == [True] * (TP * DP)
    path = os.path.join(root, "b")
    index = read_index(path, "test")
    writer = {data_file_name(r, index.container): r for r in range(TP * DP)}
    groups_writing: dict = {}
    for r in index.records:
        groups_writing.setdefault((r.key, r.global_offset), set()).add(writer[r.file] % TP)
    assert all(len(g) == 1 for g in groups_writing.values()), groups_writing  # a shard is planned in one group
    for key in ("qkv", "proj", "emb", "uneven"):  # each group writes its own tensor-parallel slice
        assert set().union(*(g for (k, _), g in groups_writing.items() if k == key)) == {0, 1}, key
    assert groups_writing[("huge", (0,))] == groups_writing[("ln", (0,))] == {0}  # main replica on rank 0
    huge_writers = {writer[r.file] for r in index.records if r.key == "huge"}
    assert huge_writers == {0, 2}  # split over the DP group of its main replica, not over the world
    sizes = [index.files.get(data_file_name(r, index.container), 0) for r in range(TP * DP)]
    parts = sorted(n for n in os.listdir(path) if PART_FILE_RE.match(n))
    assert parts == [part_file_name(0), part_file_name(1)]  # one index part per DP group, by its first rank
    with open(os.path.join(path, INDEX_FILE), "rb") as f:
        top = json.load(f)["body"]
    for t, name in enumerate(parts):  # each group's pages make up its part file
        assert top["format_version"] == 3 and name in top["parts"]
        group_pages = [p for e in top["keys"].values() for p in e["pages"] if p[0] == t]
        assert group_pages and sum(p[4] for p in group_pages) == os.path.getsize(os.path.join(path, name))
    for t in range(TP):  # balanced within each group (1 MiB split granularity)
        group = sizes[t::TP]
        assert max(group) / (sum(group) / len(group)) <= 1.10, sizes
    report = verify_checkpoint(path)
    assert report.ok, report.problems
    run_ranks(2, _load_other_sharding, root)


def _group_failure(rank: int, world: int, path: str, kind: str) -> str:
    sd = tp_dp_state(rank)
    if kind == "stage" and rank == 3:
        sd["bad"] = ShardedTensor.from_rank_offsets("bad", torch.zeros(2), replica_id=(0, 1))
        sd["bad"].data = [1.0, 2.0]
    elif kind == "plan" and rank % TP == 1:  # both DP ranks of group {1, 3} claim the main replica
        sd["bad"] = ShardedTensor.from_rank_offsets("twice", torch.zeros(2), replica_id=0)
    strategy = FastPersistSaveStrategy("fastpersist", parallel_group=dp_group(rank))
    with pytest.raises(CheckpointingException) as info:
        save(sd, path, strategy, validate=False)
    return str(info.value)


@pytest.mark.parametrize("kind,needle", [
    ("stage", "rank 3: ShardedTensor 'bad' holds list"),
    ("plan", "'twice' at global offset (0,) is a main replica (replica_id 0) on rank 1 and on rank 3"),
])
def test_a_groups_failure_fails_every_group(tmp_path, kind, needle):
    """Group {0, 2} has nothing wrong, yet raises the error of group {1, 3} before anything is written."""
    path = str(tmp_path / "ckpt")
    for message in run_ranks(TP * DP, _group_failure, path, kind):
        assert needle in message and "nothing was written" in message, message
    assert not any(n.startswith(("fastpersist", ".fastpersist")) for n in os.listdir(path))
