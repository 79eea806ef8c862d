"""A bar chart of a benchmark report: GiB/s per operation, one bar per contender.

Works on the dict ``runner.report()`` returns (or its JSON), whatever rows and
operations it holds: a contender without an operation simply has no bar there,
so new contenders or operations need no change here.
"""

from __future__ import annotations

import math
from typing import Any

from .runner import GiB

# Known operations first, in the table's order; any other operation found follows.
OP_ORDER = ("save", "load", "reshard", "blocking")
OP_LABELS = {"blocking": "save call\n(async, blocking part)"}


def _ops(rows: list[dict[str, Any]]) -> list[str]:
    """Every operation some row measured, known ones first."""
    found: list[str] = []
    for row in rows:
        for name, value in row.items():
            if isinstance(value, dict) and "gib_s" in value and name not in found:
                found.append(name)
    return [op for op in OP_ORDER if op in found] + [op for op in found if op not in OP_ORDER]


def plot_report(rep: dict[str, Any], path: str) -> None:
    """Write the report's throughputs as a PNG bar chart to ``path``.

    Bars are GiB/s of the median time; error bars span the GiB/s of the slowest
    and fastest repetition. matplotlib is imported here, and drawn with Agg
    without touching pyplot's global state, so the benchmark itself never needs it.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(f"the chart needs matplotlib ({e}): pip install 'fastpersist-dist[plot]'") from e

    rows = rep["results"]
    ops = _ops(rows)
    fig = Figure(figsize=(max(6.0, 1.2 + 0.6 * len(ops) * max(len(rows), 1)), 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    width = 0.8 / max(len(rows), 1)
    for i, row in enumerate(rows):
        xs, heights, low, high = [], [], [], []
        for j, op in enumerate(ops):
            o = row.get(op)
            if not isinstance(o, dict) or "gib_s" not in o:
                continue
            xs.append(j - 0.4 + width * (i + 0.5))
            heights.append(o["gib_s"])
            lo = hi = math.nan  # no spread known: no error bar (a flat one would claim min == max)
            if {"median_s", "min_s", "max_s"} <= o.keys() and o["min_s"] > 0:
                gib = o["gib_s"] * o["median_s"]  # the GiB this operation moved
                lo, hi = gib / o["max_s"], gib / o["min_s"]  # slowest and fastest repetition
            low.append(o["gib_s"] - lo)
            high.append(hi - o["gib_s"])
        bars = ax.bar(xs, heights, width, yerr=[low, high], capsize=3, label=row["name"])
        ax.bar_label(bars, fmt="%.2f", padding=2, fontsize=7)
    ax.set_xticks(range(len(ops)), [OP_LABELS.get(op, op) for op in ops])
    ax.set_ylabel("GiB/s (median; bars: min..max)")
    cfg = rep["config"]
    ax.set_title(
        f"fastpersist-dist bench: {rep['bytes'] / GiB:.2f} GiB state, {cfg['ranks']} ranks (TP={cfg['tp']}), "
        f"median of {cfg['reps']}"
    )
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.savefig(path, format="png", dpi=120)
