"""The knob search behind WriteConfig's defaults: one knob at a time around the defaults.

Each repetition of each setting is a ``bench`` run of the synchronous
FastPersist save on fresh ranks, so settings share no aio handle or state.
The defaults in ``util/config.py`` are the winners of this search on the
development machine (docs/knobs.md).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Callable

from ...util.config import WriteConfig
from .runner import BenchConfig, balanced_order, run, summary

# knob -> values tried (the default is always among them)
SEARCH: dict[str, tuple[Any, ...]] = {
    "io_buffer_mb": (16, 64, 256),
    "double_buffer": (True, False),
    "aio_block_mb": (1, 8, 32),
    "aio_queue_depth": (4, 8, 32),
    "aio_intra_op_parallelism": (1, 2),
}


def sweep(base: BenchConfig, progress: Callable[[str], None] = print) -> list[dict]:
    """Save throughput for each value of each knob, the others at their defaults.

    Repetitions are interleaved (every setting once per round, in the
    benchmark's balanced order: ``balanced_order``), so a drift of the device
    over the minutes of the search affects every setting alike.
    """
    defaults = WriteConfig()
    settings = [(knob, value) for knob, values in SEARCH.items() for value in values]
    times: dict[tuple[str, Any], list[float]] = {s: [] for s in settings}
    nbytes = 0
    for rep in range(base.reps):
        for knob, value in balanced_order(settings, rep):
            cfg = dataclasses.replace(base, contenders=("fastpersist",), loads=False, reps=1,
                                      write=dataclasses.replace(defaults, **{knob: value}))
            progress(f"sweep {rep + 1}/{base.reps}: {knob}={value}")
            rep_report = run(cfg, progress=lambda _: None)
            nbytes = rep_report["bytes"]
            times[(knob, value)].append(rep_report["results"][0]["save"]["median_s"])
    return [{"knob": knob, "value": value, "default": getattr(defaults, knob) == value,
             **summary(times[(knob, value)], nbytes)} for knob, value in settings]


def format_sweep(rows: list[dict], base: BenchConfig) -> str:
    """The search as a table: save seconds (median, min..max) and GiB/s per knob value."""
    lines = [f"knob search: {base.ranks} ranks, TP={base.tp}, {base.gib} GiB, median of {base.reps}; "
             "FastPersist synchronous save, '*' = current default",
             f"{'knob':<26} {'value':>7} {'save s (min..max)':>21} {'GiB/s':>6}"]
    for r in rows:
        value = f"{r['value']}{'*' if r['default'] else ' '}"
        spread = f"{r['median_s']:.2f} ({r['min_s']:.2f}..{r['max_s']:.2f})"
        lines.append(f"{r['knob']:<26} {value:>7} {spread:>21} {r['gib_s']:>6.2f}")
    return "\n".join(lines)


def main_sweep(base: BenchConfig) -> int:
    """Entry point of ``fastpersist-dist sweep``."""
    rows = sweep(base, progress=lambda m: print(m, file=sys.stderr, flush=True))
    print(format_sweep(rows, base))
    return 0
