"""Pure geometry, checked against brute force over numpy index arrays."""

import itertools
import math

import numpy as np
import pytest

from fastpersist_dist.format.layout import (
    blocks_touched,
    c_strides,
    coalesce,
    contiguous_runs,
    flat_range_to_boxes,
    intersect,
)

pytestmark = pytest.mark.engine

SHAPES = [(), (7,), (3, 5), (2, 3, 4), (4, 1, 3, 2)]


def test_intersect():
    assert intersect((0, 0), (4, 4), (2, 3), (4, 4)) == ((2, 3), (2, 1))
    assert intersect((0,), (4,), (4,), (2,)) is None
    assert intersect((), (), (), ()) == ((), ())


@pytest.mark.parametrize("shape", SHAPES)
def test_flat_range_to_boxes_covers_exactly(shape):
    n = math.prod(shape)
    flat = np.arange(n).reshape(shape)
    for start in range(n + 1):
        for stop in range(start, n + 1):
            boxes = flat_range_to_boxes(shape, start, stop)
            assert len(boxes) <= 2 * max(len(shape), 1)
            seen = []
            for off, box, fs in boxes:
                part = flat[tuple(slice(o, o + b) for o, b in zip(off, box))].reshape(-1)
                # Each box is contiguous in C order and starts where it says.
                assert list(part) == list(range(fs, fs + part.size))
                seen.extend(part)
            assert sorted(seen) == list(range(start, stop))


@pytest.mark.parametrize("shape", [s for s in SHAPES if s])
def test_contiguous_runs_match_brute_force(shape):
    flat = np.arange(math.prod(shape)).reshape(shape)
    ranges = [range(n) for n in shape]
    for off in itertools.product(*ranges):
        for sub in itertools.product(*[range(1, n - o + 1) for o, n in zip(off, shape)]):
            want = flat[tuple(slice(o, o + s) for o, s in zip(off, sub))].reshape(-1)
            starts, run = contiguous_runs(shape, off, sub)
            got = np.concatenate([np.arange(s, s + run) for s in starts])
            assert list(got) == list(want)


def test_contiguous_runs_fold_full_trailing_axes():
    starts, run = contiguous_runs((8, 4, 4), (2, 0, 0), (3, 4, 4))
    assert list(starts) == [32] and run == 48
    starts, run = contiguous_runs((8, 6), (0, 2), (8, 3))
    assert len(starts) == 8 and run == 3


def test_c_strides():
    assert c_strides((2, 3, 4)) == (12, 4, 1)
    assert c_strides(()) == ()


def test_coalesce_merges_small_gaps_only():
    starts = np.array([0, 10, 30, 100])
    assert coalesce(starts, 5, 5) == [(0, 15), (30, 35), (100, 105)]
    assert coalesce(starts, 5, 0) == [(0, 5), (10, 15), (30, 35), (100, 105)]
    assert coalesce(np.array([], dtype=np.int64), 5, 0) == []


def test_blocks_touched_widens_and_clips():
    assert blocks_touched([(5, 6), (9, 12)], 4, 13) == [(4, 12)]
    assert blocks_touched([(5, 6), (9, 13)], 4, 13) == [(4, 13)]
    assert blocks_touched([(0, 1), (20, 21)], 4, 22) == [(0, 4), (20, 22)]
