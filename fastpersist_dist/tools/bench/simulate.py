"""Checkpoint metadata at 1k to 16k ranks, by simulation: no I/O, no processes, the real planning code.

A megatron GPT layout (TE layer keys with a prepended layer axis, TP x PP x DP,
bf16 weights + fp32 main/exp_avg/exp_avg_sq, distributed optimizer on or off)
gives each rank the records it would stage. What one rank does in a save is
then run on exactly what it would see:

* ours, planned per data-parallel group (``parallel_group``): the group's shard
  lists as ``all_gather_object`` pickles them, unpickled, digested and planned
  by :class:`~fastpersist_dist.plan.PlanCache`, first and again unchanged, plus
  the world-wide agreement of (no) errors;
* ours, planned over the whole world (no group): the same for every rank's
  lists (run up to ``world_plan_max`` ranks, linear in records beyond);
* torch DCP's central planning as megatron's ``torch_dist`` uses it: every
  rank's local ``SavePlan`` (main replicas) gathered on rank 0, which runs
  ``DefaultSavePlanner``'s global planning and pickles ``.metadata`` (run up to
  ``central_max`` ranks, linear in items beyond).

The index of the resulting checkpoint is built from the groups' plans (one
group per distinct pipeline stage, for tensor rank 0 and one other: tensor
ranks 1.. are alike) and
parsed as a loading rank would. Alongside, the paged index (version 3,
``fastpersist_dist.format.index_pages``) that the engine commits: the real part files
of those groups, the real top level (pages of the groups not run are copies of
a like group's), and what one loading rank reads: the top level plus the pages
:func:`~fastpersist_dist.format.index_pages.select_pages` picks for its requests.
"""

from __future__ import annotations

import gc
import json
import math
import pickle
import time
import tracemalloc
from dataclasses import dataclass, replace
from typing import Any, Optional

from ...format.index_pages import (
    Page,
    PagedIndex,
    build_part,
    key_kinds,
    parse_page,
    parse_top,
    part_file_name,
    record_bounds,
    select_pages,
    top_level,
)
from ...format.records import CONTAINER_RAW, KIND_OBJECT, CheckpointIndex, ShardRecord, data_file_name
from ...plan.writes import PlanCache, place_in_rank_file, plan_writes
from .sim_layout import BLOCK_BYTES, Layout, MiB

def _gathered_bytes(payload_sizes: list[int], members: int) -> int:
    """Bytes one rank receives from ``all_gather_object``: sizes (int64 each), then each payload padded to the largest."""
    return members * (8 + max(payload_sizes))


def _timed(fn: Any) -> tuple[Any, float]:
    """``fn()`` and the CPU seconds it took (this process; steadier than wall time on a shared machine).

    Garbage collection is paused in this tool's own process, so that a collection of its heap is not counted.
    """
    gc.disable()
    start = time.process_time()
    try:
        return fn(), time.process_time() - start
    finally:
        gc.enable()


def _peak_mib(fn: Any) -> float:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1] / MiB
    finally:
        tracemalloc.stop()


@dataclass
class GroupRun:
    """One data-parallel group's save, as its group rank 0 sees it."""

    held: list[list[ShardRecord]]
    payloads: list[bytes]  # what each member's all_gather_object pickles on a first save
    plan: list[list[ShardRecord]]
    first_s: float
    again_s: float
    again_payloads: list[bytes]
    peak_mib: float


def run_group(layout: Layout, t: int, p: int, measure_memory: bool) -> GroupRun:
    """Exchange (pickled as on the wire) and plan within one DP group: first save, then unchanged."""
    ranks = layout.dp_group(t, p)
    held = [layout.held(t, d, p) for d in range(layout.dp)]
    payloads = [pickle.dumps((None, (PlanCache.digest(h), h))) for h in held]

    def first(cache: PlanCache) -> list[list[ShardRecord]]:
        pickle.dumps((None, cache.outgoing(0, held[0])))
        gathered = [pickle.loads(b)[1] for b in payloads]
        return cache.plan(gathered, True, ranks)

    cache = PlanCache()
    plan, first_s = _timed(lambda: first(cache))
    again_payloads = [pickle.dumps((None, cache.outgoing(i, h))) for i, h in enumerate(held)]
    _, again_s = _timed(lambda: (pickle.dumps((None, cache.outgoing(0, held[0]))),
                                 cache.plan([pickle.loads(b)[1] for b in again_payloads], True, ranks)))
    assert cache.reused, "an unchanged structure must reuse the plan"
    peak = _peak_mib(lambda: first(PlanCache())) + sum(map(len, payloads)) / MiB if measure_memory else math.nan
    return GroupRun(held, payloads, plan, first_s, again_s, again_payloads, peak)


