"""The ``fastpersist-dist`` command line: arguments parsed and checked, then the command run.

The commands themselves are in ``fastpersist_dist.tools.cli`` (see docs/cli.md).
This package lives outside ``fastpersist_dist`` because importing that package
registers its strategies with megatron-core, which imports torch, megatron-core
and DeepSpeed (seconds): ``--help`` and argument errors answer before any of
them is imported. It imports the package only to run a command, and the
package never imports it.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable, Optional, Sequence

_DESCRIPTION = """FastPersist checkpoints for megatron-core: benchmark, knob search, simulation at scale, verify,
inspect, build ops, the docs' benchmark report.

Exit codes: 0 success, 1 the checkpoint has problems, 2 bad arguments or an
unusable directory."""

# fastpersist_dist.util.quiet.QUIET_ENV: where it is set, importing the package hides its dependencies' known warnings
QUIET_ENV = "FASTPERSIST_QUIET"

# Contenders of `bench` in table order (fastpersist_dist.tools.bench.baselines.CONTENDERS implements them)
DEFAULT_CONTENDERS = ("device_bound", "device_bound_checksummed", "fastpersist", "fastpersist_async", "fastpersist_dcp",
                      "fastpersist_dcp_writer", "torch_dist", "torch_dist_fully_parallel", "dcp_filesystem", "dcp_async",
                      "torch_save")
CONTENDER_NAMES = DEFAULT_CONTENDERS + ("fastpersist_local_tier", "fastpersist_unbalanced", "fastpersist_unshared",
                                        "fastpersist_dcp_ours", "fastpersist_dcp_fully_parallel", "nvrx_local")


def _command(name: str) -> Callable[[argparse.Namespace], int]:
    """``fastpersist_dist.tools.cli.<name>``, imported when the command runs."""

    def run(args: argparse.Namespace) -> int:
        from fastpersist_dist.tools import cli

        return getattr(cli, name)(args)

    return run


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


def _plot_problem() -> Optional[str]:
    """Why ``--plot`` cannot draw: matplotlib is an optional extra (imported here only when ``--plot`` is asked)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        return f"--plot needs matplotlib ({e}): pip install 'fastpersist-dist[plot]'"
    return None


def _layout_problem(args: argparse.Namespace) -> Optional[str]:
    """Why ``--ranks``/``--tp`` describe no TP x DP layout, or None."""
    return f"--ranks ({args.ranks}) must be a multiple of --tp ({args.tp})" if args.ranks % args.tp else None


def _bench_problems(args: argparse.Namespace) -> list[str]:
    """Every reason the bench arguments cannot run (empty when they can)."""
    problems: list[Optional[str]] = [_layout_problem(args)]
    args.contenders = args.contenders or ",".join(DEFAULT_CONTENDERS)
    unknown = set(args.contenders.split(",")) - set(CONTENDER_NAMES)
    if unknown:
        problems.append(f"unknown contenders {sorted(unknown)}; known: {sorted(CONTENDER_NAMES)}")
    if args.json:
        problems.append(_output_path_problem(args.json))
    if args.plot:
        problems.append(_output_path_problem(args.plot, ".png") or _plot_problem())
    return [p for p in problems if p]


# `report`'s defaults: the pages and JSON of the checkout this command lives in, scratch space beside them
CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPORT_JSON = os.path.join(CHECKOUT, "docs", "report.json")
REPORT_DIR = os.path.join(CHECKOUT, "bench_out", "report")
REPORT_SHM_DIR = "/dev/shm/fastpersist-report"


def _checkout_pages() -> list[str]:
    """README.md and docs/*.md of the checkout, where there is one."""
    readme = os.path.join(CHECKOUT, "README.md")
    if not os.path.isfile(readme):
        return []
    docs = os.path.join(CHECKOUT, "docs")
    return [readme] + sorted(os.path.join(docs, n) for n in os.listdir(docs) if n.endswith(".md")) \
        if os.path.isdir(docs) else [readme]


