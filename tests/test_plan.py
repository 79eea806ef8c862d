"""The write planner on GPT-shaped layouts: pure, metadata only (no tensors, no I/O)."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from fastpersist_dist.format.coverage import coverage_errors
from fastpersist_dist.format.records import KIND_OBJECT, KIND_TENSOR, ShardRecord
from fastpersist_dist.plan.writes import WHOLE_SHARD_SLACK, PlanCache, PlanError, plan_writes
from fastpersist_dist.tools.bench.gpt_state import GptShape

pytestmark = pytest.mark.engine

ITEMSIZE = {"bfloat16": 2, "float32": 4}


def tensor(key: str, glob: tuple, local: tuple, offset: tuple, dtype: str, replica) -> ShardRecord:
    return ShardRecord(
        key=key, kind=KIND_TENSOR, dtype=dtype, local_shape=local, global_shape=glob, global_offset=offset,
        axis_fragmentations=None, prepend_axis_num=0, flattened_range=None, replica_id=replica, file="", offset=0,
        length=math.prod(local) * ITEMSIZE[dtype],
    )


def obj(key: str, length: int) -> ShardRecord:
    return ShardRecord(
        key=key, kind=KIND_OBJECT, dtype=None, local_shape=(), global_shape=(1,), global_offset=(0,),
        axis_fragmentations=None, prepend_axis_num=0, flattened_range=None, replica_id=0, file="", offset=0,
        length=length,
    )


def gpt_layout(tp: int, dp: int, hidden: int = 2048, dist_opt: bool = False, extras: bool = True) -> list[list[ShardRecord]]:
    """What each of tp*dp ranks holds: TP over consecutive ranks, DP over the rest (like bench.gpt_state).

    bf16 weights and fp32 main/exp_avg/exp_avg_sq per parameter; with ``dist_opt`` the fp32 states
    are split over DP (a distributed optimizer) instead of replicated. ``extras``: one huge
    replicated tensor, 500 tiny replicated ones and a few objects held by one rank each.
    """
    shape = GptShape(hidden=hidden, layers=4, vocab=8 * hidden)
    held: list[list[ShardRecord]] = [[] for _ in range(tp * dp)]
    for rank in range(tp * dp):
        t, d = rank % tp, rank // tp
        for name, (glob, axis) in shape.params().items():
            for kind, dtype in (("model", "bfloat16"), ("main", "float32"), ("exp_avg", "float32"), ("exp_avg_sq", "float32")):
                key = f"{kind}.{name}"
                if axis is None:
                    held[rank].append(tensor(key, glob, glob, (0,) * len(glob), dtype, (t, d)))
                    continue
                local = list(glob)
                local[axis] //= tp
                offset = [0] * len(glob)
                offset[axis] = t * local[axis]
                if dist_opt and kind != "model" and local[0] % dp == 0:  # DP-sharded optimizer state, no replicas
                    local[0] //= dp
                    offset[0] += d * local[0]
                    held[rank].append(tensor(key, glob, tuple(local), tuple(offset), dtype, 0))
                else:
                    held[rank].append(tensor(key, glob, tuple(local), tuple(offset), dtype, d))
        if extras:
            held[rank].append(tensor("huge", (1 << 28,), (1 << 28,), (0,), "float32", rank))
            held[rank].extend(tensor(f"tiny.{i}", (17,), (17,), (0,), "float32", rank) for i in range(500))
            if rank < 3:
                held[rank].append(obj(f"rng_state.{rank}", 1000 + rank))
    return held


def check_plan(held: list[list[ShardRecord]], plan: list[list[ShardRecord]]) -> float:
    """Every byte written exactly once, each by a rank holding it; returns max/mean bytes per rank."""
    assert coverage_errors([r for records in plan for r in records]) == []
    holds = [{(r.kind, r.key, r.global_offset) for r in records} for records in held]
    for rank, records in enumerate(plan):
        for r in records:
            assert (r.kind, r.key, r.global_offset) in holds[rank], f"rank {rank} writes {r.key} it does not hold"
    per_rank = [sum(r.length for r in records) for records in plan]
    return max(per_rank) / (sum(per_rank) / len(per_rank))


@pytest.mark.parametrize("tp,dp,dist_opt", [(1, 2, False), (2, 2, False), (2, 4, False), (2, 4, True), (1, 8, False),
                                             (4, 2, True), (8, 1, False)])
def test_balanced_gpt_layouts(tp, dp, dist_opt):
    held = gpt_layout(tp, dp, dist_opt=dist_opt)
    imbalance = check_plan(held, plan_writes(held))
    if dp > 1:
        assert imbalance <= 1.05, imbalance
    unbalanced = check_plan(held, plan_writes(held, balance=False))
    assert imbalance <= unbalanced


def test_without_balance_main_replicas_write_whole_shards():
    held = gpt_layout(2, 2)
    plan = plan_writes(held, balance=False)
    main = [[r for r in records if r.replica_id in (0, (0, 0)) or r.kind == KIND_OBJECT] for records in held]
    assert [sorted(r.key for r in records) for records in plan] == [sorted(r.key for r in records) for records in main]
    assert all(r.flattened_range is None for records in plan for r in records)


def test_large_replicated_shards_are_split_into_element_ranges():
    held = gpt_layout(1, 4, hidden=256)  # the 1 GiB "huge" tensor dominates: whole shards cannot balance
    plan = plan_writes(held)
    huge = sorted((r.flattened_range, rank) for rank, records in enumerate(plan) for r in records if r.key == "huge")
    assert [rank for _, rank in huge] == [0, 1, 2, 3]  # the largest shard comes first: four equal quarters
    assert [fr for fr, _ in huge] == [(i << 26, (i + 1) << 26) for i in range(4)]
    assert all(r.flattened_range is None for records in plan for r in records if r.key.startswith("tiny."))


def test_whole_shards_are_kept_when_they_balance():
    held = gpt_layout(1, 4)  # many large tensors: whole-shard placement is within WHOLE_SHARD_SLACK
    plan = plan_writes(held)
    assert check_plan(held, plan) <= WHOLE_SHARD_SLACK
    assert all(r.flattened_range is None for records in plan for r in records)


def test_no_replicas_means_no_choice():
    held = [[r for r in records if r.replica_id in (0, (0, 0))] for records in gpt_layout(4, 1, extras=False)]
    assert plan_writes(held) == plan_writes(held, balance=False)


def test_plan_is_deterministic_and_independent_of_input_order():
    held = gpt_layout(2, 4, hidden=1024)
    shuffled = [random.Random(rank).sample(records, len(records)) for rank, records in enumerate(held)]
    assert plan_writes(held) == plan_writes(held) == plan_writes(shuffled)


def test_inconsistent_replicas_and_double_main_are_refused():
    a = tensor("w", (8, 8), (8, 8), (0, 0), "float32", 0)
    b = tensor("w", (8, 8), (8, 8), (0, 0), "float32", 1)
    with pytest.raises(PlanError, match="'w'.*rank 0 and on rank 1"):
        plan_writes([[a], [a]])
    with pytest.raises(PlanError, match="rank 0 and rank 1 hold replicas that disagree"):
        plan_writes([[a], [tensor("w", (8, 8), (8, 8), (0, 0), "bfloat16", 1)]])
    assert plan_writes([[a], [b]])[0] == [a]


def test_plan_cache_sends_records_only_when_they_change():
    held = gpt_layout(2, 2, hidden=512, extras=False)
    caches = [PlanCache() for _ in held]

    def save(layout: list[list[ShardRecord]]) -> list[list[list[ShardRecord]]]:
        outgoing = [cache.outgoing(rank, layout[rank]) for rank, cache in enumerate(caches)]
        return [cache.plan(outgoing, balance=True) for cache in caches], outgoing

    first, sent = save(held)
    assert all(records is not None for _, records in sent) and not caches[0].reused
    again, sent = save(held)
    assert again == first and all(records is None for _, records in sent) and all(c.reused for c in caches)
    changed = [list(records) for records in held]
    changed[3].append(tensor("extra", (4,), (4,), (0,), "float32", 0))
    third, sent = save(changed)
    assert [records is None for _, records in sent] == [True, True, True, False]
    assert all(plan == plan_writes(changed) for plan in third)
    with pytest.raises(PlanError, match="does not know its digest"):
        PlanCache().plan([("abc", None)], balance=True)


def test_plan_cache_predicts_a_rank_s_share_only_while_its_own_structure_and_balance_stay():
    held = gpt_layout(2, 2, hidden=512, extras=False)
    cache = PlanCache()
    assert cache.predicted(0, PlanCache.digest(held[0]), balance=True) is None  # nothing planned yet
    plan = cache.plan([cache.outgoing(rank, records) for rank, records in enumerate(held)], balance=True)
    assert cache.predicted(0, PlanCache.digest(held[0]), balance=True) == plan[0]
    assert cache.predicted(0, PlanCache.digest(held[0]), balance=False) is None
    grown = held[0] + [tensor("extra", (4,), (4,), (0,), "float32", 0)]
    assert cache.predicted(0, PlanCache.digest(grown), balance=True) is None
    # Another rank's change is invisible to the prediction: only the plan over gathered data decides.
    changed = [list(records) for records in held]
    changed[3].append(tensor("extra", (1 << 24,), (1 << 24,), (0,), "float32", 0))
    assert cache.predicted(0, PlanCache.digest(changed[0]), balance=True) == plan[0]
    replanned = cache.plan([cache.outgoing(rank, records) for rank, records in enumerate(changed)], balance=True)
    assert replanned[0] != plan[0] and not cache.reused


def test_plan_cache_refuses_gaps():
    w = tensor("w", (8, 8), (4, 8), (0, 0), "float32", 0)
    with pytest.raises(PlanError, match="cover 32 of 64"):
        PlanCache().plan([("d", [w])], balance=True)


@pytest.mark.parametrize("tp,dp,dist_opt", [(2, 4, False), (4, 2, True)])
def test_dp_groups_planned_apart_cover_everything_once(tp, dp, dist_opt):
    held = gpt_layout(tp, dp, dist_opt=dist_opt)
    plan: list[list[ShardRecord]] = [[] for _ in held]
    for t in range(tp):  # each DP group sees only its own ranks' shard lists
        ranks = [t + tp * d for d in range(dp)]
        group_plan = PlanCache().plan([("-", held[r]) for r in ranks], balance=True, ranks=ranks)
        for r, records in zip(ranks, group_plan):
            plan[r] = records
        per_rank = [sum(r.length for r in records) for records in group_plan]
        assert max(per_rank) <= 1.05 * sum(per_rank) / dp, (t, per_rank)
    assert coverage_errors([r for records in plan for r in records]) == []
    for rank, records in enumerate(plan):  # nobody writes what it does not hold
        holds = {(r.key, r.global_offset) for r in held[rank]}
        assert all((r.key, r.global_offset) in holds for r in records)


def test_group_leaves_shards_of_other_groups_alone():
    main = tensor("ln", (8,), (8,), (0,), "float32", (0, 0))
    copy = tensor("ln", (8,), (8,), (0,), "float32", (1, 0))
    empty_main = replace(tensor("e", (0, 4), (0, 4), (0, 0), "float32", 0), length=0)
    empty_copy = replace(empty_main, replica_id=1)
    assert plan_writes([[main, empty_main], [copy, empty_copy]], ranks=[0, 2]) == [[main], [empty_copy]]
    assert plan_writes([[copy, empty_copy], [copy, empty_copy]], ranks=[1, 3]) == [[], []]  # main is elsewhere
    assert plan_writes([[empty_copy], [empty_copy]]) == [[empty_copy], []]  # the whole world: someone writes it
    with pytest.raises(PlanError, match="on rank 1 and on rank 3"):
        plan_writes([[main], [main]], ranks=[1, 3])