def placed_index_records(layout: Layout, t: int, p: int, plan: list[list[ShardRecord]]) -> list[ShardRecord]:
    """The group's records as the index lists them: placed in their writers' files, with block checksums."""
    out = []
    for rank, records in zip(layout.dp_group(t, p), plan):
        for r in place_in_rank_file(records, data_file_name(rank)):
            out.append(replace(r, checksums=("0" * 16,) * max(1, -(-r.length // BLOCK_BYTES))))
    return out


def index_bytes(records: list[ShardRecord], world: int) -> bytes:
    """The JSON index (version 1) of ``records``."""
    return CheckpointIndex(world_size=world, checksum_block_bytes=BLOCK_BYTES, files=_file_sizes(records),
                           records=tuple(records)).to_json_bytes()


def world_plan_seconds(layout: Layout) -> float:
    """Today without a group: every rank unpickles every rank's lists and plans the whole world."""
    payloads = [pickle.dumps((None, (PlanCache.digest(h), h)))
                for p in range(layout.pp) for d in range(layout.dp) for t in range(layout.tp)
                for h in [layout.held(t, d, p)]]

    def plan() -> None:
        held = [pickle.loads(b)[1][1] for b in payloads]
        plan_writes(held)

    return _timed(plan)[1]


def dcp_local_plan(records: list[ShardRecord]) -> Any:
    """torch DCP's local SavePlan of a rank under megatron's torch_dist (main replicas only)."""
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    from ...format.dcp_metadata import object_fqn
    from ...format.records import dtype_from_name

    items = []
    for r in records:
        if r.kind == KIND_OBJECT:
            items.append(WriteItem(index=MetadataIndex(object_fqn(r)), type=WriteItemType.BYTE_IO))
        elif all(i == 0 for i in r.replica_id):
            offsets = torch.Size(r.global_offset)
            box = torch.Size((1,) * r.prepend_axis_num + r.local_shape)
            items.append(WriteItem(
                index=MetadataIndex(r.key, offsets), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=box),
                                            properties=TensorProperties(dtype=dtype_from_name(r.dtype)),
                                            size=torch.Size(r.global_shape)),
            ))
    return SavePlan(items)


def dcp_central(layout: Layout) -> tuple[int, float, int, int]:
    """Rank 0's part of DCP's central planning: (bytes gathered, seconds, .metadata bytes, items)."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    plans = [pickle.dumps(dcp_local_plan(layout.held(t, d, p)))
             for p in range(layout.pp) for d in range(layout.dp) for t in range(layout.tp)]

    def central() -> tuple[Any, int]:
        gathered = [pickle.loads(b) for b in plans]
        global_plan, metadata = DefaultSavePlanner(flatten_state_dict=False)._create_global_plan(gathered)
        pickle.dumps(global_plan)  # scattered back, one plan per rank
        return metadata, sum(len(plan.items) for plan in gathered)

    (metadata, items), seconds = _timed(central)
    return _gathered_bytes([len(b) for b in plans], len(plans)), seconds, len(pickle.dumps(metadata)), items


def dcp_items(layout: Layout) -> int:
    """Items of every rank's local plan (tensor ranks 1.. are alike; stages as in :func:`_stages`)."""
    count = 0
    for p, n in _stages(layout):
        for d in range(layout.dp):
            per_t = [len(dcp_local_plan(layout.held(t, d, p)).items) for t in range(min(2, layout.tp))]
            count += n * (per_t[0] + (layout.tp - 1) * per_t[-1])
    return count


def _stages(layout: Layout) -> list[tuple[int, int]]:
    """(stage, how many stages look like it): first, a middle one, last."""
    if layout.pp == 1:
        return [(0, 1)]
    return [(0, 1), (1, layout.pp - 2), (layout.pp - 1, 1)] if layout.pp > 2 else [(0, 1), (1, 1)]


def _file_sizes(records: list[ShardRecord]) -> dict[str, int]:
    files: dict[str, int] = {}
    for r in records:
        files[r.file] = max(files.get(r.file, 0), r.offset + r.length)
    return files


def paged_parts(layout: Layout, placed: dict[tuple[int, int], list[ShardRecord]],
                copies: Optional[dict[tuple[int, int], int]] = None) -> tuple[PagedIndex, dict[str, bytes]]:
    """The real part files of the groups ``placed`` ((tensor rank, stage) -> index records) and their top level.

    ``copies``: how many more groups are like each one (their pages enter the
    top level as copies under other group numbers, for its size only).
    """
    pages: list[Page] = []
    parts: dict[str, bytes] = {}
    kinds = {}
    for (t, p), records in placed.items():
        group = layout.dp_group(t, p)[0]
        data, group_pages = build_part(records, group, _file_sizes(records), CONTAINER_RAW)
        parts[part_file_name(group)] = data
        pages += group_pages
        kinds.update(key_kinds(records))
    sizes = {name: len(data) for name, data in parts.items()}
    extra = layout.world  # group numbers no rank has: the copies' part files
    for (t, p), n in (copies or {}).items():
        like = [pg for pg in pages if pg.group == layout.dp_group(t, p)[0]]
        for _ in range(n):
            pages += [replace(pg, group=extra) for pg in like]
            sizes[part_file_name(extra)] = len(parts[part_file_name(layout.dp_group(t, p)[0])])
            extra += 1
    return top_level(pages, kinds, sizes, layout.world, BLOCK_BYTES, CONTAINER_RAW), parts


def paged_index(layout: Layout) -> tuple[PagedIndex, dict[str, bytes]]:
    """Every DP group of ``layout`` planned apart and committed as its part file (small layouts: tests)."""
    placed = {}
    for p in range(layout.pp):
        for t in range(layout.tp):
            held = [layout.held(t, d, p) for d in range(layout.dp)]
            plan = PlanCache().plan([("-", h) for h in held], True, layout.dp_group(t, p))
            placed[(t, p)] = placed_index_records(layout, t, p, plan)
    return paged_parts(layout, placed)


def loader_requests(layout: Layout) -> dict[str, list]:
    """What the simulated resuming rank (tensor rank 1, DP rank 0, a middle stage) requests: what it holds."""
    wants: dict[str, list] = {}
    for r in layout.held(1 % layout.tp, 0, 1 % layout.pp):
        wants.setdefault(r.key, []).append(record_bounds(r))
    return wants


def simulate(layout: Layout, world_plan_max: int = 1024, central_max: int = 1024,
             rates: Optional[dict[str, float]] = None) -> dict[str, Any]:
    """One row of the table. ``rates`` carries seconds per item from smaller runs, for extrapolation."""
    rates = rates if rates is not None else {}
    world = layout.world
    none_agree = _gathered_bytes([len(pickle.dumps([]))], world)  # the world agrees on no failure
    groups = {(t, p): (n * (1 if t == 0 else layout.tp - 1), run_group(layout, t, p, (t, p) == (0, 0)))
              for p, n in _stages(layout) for t in range(min(2, layout.tp))}  # tensor ranks 1.. are alike
    g0 = groups[(0, 0)][1]
    row: dict[str, Any] = {
        "world": world, "tp": layout.tp, "pp": layout.pp, "dp": layout.dp, "dist_opt": layout.dist_opt,
        "records_per_rank": max(len(h) for _, g in groups.values() for h in g.held),
        "group_recv_mib": (_gathered_bytes([len(b) for b in g0.payloads], layout.dp) + none_agree) / MiB,
        "group_again_recv_kib": (_gathered_bytes([len(b) for b in g0.again_payloads], layout.dp) + none_agree) / 1024,
        "group_plan_s": max(g.first_s for _, g in groups.values()),
        "group_again_ms": 1000 * max(g.again_s for _, g in groups.values()),
        "group_peak_mib": g0.peak_mib,
    }
    payload_max = max(len(b) for _, g in groups.values() for b in g.payloads)
    row["world_recv_mib"] = _gathered_bytes([payload_max], world) / MiB
    records = world * row["records_per_rank"]
    if world <= world_plan_max:
        row["world_plan_s"] = world_plan_seconds(layout)
        rates["world_plan"] = row["world_plan_s"] / records
    row["world_plan_s_estimated"] = "world_plan" in rates and world > world_plan_max
    if row["world_plan_s_estimated"]:
        row["world_plan_s"] = rates["world_plan"] * records
    if world <= central_max:
        gathered, seconds, metadata, items = dcp_central(layout)
        rates.update(dcp_s=seconds / items, dcp_md=metadata / items, dcp_in=gathered / items)
        row.update(dcp_recv_mib=gathered / MiB, dcp_plan_s=seconds, dcp_metadata_mib=metadata / MiB)
    else:
        items = dcp_items(layout)
        row.update(dcp_recv_mib=rates["dcp_in"] * items / MiB, dcp_plan_s=rates["dcp_s"] * items,
                   dcp_metadata_mib=rates["dcp_md"] * items / MiB)
    row["dcp_estimated"] = world > central_max
    row.update(_index_columns(layout, groups))
    return row


def _index_columns(layout: Layout, groups: dict[tuple[int, int], tuple[int, GroupRun]]) -> dict[str, Any]:
    """The JSON index (total, parse per loading rank) and the parts design (what a loading rank reads)."""
    placed = {g: placed_index_records(layout, *g, run.plan) for g, (_, run) in groups.items()}
    sizes = {g: len(index_bytes(recs, layout.world)) for g, recs in placed.items()}
    total = sum(n * sizes[g] for g, (n, _) in groups.items())
    total_records = sum(n * len(placed[g]) for g, (n, _) in groups.items())
    middle = (0, 1 % layout.pp)
    data = index_bytes(placed[middle], layout.world)
    _, parse_s = _timed(lambda: CheckpointIndex.from_json_bytes(data, "simulated index"))
    # The paged index: real part files of the groups run, a top level for the whole world.
    copies = {g: n - 1 for g, (n, _) in groups.items()}
    whole_top, parts = paged_parts(layout, placed, copies)
    top_data = whole_top.to_json_bytes()
    paged_total = len(top_data) + sum(n * len(parts[part_file_name(layout.dp_group(*g)[0])])
                                      for g, (n, _) in groups.items())
    run_top, _ = paged_parts(layout, placed)  # selection among real pages only: copies' boxes are not theirs
    chosen = select_pages(run_top, loader_requests(layout))
    read = [(pg, parts[pg.part_file][pg.offset : pg.offset + pg.length]) for pg in chosen]

    def parse() -> None:
        parse_top(json.loads(top_data), "simulated top level")
        for pg, data in read:
            parse_page(run_top, pg, data, "simulated page")

    _, part_parse_s = _timed(parse)
    read_bytes = len(top_data) + sum(pg.length for pg in chosen)
    return {
        "index_mib": total / MiB, "index_records": total_records,
        "index_parse_s": parse_s * total / len(data),
        "paged_mib": paged_total / MiB, "parts_top_mib": len(top_data) / MiB, "parts_read_mib": read_bytes / MiB,
        "parts_pages_read": len(chosen), "parts_read_pct": 100 * read_bytes / paged_total,
        "parts_parse_s": part_parse_s,
    }


COLUMNS = [
    ("world", "ranks", "{}"), ("dp", "DP", "{}"), ("dist_opt", "dist. opt.", "{}"),
    ("records_per_rank", "records/rank", "{}"),
    ("group_recv_mib", "group: MiB in/rank, 1st save", "{:.2f}"),
    ("group_plan_s", "group: plan s, 1st", "{:.3f}"),
    ("group_again_recv_kib", "group: KiB in/rank, unchanged", "{:.0f}"),
    ("group_again_ms", "group: plan ms, unchanged", "{:.1f}"),
    ("group_peak_mib", "group: peak MiB", "{:.0f}"),
    ("world_recv_mib", "world: MiB in/rank", "{:.0f}"),
    ("world_plan_s", "world: plan s", "{:.1f}"),
    ("dcp_recv_mib", "DCP: MiB into rank 0", "{:.0f}"),
    ("dcp_plan_s", "DCP: rank-0 plan s", "{:.1f}"),
    ("dcp_metadata_mib", "DCP: .metadata MiB", "{:.0f}"),
    ("index_mib", "JSON index MiB", "{:.0f}"),
    ("index_parse_s", "index parse s/rank", "{:.1f}"),
    ("paged_mib", "v3 index MiB", "{:.0f}"),
    ("parts_top_mib", "v3 top level MiB", "{:.2f}"),
    ("parts_read_mib", "v3: MiB read/rank", "{:.2f}"),
    ("parts_read_pct", "v3: % of index read", "{:.2f}"),
    ("parts_parse_s", "v3: parse s/rank", "{:.2f}"),
]
ESTIMATED = {"world_plan_s": "world_plan_s_estimated", "dcp_recv_mib": "dcp_estimated",
             "dcp_plan_s": "dcp_estimated", "dcp_metadata_mib": "dcp_estimated"}


def format_table(rows: list[dict[str, Any]]) -> str:
    """A markdown table; ``~`` marks figures extrapolated linearly from the largest run that was measured."""
    lines = ["| " + " | ".join(title for _, title, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        cells = []
        for key, _, fmt in COLUMNS:
            value = row.get(key)
            text = "n/a" if value is None else fmt.format("on" if value is True else "off" if value is False else value)
            cells.append(("~" if row.get(ESTIMATED.get(key, ""), False) else "") + text)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(dps: list[int], dist_opts: list[bool], world_plan_max: int, central_max: int, **shape: int) -> list[dict]:
    """Every (distributed optimizer, DP) row, smallest first so larger ones can be extrapolated."""
    rows = []
    for dist_opt in dist_opts:
        rates: dict[str, float] = {}
        for dp in sorted(dps):
            rows.append(simulate(Layout(dp=dp, dist_opt=dist_opt, **shape), world_plan_max, central_max, rates))
    return rows