def _directory_problem(option: str, path: str) -> Optional[str]:
    """Why ``path`` cannot be (made into) a writable directory: its nearest existing ancestor must be one."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        return f"{option} {path}: {existing} is not a writable directory"
    return None


def _report_problems(args: argparse.Namespace) -> list[str]:
    """Every reason the report arguments cannot run; the pages resolved (empty: the checkout's)."""
    problems: list[Optional[str]] = []
    args.pages = args.pages or _checkout_pages()
    if not args.pages:
        problems.append(f"no README.md in {CHECKOUT} (not a checkout): name the pages to fill")
    problems += [f"page {p} is not a readable and writable file" for p in args.pages
                 if not (os.path.isfile(p) and os.access(p, os.R_OK | os.W_OK))]
    if args.from_json:
        problems.append(None if os.path.isfile(args.from_json) else f"--from-json {args.from_json}: no such file")
        return [p for p in problems if p]
    problems.append(args.json and _output_path_problem(args.json))
    problems += [_directory_problem("--dir", args.dir), _directory_problem("--shm-dir", args.shm_dir)]
    if os.path.realpath(args.dir) == os.path.realpath(args.shm_dir):
        problems.append("--dir and --shm-dir must be different directories (the disk and memory)")
    return [p for p in problems if p]


# command -> its argument check, run before anything heavy is imported
_CHECKS: dict[str, Callable[[argparse.Namespace], list[str]]] = {
    "bench": _bench_problems,
    "sweep": lambda args: [p for p in [_layout_problem(args)] if p],
    "bench-train": lambda args: [p for p in [_layout_problem(args), args.every >= args.steps and
                                             f"--every ({args.every}) must be below --steps ({args.steps})"] if p],
    "simulate": lambda args: [p for p in [args.json and _output_path_problem(args.json)] if p],
    "report": _report_problems,
}


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


def _non_negative_float(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _state_args(p: argparse.ArgumentParser) -> None:
    """Ranks, parallel layout, size and repetitions of the benchmark state."""
    p.add_argument("--ranks", type=_positive_int, default=2, help="number of ranks (default 2)")
    p.add_argument("--tp", type=_positive_int, default=2, help="tensor-parallel size; DP = ranks / tp (default 2)")
    p.add_argument("--gib", type=_positive_float, default=2.0, help="total state size in GiB (default 2)")
    p.add_argument("--reps", type=_positive_int, default=3, help="repetitions per contender (default 3)")
    p.add_argument("--dir", default="bench_out", help="target directory (default ./bench_out)")
    p.add_argument("--log-level", choices=("WARNING", "INFO", "DEBUG"), default="WARNING",
                   help="WARNING (default): progress and results only; INFO: also one summary per save and "
                        "load (rank 0); DEBUG: also each rank's save profile (phases) and its write and load "
                        "throughput")


def parser() -> argparse.ArgumentParser:
    """The command's argument parser."""
    p = argparse.ArgumentParser(prog="fastpersist-dist", description=_DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bench", help="save/load a GPT-shaped state with FastPersist and the alternatives; print a table")
    _state_args(b)
    b.add_argument("--contenders", default=None,
                   help=f"comma-separated list (default: all of {', '.join(DEFAULT_CONTENDERS)}; also "
                        f"{', '.join(CONTENDER_NAMES[len(DEFAULT_CONTENDERS):])})")
    b.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    b.add_argument("--keep", action="store_true", help="keep the last checkpoint of each contender")
    b.add_argument("--plot", metavar="PATH.png", help="also draw the report as a GiB/s bar chart")
    k = b.add_argument_group("FastPersist knobs (defaults: fastpersist_dist.WriteConfig, see docs/knobs.md)")
    k.add_argument("--io-buffer-mb", type=_positive_int, help="page-locked bounce buffer per writer, MiB")
    k.add_argument("--single-buffer", action="store_true", help="one bounce buffer instead of two halves")
    k.add_argument("--aio-block-mb", type=_positive_int, help="aio request size, MiB")
    k.add_argument("--aio-queue-depth", type=_positive_int, help="aio requests in flight")
    k.add_argument("--aio-intra-op", type=_positive_int, help="aio threads per request (intra-op parallelism)")
    k.add_argument("--direct-io", choices=("auto", "on", "off"), help="O_DIRECT+aio, with fallback (auto)")
    k.add_argument("--no-balance", action="store_true", help="main replicas write everything (no DP split)")
    b.set_defaults(func=_command("bench"))
    t = sub.add_parser("bench-train", help="a training loop with async checkpoints every K steps: its slowdown, "
                       "ours against megatron's torch_dist async (see docs/async.md)")
    _state_args(t)
    t.add_argument("--steps", type=_positive_int, default=30, help="loop steps (default 30)")
    t.add_argument("--every", type=_positive_int, default=10, help="checkpoint every K steps (default 10)")
    t.add_argument("--compute-ms", type=_non_negative_float, default=None,
                   help="matrix products per step besides the update, calibrated to take this long on the idle "
                        "machine (default: none on a host; with a GPU, whose update alone takes milliseconds, a short "
                        "training step's worth; the run's first line says how much)")
    t.add_argument("--contenders", default=None, help="comma-separated, with 'none' (default: none, torch_dist, "
                   "fastpersist_megatron_queue, fastpersist_megatron_lm, fastpersist; also fastpersist_tiered)")
    t.add_argument("--local-dir", help="the local tier of fastpersist_tiered (e.g. /dev/shm/ckpt, or an NVMe path)")
    t.add_argument("--persistent", help="the persistent tier of fastpersist_tiered: a directory or an msc:// URL "
                   "(default: the benchmark directory)")
    t.add_argument("--share-reads", choices=("auto", "on", "off"), default="auto",
                   help="ReadConfig.share_reads of fastpersist_tiered's restarts (default auto: bytes several ranks "
                        "need are read once and sent, except from an in-memory filesystem)")
    t.add_argument("--nodes", type=_positive_int, default=1,
                   help="split the ranks into this many nodes of this machine, each with its own local tier "
                        "(LOCAL_DIR.nodes/node<n> bind-mounted at LOCAL_DIR in a mount namespace per rank; root), "
                        "fastpersist_tiered then keeping one replica of each node's files on another node")
    t.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    t.set_defaults(func=_command("bench_train"))
    w = sub.add_parser("sweep", help="search the write knobs one at a time around the defaults (FastPersist save)")
    _state_args(w)
    w.set_defaults(func=_command("sweep"))
    v = sub.add_parser("verify", help="check a checkpoint completely (no torch.distributed needed)")
    v.add_argument("directory", help="checkpoint directory")
    v.set_defaults(func=_command("verify"))
    i = sub.add_parser("inspect", help="show what a checkpoint holds, from its metadata and index (reads no data)")
    i.add_argument("directory", help="checkpoint directory")
    i.add_argument("--json", action="store_true", help="print the report as JSON")
    i.set_defaults(func=_command("inspect"))
    m = sub.add_parser("simulate", help="checkpoint metadata at 1k-16k ranks: exchange, planning, index (no I/O)")
    m.add_argument("--dp", type=_positive_int, nargs="+", default=[8, 32, 128], help="DP sizes (default 8 32 128)")
    m.add_argument("--dist-opt", choices=("on", "off", "both"), default="both", help="distributed optimizer")
    m.add_argument("--tp", type=_positive_int, default=8, help="tensor parallel (default 8)")
    m.add_argument("--pp", type=_positive_int, default=16, help="pipeline parallel (default 16)")
    m.add_argument("--layers", type=_positive_int, default=96, help="transformer layers (default 96)")
    m.add_argument("--hidden", type=_positive_int, default=12288, help="hidden size (default 12288)")
    m.add_argument("--vocab", type=_positive_int, default=51200, help="padded vocabulary (default 51200)")
    m.add_argument("--world-plan-max", type=_positive_int, default=1024,
                   help="plan the whole world at once up to this many ranks, extrapolate beyond (default 1024)")
    m.add_argument("--central-max", type=_positive_int, default=1024,
                   help="run DCP's central planning up to this many ranks, extrapolate beyond (default 1024)")
    m.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    m.set_defaults(func=_command("simulate"))
    r = sub.add_parser("report", help="run the benchmarks the docs quote, write their results as JSON and "
                       "regenerate the docs' tables from it (about 8 minutes at the defaults on 2 cores)",
                       description="Runs bench at 1 and 2 ranks in --dir (the disk) and --shm-dir (memory), and "
                       "bench-train at 2 ranks (TP=1, the tiered contender's local tier in --shm-dir); writes the "
                       "results, with the machine, storage, versions, date and commit they were measured with, to "
                       "--json; then replaces the inside of every '<!-- report: NAME begin -->' ... "
                       "'<!-- report: NAME end -->' block of the pages (NAME: bench, bench-detail, bench-train) by a "
                       "stamp line and the table. At the defaults it takes about 8 minutes on a 2-core VM.")
    r.add_argument("pages", nargs="*", metavar="PAGE.md",
                   help="the pages whose report blocks are filled (default: README.md and docs/*.md of this checkout)")
    r.add_argument("--dir", default=REPORT_DIR, help="the disk's benchmark directory (default %(default)s, "
                   "git-ignored; removed afterwards if the run created it)")
    r.add_argument("--shm-dir", default=REPORT_SHM_DIR, help="the in-memory benchmark directory, also bench-train's "
                   "local tier (default %(default)s; removed afterwards if the run created it)")
    r.add_argument("--gib", type=_positive_float, default=1.0,
                   help="total state size in GiB (default 1: large enough that a save's fixed costs do not hide "
                        "the device's bandwidth, small enough that the run takes about 8 minutes on 2 cores)")
    r.add_argument("--reps", type=_positive_int, default=3, help="repetitions per contender (default 3)")
    r.add_argument("--json", metavar="PATH", default=REPORT_JSON,
                   help="where the results go (default %(default)s: beside the pages it fills and committed with "
                        "them, so that anyone can see what every quoted figure was measured on and re-render "
                        "them with --from-json)")
    r.add_argument("--from-json", metavar="FILE", help="measure nothing: fill the pages from this saved report")
    r.set_defaults(func=_command("report"))
    o = sub.add_parser("build-ops", help="build (or check) the DeepSpeed ops FastPersist uses")
    o.set_defaults(func=_command("build_ops"))
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point: parse and check the arguments, hide dependency noise, run the command."""
    args: Any = parser().parse_args(argv)
    problems = _CHECKS.get(args.command, lambda _: [])(args)
    for problem in problems:
        print(f"{args.command}: {problem}", file=sys.stderr)
    if problems:
        return 2
    # The benchmarks fork their ranks after importing DeepSpeed and megatron-core, whose imports ask
    # torch.cuda.is_available(): by default that initializes the CUDA driver here and every forked
    # rank then fails at its first CUDA call ("Cannot re-initialize CUDA in forked subprocess").
    # Asked through NVML instead, it leaves this process without CUDA; a user's own setting wins.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    # Importing the package then hides its dependencies' known warnings first thing, in this process and in
    # every process started from it (fastpersist_dist/util/quiet.py); a library user still sees them all.
    os.environ[QUIET_ENV] = "1"
    return args.func(args)
