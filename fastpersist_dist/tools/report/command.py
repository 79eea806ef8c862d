"""``fastpersist-dist report``: run the benchmarks the docs quote, write their results as JSON, and fill the
docs' report blocks from that JSON.

Measuring reuses the benchmarks as they are (``bench``'s :func:`runner.run`
and ``bench-train``'s :func:`training_loop.run`, their report dicts kept
whole in the JSON); rendering is :mod:`.render` (pure) and filling the pages
:mod:`.blocks`. The pages' blocks are checked before anything is measured, so
a broken marker costs no benchmark run; the JSON is written before any page,
so a page that cannot be filled can be filled later with ``--from-json``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Optional, Sequence

from ..bench import runner, training_loop
from ..bench.loop_checkpointers import LoopConfig
from ..bench.runner import BenchConfig
from . import environment
from .blocks import BlockError, check_pages, update_pages
from .render import (
    BLOCKS,
    DETAIL_RANKS,
    LOOP_CONTENDERS,
    LOOP_EVERY,
    LOOP_RANKS,
    LOOP_STEPS,
    LOOP_TP,
    WHERE,
    bench_contenders,
    render,
)

logger = logging.getLogger(__name__)

FORMAT = 1  # the JSON's layout; render() reads this one
CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
LOCAL_TIER = "local-tier"  # bench-train's local tier, in the memory directory


class ReportError(ValueError):
    """A report that cannot be read or rendered; the message names the file."""


@dataclass(frozen=True)
class Settings:
    """What to measure with: the disk directory, the memory directory, the state's size, the repetitions."""

    directory: str
    shm_dir: str
    gib: float
    reps: int

    def place(self, where: str) -> str:
        return {"disk": self.directory, "shm": self.shm_dir}[where]


def bench_configs(settings: Settings) -> list[tuple[str, BenchConfig]]:
    """The ``bench`` runs the tables need: each directory at 1 and 2 ranks (TP = ranks), with their role."""
    return [(where, BenchConfig(ranks=ranks, tp=ranks, gib=settings.gib, reps=settings.reps,
                                directory=settings.place(where), contenders=bench_contenders(ranks)))
            for where in WHERE for ranks in DETAIL_RANKS]


def loop_config(settings: Settings) -> LoopConfig:
    """The ``bench-train`` run: 2 ranks at TP=1 straight to the disk, the tiered contender's local tier in memory."""
    bench = BenchConfig(ranks=LOOP_RANKS, tp=LOOP_TP, gib=settings.gib, reps=settings.reps,
                        directory=settings.directory)
    return LoopConfig(bench, steps=LOOP_STEPS, every=LOOP_EVERY, local_dir=os.path.join(settings.shm_dir, LOCAL_TIER))


def _topmost_missing(path: str) -> Optional[str]:
    """The outermost directory of ``path`` that does not exist yet (what creating it makes), or None."""
    path, missing = os.path.abspath(path), None
    while not os.path.exists(path):
        path, missing = os.path.dirname(path), path
    return missing


def measure(settings: Settings) -> dict[str, Any]:
    """Run every benchmark the tables need; the report as a dict (see docs/cli.md for its layout). Directories
    the run had to create are removed afterwards."""
    date, started = environment.utc_now(), time.monotonic()
    found_commit = environment.commit(CHECKOUT)
    created = [m for m in {_topmost_missing(settings.directory), _topmost_missing(settings.shm_dir)} if m]
    runs = bench_configs(settings)
    try:
        for where in WHERE:
            os.makedirs(settings.place(where), exist_ok=True)
        storage = {where: environment.storage(settings.place(where)) for where in WHERE}
        bench = []
        for i, (where, cfg) in enumerate(runs, start=1):
            logger.info("report: %d/%d: bench at %d rank(s) in %s", i, len(runs) + 1, cfg.ranks, cfg.directory)
            bench.append({"where": where, "report": runner.run(cfg, progress=logger.info)})
        loop = loop_config(settings)
        logger.info("report: %d/%d: bench-train in %s, local tier %s", len(runs) + 1, len(runs) + 1,
                    loop.bench.directory, loop.local_dir)
        train = training_loop.run(loop, LOOP_CONTENDERS, progress=logger.info)
    finally:
        for path in created:
            shutil.rmtree(path, ignore_errors=True)
    stamp = {"date": date, "duration_s": round(time.monotonic() - started, 1), "commit": found_commit,
             "machine": environment.machine(environment.gpu_names()), "storage": storage,
             "versions": environment.versions()}
    return {"format": FORMAT, "stamp": stamp, "settings": asdict(settings), "bench": bench, "bench_train": train}


def load(path: str) -> dict[str, Any]:
    """A saved report; :class:`ReportError` naming ``path`` where it is not one this version renders."""
    try:
        with open(path) as f:
            result = json.load(f)
    except (OSError, ValueError) as e:
        raise ReportError(f"{path}: cannot read a report from it: {e}") from e
    if not isinstance(result, dict) or result.get("format") != FORMAT or "stamp" not in result:
        raise ReportError(f"{path}: not a fastpersist-dist report of format {FORMAT} (no 'format': {FORMAT} "
                          f"and 'stamp' at its top)")
    return result


def rendered(result: dict[str, Any], source: str) -> dict[str, str]:
    """:func:`render` of ``result``; :class:`ReportError` naming ``source`` where a figure the tables need is
    missing."""
    try:
        return render(result)
    except (KeyError, TypeError, IndexError) as e:
        raise ReportError(f"{source}: a figure the tables need is missing or malformed ({e!r})") from e


def report(pages: Sequence[str], settings: Settings, json_path: Optional[str], from_json: Optional[str]) -> int:
    """Measure (or read ``from_json``), write the JSON to ``json_path`` when measuring, fill ``pages``' blocks;
    say on stdout what was written. Exit code 0, or 2 after saying why (blocks, JSON)."""
    try:
        if not check_pages(pages, BLOCKS):
            logger.warning("report: no report blocks in %s: nothing to fill", ", ".join(pages))
        if from_json:
            result, source = load(from_json), from_json
        else:
            result, source = measure(settings), json_path or "the report"
            if json_path:
                with open(json_path, "w") as f:
                    json.dump(result, f, indent=1)
                    f.write("\n")
                print(f"report: results written to {json_path}")
        filled = update_pages(pages, rendered(result, source), BLOCKS)
    except (BlockError, ReportError) as e:
        print(f"report: {e}", file=sys.stderr)
        return 2
    for page, names in filled.items():
        print(f"report: {page}: filled {', '.join(names)}")
    return 0
