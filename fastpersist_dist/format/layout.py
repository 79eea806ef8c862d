"""Pure geometry of shards: boxes in a global tensor and the byte runs that hold them.

A shard is a box (offset, shape) of its global tensor, stored in C order. A
record with a flattened range holds a contiguous slice of that C order, which
:func:`flat_range_to_boxes` turns into a few boxes, each contiguous on disk. A
reader asks which element runs of a stored box hold a wanted sub-box
(:func:`contiguous_runs`) and merges nearby runs into few reads
(:func:`coalesce`). No I/O and no torch here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Extent:
    """A box of a global tensor whose elements lie contiguously, in C order, from ``byte_start``.

    ``byte_start`` counts from the beginning of the owning record.
    """

    offset: Shape
    shape: Shape
    byte_start: int


def c_strides(shape: Shape) -> Shape:
    """Element strides of a C-contiguous array of ``shape``."""
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


def intersect(a_off: Shape, a_shape: Shape, b_off: Shape, b_shape: Shape) -> Optional[tuple[Shape, Shape]]:
    """Intersection of two boxes as (offset, shape), or None when it holds no element."""
    off, shape = [], []
    for ao, an, bo, bn in zip(a_off, a_shape, b_off, b_shape):
        lo, hi = max(ao, bo), min(ao + an, bo + bn)
        if hi <= lo:
            return None
        off.append(lo)
        shape.append(hi - lo)
    return tuple(off), tuple(shape)


def flat_range_to_boxes(shape: Shape, start: int, stop: int) -> list[tuple[Shape, Shape, int]]:
    """Split elements [start, stop) of the C-order flattening of ``shape`` into boxes.

    Returns (offset, box_shape, flat_start) triples; each box is contiguous in
    C order and starts at element ``flat_start``. At most 2 * ndim boxes.
    """
    if start >= stop:
        return []
    if not shape:
        return [((), (), 0)]
    inner = math.prod(shape[1:])
    first, last = start // inner, (stop - 1) // inner
    out: list[tuple[Shape, Shape, int]] = []

    def sub(row: int, lo: int, hi: int) -> None:
        for off, box, fs in flat_range_to_boxes(shape[1:], lo, hi):
            out.append(((row, *off), (1, *box), row * inner + fs))

    if first == last:
        sub(first, start - first * inner, stop - first * inner)
        return out
    head_full = start % inner == 0
    if not head_full:
        sub(first, start - first * inner, inner)
    body_lo = first if head_full else first + 1
    tail_full = stop % inner == 0
    body_hi = last + 1 if tail_full else last
    if body_hi > body_lo:
        out.append(((body_lo, *(0,) * (len(shape) - 1)), (body_hi - body_lo, *shape[1:]), body_lo * inner))
    if not tail_full:
        sub(last, 0, stop - last * inner)
    return out


def contiguous_runs(shape: Shape, sub_off: Shape, sub_shape: Shape) -> tuple[np.ndarray, int]:
    """Element runs of a C-order array of ``shape`` that hold the sub-box.

    Returns (starts, run_length): the sub-box is ``len(starts)`` runs of
    ``run_length`` elements each, in increasing order.
    """
    ndim = len(shape)
    if ndim == 0:
        return np.zeros(1, dtype=np.int64), 1
    strides = c_strides(shape)
    # Trailing axes the sub-box spans completely fold into one run.
    p = ndim - 1
    while p > 0 and sub_off[p] == 0 and sub_shape[p] == shape[p]:
        p -= 1
    run = sub_shape[p] * strides[p]
    starts = np.array([sub_off[p] * strides[p]], dtype=np.int64)
    for axis in range(p - 1, -1, -1):
        steps = (np.arange(sub_shape[axis], dtype=np.int64) + sub_off[axis]) * strides[axis]
        starts = (steps[:, None] + starts[None, :]).reshape(-1)
    return starts, run


def coalesce(starts: np.ndarray, length: int, max_gap: int) -> list[tuple[int, int]]:
    """Merge sorted equal-length ranges whose gaps are at most ``max_gap`` into [lo, hi) ranges."""
    if len(starts) == 0:
        return []
    ends = starts + length
    breaks = np.nonzero(starts[1:] - ends[:-1] > max_gap)[0]
    los = np.concatenate(([starts[0]], starts[breaks + 1]))
    his = np.concatenate((ends[breaks], [ends[-1]]))
    return [(int(lo), int(hi)) for lo, hi in zip(los, his)]


def blocks_touched(ranges: list[tuple[int, int]], block: int, total: int) -> list[tuple[int, int]]:
    """Widen byte ranges to whole checksum blocks, merged: [lo, hi) ranges within ``total``."""
    out: list[tuple[int, int]] = []
    for lo, hi in ranges:
        lo, hi = lo // block * block, min(-(-hi // block) * block, total)
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out
