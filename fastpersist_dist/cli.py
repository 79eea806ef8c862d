"""The ``fastpersist-dist`` command: ``bench``, ``sweep``, ``verify``, ``inspect`` and ``build-ops``.

Exit codes: 0 success, 1 the checkpoint has problems, 2 bad arguments or an
unusable directory.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

if TYPE_CHECKING:
    from .bench.runner import BenchConfig
    from .config import WriteConfig


def _build_ops(_: argparse.Namespace) -> int:
    from .storage.deepspeed_ops import aio_module, ensure_fast_file_writer_usable

    start = time.perf_counter()
    aio_module()
    ensure_fast_file_writer_usable()
    print(f"build-ops: DeepSpeed async_io and utils ops ready ({time.perf_counter() - start:.0f} s)")
    return 0


def _output_path_problem(path: str, suffix: str = "") -> Optional[str]:
    """Why a report cannot be written to ``path``; checked before a benchmark that may run for minutes."""
    if suffix and not path.lower().endswith(suffix):
        return f"{path} must end in {suffix}"
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        return f"directory {parent} of {path} does not exist"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"directory {parent} of {path} is not writable"
    return None


# bench flag -> WriteConfig field; unset flags keep WriteConfig's defaults (one place for each default)
_KNOBS = {"io_buffer_mb": "io_buffer_mb", "aio_block_mb": "aio_block_mb", "aio_queue_depth": "aio_queue_depth",
          "aio_intra_op": "aio_intra_op_parallelism", "direct_io": "direct_io"}


def _write_config(args: argparse.Namespace) -> WriteConfig:
    from .config import WriteConfig

    knobs = {field: getattr(args, flag) for flag, field in _KNOBS.items() if getattr(args, flag) is not None}
    if args.single_buffer:
        knobs["double_buffer"] = False
    if args.no_balance:
        knobs["balance"] = False
    return WriteConfig(**knobs)


def _layout_problem(args: argparse.Namespace) -> Optional[str]:
    """Why ``--ranks``/``--tp`` describe no TP x DP layout, or None."""
    return f"--ranks ({args.ranks}) must be a multiple of --tp ({args.tp})" if args.ranks % args.tp else None


def _bench_config(args: argparse.Namespace, **fields: Any) -> BenchConfig:
    """The benchmark state of ``_state_args`` plus ``fields``; logging set up for the run."""
    from .bench.runner import BenchConfig

    logging.basicConfig(level=getattr(logging, args.log_level), format="%(message)s", stream=sys.stderr)
    return BenchConfig(ranks=args.ranks, tp=args.tp, gib=args.gib, reps=args.reps, directory=args.dir, **fields)


def _bench(args: argparse.Namespace) -> int:
    from .bench.baselines import CONTENDERS, DEFAULT_CONTENDERS

    problems: list[Optional[str]] = [_layout_problem(args)]
    args.contenders = args.contenders or ",".join(DEFAULT_CONTENDERS)
    unknown = set(args.contenders.split(",")) - set(CONTENDERS)
    if unknown:
        problems.append(f"unknown contenders {sorted(unknown)}; known: {sorted(CONTENDERS)}")
    if args.json:
        problems.append(_output_path_problem(args.json))
    if args.plot:
        problems.append(_output_path_problem(args.plot, ".png"))
    try:
        write = _write_config(args)
    except ValueError as e:
        write = None
        problems.append(str(e))
    found = [p for p in problems if p]
    for problem in found:
        print(f"bench: {problem}", file=sys.stderr)
    if found:
        return 2

    from .bench import runner

    cfg = _bench_config(args, contenders=tuple(args.contenders.split(",")), keep=args.keep, write=write)
    rep = runner.run(cfg)
    print(runner.format_table(rep))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=1)
    if args.plot:
        from .bench.plot import plot_report

        plot_report(rep, args.plot)
        print(f"bench: chart written to {args.plot}")
    return 0


def _sweep(args: argparse.Namespace) -> int:
    problem = _layout_problem(args)
    if problem:
        print(f"sweep: {problem}", file=sys.stderr)
        return 2
    from .bench.sweep import main_sweep

    return main_sweep(_bench_config(args))


def _examine(command: str, examine: Callable[[str], Any], directory: str) -> Any:
    """``examine(directory)``, or None after printing why the directory cannot be examined (exit code 2)."""
    from .errors import FastPersistError

    try:
        return examine(directory)
    except FastPersistError as e:
        print(f"{command}: {e}", file=sys.stderr)
        return None


def _verify(args: argparse.Namespace) -> int:
    from .verify import verify_checkpoint

    report = _examine("verify", verify_checkpoint, args.directory)
    if report is None:
        return 2
    for problem in report.problems:
        print(f"PROBLEM: {problem}")
    count = len(report.problems)
    state = "OK" if report.ok else f"FAILED ({count} problem{'' if count == 1 else 's'})"
    print(
        f"verify: {report.directory}: {state}; {report.tensors} tensors in {report.records} records, "
        f"{report.bytes_checked / 2**30:.3f} GiB checksummed"
    )
    return 0 if report.ok else 1


def _inspect(args: argparse.Namespace) -> int:
    from .inspect_ckpt import format_report, inspect_checkpoint

    report = _examine("inspect", inspect_checkpoint, args.directory)
    if report is None:
        return 2
    print(json.dumps(report.to_json(), indent=1) if args.json else format_report(report))
    for problem in report.problems:
        print(f"inspect: {problem}", file=sys.stderr)
    return 0 if report.ok else 1


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _state_args(p: argparse.ArgumentParser) -> None:
    """Ranks, parallel layout, size and repetitions of the benchmark state."""
    p.add_argument("--ranks", type=_positive_int, default=2, help="number of ranks (default 2)")
    p.add_argument("--tp", type=_positive_int, default=2, help="tensor-parallel size; DP = ranks / tp (default 2)")
    p.add_argument("--gib", type=_positive_float, default=2.0, help="total state size in GiB (default 2)")
    p.add_argument("--reps", type=_positive_int, default=3, help="repetitions per contender (default 3)")
    p.add_argument("--dir", default="bench_out", help="target directory (default ./bench_out)")
    p.add_argument("--log-level", choices=("WARNING", "INFO", "DEBUG"), default="WARNING",
                   help="INFO: one summary per save and load (rank 0); DEBUG: also each rank's save profile "
                        "(phases) and its write and load throughput")


def parser() -> argparse.ArgumentParser:
    """The command's argument parser."""
    p = argparse.ArgumentParser(prog="fastpersist-dist", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bench", help="save/load a GPT-shaped state with FastPersist and the alternatives; print a table")
    _state_args(b)
    b.add_argument("--contenders", default=None,
                   help="comma-separated list (default: all of device_bound, fastpersist, fastpersist_async, "
                        "fastpersist_dcp, torch_dist, torch_dist_fully_parallel, torch_save; also "
                        "fastpersist_unbalanced, fastpersist_dcp_fully_parallel)")
    b.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    b.add_argument("--keep", action="store_true", help="keep the last checkpoint of each contender")
    b.add_argument("--plot", metavar="PATH.png", help="also draw the report as a GiB/s bar chart")
    k = b.add_argument_group("FastPersist knobs (defaults: fastpersist_dist.config.WriteConfig, see docs/knobs.md)")
    k.add_argument("--io-buffer-mb", type=_positive_int, help="page-locked bounce buffer per writer, MiB")
    k.add_argument("--single-buffer", action="store_true", help="one bounce buffer instead of two halves")
    k.add_argument("--aio-block-mb", type=_positive_int, help="aio request size, MiB")
    k.add_argument("--aio-queue-depth", type=_positive_int, help="aio requests in flight")
    k.add_argument("--aio-intra-op", type=_positive_int, help="aio threads per request (intra-op parallelism)")
    k.add_argument("--direct-io", choices=("auto", "on", "off"), help="O_DIRECT+aio, with fallback (auto)")
    k.add_argument("--no-balance", action="store_true", help="main replicas write everything (no DP split)")
    b.set_defaults(func=_bench)
    t = sub.add_parser("bench-train", help="a training loop with async checkpoints every K steps: its slowdown, "
                       "ours against megatron's torch_dist async (see docs/async.md)")
    _state_args(t)
    t.add_argument("--steps", type=_positive_int, default=30, help="loop steps (default 30)")
    t.add_argument("--every", type=_positive_int, default=10, help="checkpoint every K steps (default 10)")
    t.add_argument("--contenders", default=None, help="comma-separated, with 'none' (default: none, torch_dist, "
                   "fastpersist_megatron_queue, fastpersist)")
    t.set_defaults(func=lambda a: __import__("fastpersist_dist.bench.training_loop", fromlist=["main_train"])
                   .main_train(_bench_config(a), a.steps, a.every, a.contenders))
    w = sub.add_parser("sweep", help="search the write knobs one at a time around the defaults (FastPersist save)")
    _state_args(w)
    w.set_defaults(func=_sweep)
    v = sub.add_parser("verify", help="check a checkpoint completely (no torch.distributed needed)")
    v.add_argument("directory", help="checkpoint directory")
    v.set_defaults(func=_verify)
    i = sub.add_parser("inspect", help="show what a checkpoint holds, from its metadata and index (reads no data)")
    i.add_argument("directory", help="checkpoint directory")
    i.add_argument("--json", action="store_true", help="print the report as JSON")
    i.set_defaults(func=_inspect)
    o = sub.add_parser("build-ops", help="build (or check) the DeepSpeed ops FastPersist uses")
    o.set_defaults(func=_build_ops)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point."""
    args = parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
