"""The ``fastpersist-dist`` command: ``bench``, ``verify`` and ``build-ops``.

Exit codes: 0 success, 1 the checkpoint has problems, 2 bad arguments or an
unusable directory.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Optional, Sequence


def _build_ops(_: argparse.Namespace) -> int:
    from .storage.deepspeed_ops import aio_module, ensure_fast_file_writer_usable

    start = time.perf_counter()
    aio_module()
    ensure_fast_file_writer_usable()
    print(f"build-ops: DeepSpeed async_io and utils ops ready ({time.perf_counter() - start:.0f} s)")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from .bench.baselines import CONTENDERS
    from .bench.runner import BenchConfig, main_bench

    if args.ranks % args.tp:
        raise SystemExit(f"bench: --ranks ({args.ranks}) must be a multiple of --tp ({args.tp})")
    unknown = set(args.contenders.split(",")) - set(CONTENDERS)
    if unknown:
        raise SystemExit(f"bench: unknown contenders {sorted(unknown)}; known: {sorted(CONTENDERS)}")
    cfg = BenchConfig(
        ranks=args.ranks, tp=args.tp, gib=args.gib, reps=args.reps, directory=args.dir,
        contenders=tuple(args.contenders.split(",")), keep=args.keep,
    )
    return main_bench(cfg, args.json)


def _verify(args: argparse.Namespace) -> int:
    from .errors import FastPersistError
    from .verify import verify_checkpoint

    try:
        report = verify_checkpoint(args.directory)
    except FastPersistError as e:
        print(f"verify: {e}", file=sys.stderr)
        return 2
    for problem in report.problems:
        print(f"PROBLEM: {problem}")
    state = "OK" if report.ok else f"FAILED ({len(report.problems)} problems)"
    print(
        f"verify: {report.directory}: {state}; {report.tensors} tensors in {report.records} records, "
        f"{report.bytes_checked / 2**30:.3f} GiB checksummed"
    )
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


def parser() -> argparse.ArgumentParser:
    """The command's argument parser."""
    p = argparse.ArgumentParser(prog="fastpersist-dist", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bench", help="save/load a GPT-shaped state with FastPersist and torch_dist; print a table")
    b.add_argument("--ranks", type=_positive_int, default=2, help="number of ranks (default 2)")
    b.add_argument("--tp", type=_positive_int, default=2, help="tensor-parallel size (default 2)")
    b.add_argument("--gib", type=_positive_float, default=2.0, help="total state size in GiB (default 2)")
    b.add_argument("--reps", type=_positive_int, default=3, help="repetitions per contender (default 3)")
    b.add_argument("--dir", default="bench_out", help="target directory (default ./bench_out)")
    b.add_argument("--contenders", default="fastpersist,fastpersist_async,torch_dist", help="comma-separated list")
    b.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    b.add_argument("--keep", action="store_true", help="keep the last checkpoint of each contender")
    b.set_defaults(func=_bench)
    v = sub.add_parser("verify", help="check a checkpoint completely (no torch.distributed needed)")
    v.add_argument("directory", help="checkpoint directory")
    v.set_defaults(func=_verify)
    o = sub.add_parser("build-ops", help="build (or check) the DeepSpeed ops FastPersist uses")
    o.set_defaults(func=_build_ops)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point."""
    args = parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
