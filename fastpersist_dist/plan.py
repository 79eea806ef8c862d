"""Planning: where in which file each record's bytes go. Pure: no I/O, no collectives."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional

import numpy as np

from .format import ShardRecord, data_file_name


def place_in_rank_file(records: list[ShardRecord], rank: int) -> list[ShardRecord]:
    """Lay ``records`` back to back, in order, in ``rank``'s data file."""
    placed, offset = [], 0
    name = data_file_name(rank)
    for r in records:
        placed.append(replace(r, file=name, offset=offset))
        offset += r.length
    return placed


def shard_box(r: ShardRecord) -> tuple[int, ...]:
    """Shape of the global-tensor box a tensor record covers (prepended axes are 1)."""
    return (1,) * r.prepend_axis_num + r.local_shape


def coverage_errors(records: list[ShardRecord]) -> list[str]:
    """Problems with how all ranks' main replicas cover each global tensor.

    Megatron checks regular grids itself but defers uneven shardings to the
    backend: here every tensor must be covered exactly once (volumes add up and
    no two shards overlap) and every object shard must be unique.
    """
    errors: list[str] = []
    tensors: dict[str, list[ShardRecord]] = {}
    objects: set[tuple[str, tuple[int, ...]]] = set()
    for r in records:
        if r.kind == "object":
            if (r.key, r.global_offset) in objects:
                errors.append(f"object '{r.key}' shard {r.global_offset} is saved by more than one rank")
            objects.add((r.key, r.global_offset))
        else:
            tensors.setdefault(r.key, []).append(r)
    for key, group in tensors.items():
        shapes = {r.global_shape for r in group}
        if len(shapes) > 1:
            errors.append(f"tensor '{key}': ranks disagree on the global shape: {sorted(shapes)}")
            continue
        total = math.prod(group[0].global_shape)
        have = sum(math.prod(shard_box(r)) for r in group)
        lo = np.array([r.global_offset for r in group], dtype=np.int64).reshape(len(group), -1)
        hi = lo + np.array([shard_box(r) for r in group], dtype=np.int64).reshape(len(group), -1)
        pair = _first_overlap(lo, hi)
        if pair is not None:
            i, j = pair
            errors.append(
                f"tensor '{key}': shards at {group[i].global_offset} and {group[j].global_offset} overlap "
                "(each element must have exactly one main replica)"
            )
        elif have != total:
            errors.append(f"tensor '{key}': main replicas cover {have} of {total} elements (shards missing)")
    return errors


def _first_overlap(lo: np.ndarray, hi: np.ndarray, rows: int = 256) -> Optional[tuple[int, int]]:
    """First pair (i, j), i != j, of boxes [lo, hi) that share an element; rows chunked to bound memory."""
    for start in range(0, len(lo), rows):
        a_lo, a_hi = lo[start : start + rows, None], hi[start : start + rows, None]
        hit = np.all(np.minimum(a_hi, hi[None]) > np.maximum(a_lo, lo[None]), axis=-1)
        idx = np.arange(len(hit))
        hit[idx, idx + start] = False
        if hit.any():
            i, j = np.argwhere(hit)[0]
            return int(i) + start, int(j)
    return None
