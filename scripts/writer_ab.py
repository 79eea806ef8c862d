#!/usr/bin/env python
"""A/B of one rank's write path between git revisions: wall and CPU seconds, and the files compared.

    .venv/bin/python scripts/writer_ab.py /dev/shm/fp_ab main HEAD --gib 1 --reps 3

Each revision's ``fastpersist_dist`` is taken with ``git archive``; every
repetition runs each revision once, in turn, in a fresh process (its own aio
handle), which writes the same pseudo-random records (100 by default, as many as
the benchmark's GPT state has) once to warm up and once timed with
``write_rank_file``. Prints the median per revision, the ratio to the first
revision, CPU seconds per GiB (the process, all its threads), and fails if the
files of two revisions differ in any byte.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile

_CHILD = r"""
import json, os, resource, sys, time
import numpy as np, torch, xxhash
import fastpersist_dist
from fastpersist_dist import WriteConfig
try:
    from fastpersist_dist.format.records import ShardRecord
except ImportError:  # a revision before the package's layers
    from fastpersist_dist.format import ShardRecord
from fastpersist_dist.storage.writer import WriteItem, write_rank_file

path, nbytes, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
data = torch.from_numpy(np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8))
size, items = nbytes // count, []
for i in range(count):
    record = ShardRecord(key=f"r{i}", kind="tensor", dtype="uint8", local_shape=(size,), global_shape=(size,),
                         global_offset=(0,), axis_fragmentations=None, prepend_axis_num=0, flattened_range=None,
                         replica_id=0, file=os.path.basename(path), offset=i * size, length=size)
    items.append(WriteItem(record, data[i * size:(i + 1) * size]))

def cpu():
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime

write_rank_file(path, items, WriteConfig(), 0)  # warm-up: ops, aio handle, bounce buffer
c0, t0 = cpu(), time.perf_counter()
write_rank_file(path, items, WriteConfig(), 0)
wall, used = time.perf_counter() - t0, cpu() - c0
h = xxhash.xxh3_64()
with open(path, "rb") as f:
    while chunk := f.read(64 << 20):
        h.update(chunk)
os.unlink(path)
print(json.dumps({"wall": wall, "cpu": used, "file": h.hexdigest(), "bytes": size * count,
                  "package": fastpersist_dist.__file__}))
"""


def _export(repo: str, rev: str, into: str) -> str:
    """``rev``'s fastpersist_dist package under ``into``; returns the directory to put on sys.path."""
    dest = os.path.join(into, rev.replace("/", "_"))
    os.makedirs(dest)
    archive = subprocess.run(["git", "-C", repo, "archive", "--format=tar", rev, "fastpersist_dist"],
                             check=True, capture_output=True).stdout
    with tempfile.TemporaryFile() as f:
        f.write(archive)
        f.seek(0)
        with tarfile.open(fileobj=f) as tar:
            tar.extractall(dest, filter="data")
    return dest


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("directory", help="where to write (the filesystem under test)")
    p.add_argument("revs", nargs="+", help="git revisions; the first is the reference of the ratios")
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--records", type=int, default=100)
    args = p.parse_args()
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    os.makedirs(args.directory, exist_ok=True)
    runs: dict[str, list[dict]] = {rev: [] for rev in args.revs}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {rev: _export(repo, rev, tmp) for rev in args.revs}
        for rep in range(args.reps):
            for rev in args.revs:
                out = subprocess.run(
                    [sys.executable, "-c", _CHILD, os.path.join(args.directory, "ab.bin"), str(int(args.gib * 2**30)),
                     str(args.records)],
                    env={**os.environ, "PYTHONPATH": paths[rev]}, cwd=paths[rev], capture_output=True, text=True,
                    check=True,
                )
                runs[rev].append(json.loads(out.stdout.strip().splitlines()[-1]))
                if not runs[rev][-1]["package"].startswith(paths[rev]):  # an installed copy would shadow the revision
                    raise RuntimeError(f"{rev}: imported {runs[rev][-1]['package']}, not {paths[rev]}")
                print(f"rep {rep + 1}/{args.reps} {rev}: {runs[rev][-1]['wall']:.2f} s", file=sys.stderr, flush=True)
    files = {r["file"] for rs in runs.values() for r in rs}
    ref = statistics.median(r["wall"] for r in runs[args.revs[0]])
    gib = runs[args.revs[0]][0]["bytes"] / 2**30
    print(f"write_rank_file of {gib:.2f} GiB in {args.records} records to {args.directory}, median of {args.reps} "
          f"(min..max), revisions interleaved")
    for rev, rs in runs.items():
        walls = [r["wall"] for r in rs]
        med = statistics.median(walls)
        print(f"{rev:<12} {med:6.2f} s ({min(walls):.2f}..{max(walls):.2f}) {gib / med:6.2f} GiB/s "
              f"x{ref / med:.2f}  CPU {statistics.median(r['cpu'] for r in rs) / gib:.2f} s/GiB")
    print("files: identical across revisions" if len(files) == 1 else f"files DIFFER: {sorted(files)}")
    return 0 if len(files) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
