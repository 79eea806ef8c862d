"""Does a set of records hold every element of every global tensor exactly once? Pure.

Used on the write plan before anything is written (all ranks' records) and by
``verify`` on a committed index. A shard may be stored whole or as pieces
(``flattened_range``) written by several ranks; the pieces of one shard must
tile its elements exactly, and then count as the whole shard.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from .layout import Extent, flat_range_to_boxes
from .records import KIND_OBJECT, ShardRecord, itemsize


def shard_box(r: ShardRecord) -> tuple[int, ...]:
    """Shape of the global-tensor box a tensor record's shard covers (prepended axes are 1)."""
    return (1,) * r.prepend_axis_num + r.local_shape


def record_extents(record: ShardRecord) -> list[Extent]:
    """The contiguous boxes (global coordinates) a tensor record holds; byte starts count from its elements."""
    box = shard_box(record)
    if record.flattened_range is None:
        return [Extent(record.global_offset, box, 0)]
    size = itemsize(record.dtype)
    start, stop = record.flattened_range
    return [
        Extent(tuple(g + o for g, o in zip(record.global_offset, off)), shape, (fs - start) * size)
        for off, shape, fs in flat_range_to_boxes(box, start, stop)
    ]


def _piece_errors(key: str, pieces: list[ShardRecord]) -> list[str]:
    """Pieces of one shard must tile 0..numel of its local shape, without gaps or overlaps."""
    numel = math.prod(pieces[0].local_shape)
    at = 0
    for p in sorted(pieces, key=lambda p: p.flattened_range or (0, numel)):
        start, stop = p.flattened_range or (0, numel)
        if start != at:
            what = "overlap" if start < at else "leave a gap"
            return [f"tensor '{key}': pieces of the shard at {p.global_offset} {what} at element {min(start, at)}"]
        at = stop
    if at != numel:
        return [f"tensor '{key}': pieces of the shard at {pieces[0].global_offset} end at element {at} of {numel}"]
    return []


def coverage_errors(records: list[ShardRecord], complete: bool = True) -> list[str]:
    """Problems with how ``records`` cover each global tensor; empty when every element is stored once.

    Megatron checks regular grids itself but defers uneven shardings to the
    backend: here every tensor must be covered exactly once (volumes add up and
    no two shards overlap) and every object shard must be unique. Without
    ``complete`` (one group's part of a plan) only overlaps and gaps between pieces count.
    """
    errors: list[str] = []
    shards: dict[str, dict[tuple, list[ShardRecord]]] = {}
    objects: set[tuple[str, tuple[int, ...]]] = set()
    for i, r in enumerate(records):
        if r.kind == KIND_OBJECT:
            if (r.key, r.global_offset) in objects:
                errors.append(f"object '{r.key}' shard {r.global_offset} is saved by more than one rank")
            objects.add((r.key, r.global_offset))
        else:  # a whole shard is a group of its own; the pieces of one shard form one group
            shard = (r.global_offset, r.local_shape, i if r.flattened_range is None else "pieces")
            shards.setdefault(r.key, {}).setdefault(shard, []).append(r)
    for key, by_shard in shards.items():
        group = []
        for pieces in by_shard.values():
            if len(pieces) > 1 or pieces[0].flattened_range is not None:
                errors.extend(_piece_errors(key, pieces))
            group.append(pieces[0])
        errors.extend(_box_errors(key, group, complete))
    return errors


def _box_errors(key: str, group: list[ShardRecord], complete: bool) -> list[str]:
    shapes = {r.global_shape for r in group}
    if len(shapes) > 1:
        return [f"tensor '{key}': ranks disagree on the global shape: {sorted(shapes)}"]
    total = math.prod(group[0].global_shape)
    have = sum(math.prod(shard_box(r)) for r in group)
    lo = np.array([r.global_offset for r in group], dtype=np.int64).reshape(len(group), -1)
    hi = lo + np.array([shard_box(r) for r in group], dtype=np.int64).reshape(len(group), -1)
    pair = _first_overlap(lo, hi)
    if pair is not None:
        i, j = pair
        return [
            f"tensor '{key}': shards at {group[i].global_offset} and {group[j].global_offset} overlap "
            "(each element must have exactly one main replica)"
        ]
    if complete and have != total:
        return [f"tensor '{key}': main replicas cover {have} of {total} elements (shards missing)"]
    return []


def _first_overlap(lo: np.ndarray, hi: np.ndarray, rows: int = 256) -> Optional[tuple[int, int]]:
    """First pair (i, j), i != j, of boxes [lo, hi) that share an element.

    A sweep along the axis where the most boxes fit side by side (their spread
    over their mean extent): after sorting by their start there, a box can only
    meet those that start before it ends, so only those pairs are compared
    (rows boxes at a time, to bound memory).
    """
    n = len(lo)
    if n < 2:
        return None
    axis = int(np.argmax((hi.max(axis=0) - lo.min(axis=0)) / np.maximum((hi - lo).mean(axis=0), 1)))
    order = np.argsort(lo[:, axis], kind="stable")
    lo, hi = lo[order], hi[order]
    ends = np.searchsorted(lo[:, axis], hi[:, axis], side="left")  # boxes after i start before i ends
    counts = np.maximum(ends - np.arange(n) - 1, 0)
    for start in range(0, n, rows):
        c = counts[start : start + rows]
        if not c.any():
            continue
        first = np.repeat(np.arange(start, start + len(c)), c)
        second = first + 1 + np.arange(len(first)) - np.repeat(np.cumsum(c) - c, c)
        hit = np.all(np.minimum(hi[first], hi[second]) > np.maximum(lo[first], lo[second]), axis=-1)
        if hit.any():
            k = int(np.argmax(hit))
            return int(order[first[k]]), int(order[second[k]])
    return None
