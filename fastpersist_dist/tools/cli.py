"""The commands of ``fastpersist-dist``: ``bench``, ``sweep``, ``simulate``, ``verify``, ``inspect``, ``build-ops``,
``report``.

``fastpersist_dist_cli`` parses and checks the arguments without importing this
package, then calls the function of the same name here (exit codes there).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    from ..util.config import WriteConfig
    from .bench.runner import BenchConfig


def build_ops(_: argparse.Namespace) -> int:
    """Build (or load) the DeepSpeed ops, saying how long it took."""
    from ..storage.deepspeed_ops import aio_module, ensure_fast_file_writer_usable

    start = time.perf_counter()
    aio_module()
    ensure_fast_file_writer_usable()
    print(f"build-ops: DeepSpeed async_io and utils ops ready ({time.perf_counter() - start:.0f} s)")
    return 0


# bench flag -> WriteConfig field; unset flags keep WriteConfig's defaults (one place for each default)
_KNOBS = {"io_buffer_mb": "io_buffer_mb", "aio_block_mb": "aio_block_mb", "aio_queue_depth": "aio_queue_depth",
          "aio_intra_op": "aio_intra_op_parallelism", "direct_io": "direct_io"}


def _write_config(args: argparse.Namespace) -> WriteConfig:
    from ..util.config import WriteConfig

    knobs = {field: getattr(args, flag) for flag, field in _KNOBS.items() if getattr(args, flag) is not None}
    if args.single_buffer:
        knobs["double_buffer"] = False
    if args.no_balance:
        knobs["balance"] = False
    return WriteConfig(**knobs)


def _bench_config(args: argparse.Namespace, **fields: Any) -> BenchConfig:
    """The benchmark state of the state arguments plus ``fields``; logging set up for the run."""
    from .bench.runner import BenchConfig

    logging.basicConfig(level=getattr(logging, args.log_level), format="%(message)s", stream=sys.stderr)
    return BenchConfig(ranks=args.ranks, tp=args.tp, gib=args.gib, reps=args.reps, directory=args.dir, **fields)


def bench(args: argparse.Namespace) -> int:
    """``bench``: the table on stdout, progress on stderr; JSON and chart where asked."""
    try:
        write = _write_config(args)
    except ValueError as e:
        print(f"bench: {e}", file=sys.stderr)
        return 2

    from .bench import runner
    from .bench.table import format_table

    cfg = _bench_config(args, contenders=tuple(args.contenders.split(",")), keep=args.keep, write=write)
    rep = runner.run(cfg)
    print(format_table(rep))
    _write_json(args.json, rep)
    if args.plot:
        from .bench.plot import plot_report

        plot_report(rep, args.plot)
        print(f"bench: chart written to {args.plot}")
    return 0


def sweep(args: argparse.Namespace) -> int:
    """``sweep``: the knob search."""
    from .bench.sweep import main_sweep

    return main_sweep(_bench_config(args))


def bench_train(args: argparse.Namespace) -> int:
    """``bench-train``: a training loop with async checkpoints, ours against megatron's."""
    from .bench.loop_report import format_loop_table
    from .bench.training_loop import run_checked

    rep = run_checked(_bench_config(args), args.steps, args.every, args.contenders, args.compute_ms,
                      args.local_dir, args.persistent, args.nodes, args.share_reads)
    if rep is None:
        return 2
    print(format_loop_table(rep))
    _write_json(args.json, rep)
    return 0


def report(args: argparse.Namespace) -> int:
    """``report``: the docs' benchmarks measured (or read ``--from-json``), saved as JSON, rendered into the pages."""
    from .report.command import Settings
    from .report.command import report as fill_report

    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    logging.getLogger("fastpersist_dist.tools.report").setLevel(logging.INFO)  # its progress lines
    settings = Settings(directory=args.dir, shm_dir=args.shm_dir, gib=args.gib, reps=args.reps)
    return fill_report(args.pages, settings, args.json, args.from_json)


def _examine(command: str, examine: Callable[[str], Any], directory: str) -> Any:
    """``examine(directory)``, or None after printing why the directory cannot be examined (exit code 2)."""
    from ..util.errors import FastPersistError

    try:
        return examine(directory)
    except FastPersistError as e:
        print(_prefixed(command, str(e)), file=sys.stderr)
        return None


def _prefixed(command: str, message: str) -> str:
    """``message`` for stderr, started with the command's name (the engine's messages may already be)."""
    return message if message.startswith(f"{command}: ") else f"{command}: {message}"


def verify(args: argparse.Namespace) -> int:
    """``verify``: every problem, then one summary line."""
    from ..util.progress import ProgressLine, shown
    from ..util.wording import counted
    from .dcp_files import NO_CHECKSUMS
    from .verify import verify_checkpoint

    with shown(ProgressLine(sys.stderr, "verify: checksummed")):
        report = _examine("verify", verify_checkpoint, args.directory)
    if report is None:
        return 2
    for problem in report.problems:
        print(f"PROBLEM: {problem}")
    state = "OK" if report.ok else f"FAILED ({counted(len(report.problems), 'problem')})"
    checked = f"{report.bytes_checked / 2**30:.3f} GiB checksummed" if report.checksummed else \
        f"{NO_CHECKSUMS}; file sizes checked"
    print(f"verify: {report.directory}: {state}; {counted(report.tensors, 'tensor')} in "
          f"{counted(report.records, 'record')}, {checked}")
    return 0 if report.ok else 1


def inspect(args: argparse.Namespace) -> int:
    """``inspect``: the report (text or JSON); problems also on stderr."""
    from .inspect import format_report, inspect_checkpoint

    report = _examine("inspect", inspect_checkpoint, args.directory)
    if report is None:
        return 2
    print(json.dumps(report.to_json(), indent=1) if args.json else format_report(report))
    for problem in report.problems:
        print(_prefixed("inspect", problem), file=sys.stderr)
    return 0 if report.ok else 1


def simulate(args: argparse.Namespace) -> int:
    """``simulate``: checkpoint metadata at scale, as a table (and JSON)."""
    from .bench import simulate as simulation

    dist_opts = {"on": [True], "off": [False], "both": [True, False]}[args.dist_opt]
    shape = {"tp": args.tp, "pp": args.pp, "layers": args.layers, "hidden": args.hidden, "vocab": args.vocab}
    try:
        rows = simulation.run(args.dp, dist_opts, args.world_plan_max, args.central_max, **shape)
    except ValueError as e:
        print(f"simulate: {e}", file=sys.stderr)
        return 2
    print(simulation.format_table(rows))
    _write_json(args.json, rows)
    return 0


def _write_json(path: Optional[str], report: Any) -> None:
    """``--json PATH`` of the benchmark commands: the report they printed, as JSON (nothing without a path)."""
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1)


__all__ = ["bench", "bench_train", "build_ops", "inspect", "report", "simulate", "sweep", "verify"]
