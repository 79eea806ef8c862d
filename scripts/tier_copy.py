#!/usr/bin/env python
"""How fast one data file moves between tiers, every block checked: the drain's copy and an object-store fetch.

    .venv-0.19/bin/python scripts/tier_copy.py --src-dir /dev/shm --dst-dir /work/tier-copy --gib 0.485 --reps 5
    .venv-0.19/bin/python scripts/tier_copy.py --src-dir /dev/shm --dst-dir /dev/shm/tier-copy --s3 --reps 5
    .venv-0.19/bin/python scripts/tier_copy.py --src-dir /dev/shm --dst-dir /dev/shm/tier-copy --s3 --s3-profile s3-rust

Writes one file of pseudo-random bytes cut into records of 1 to 40 MiB (like
a rank's share of the benchmark's GPT state) into ``--src-dir``, with its
block checksums, then times ``copy_checked`` of it into ``--dst-dir`` (what
a drain to a persistent directory and a fetch from one do). With ``--s3`` it
starts a SeaweedFS server on loopback (``tests/object_store.py``) and times
uploads of the file (what a drain to an object store does) and fetches of it
into ``--dst-dir`` (what a load from one does) instead, through msc's boto3
client or (``--s3-profile s3-rust``) its Rust client. Prints each repetition
and the median, and the CPU seconds this process spent per GiB (for uploads
and fetches, the server's, on the same machine, apart).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import tempfile
from functools import partial
from typing import Callable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fastpersist_dist.format.checksum import BlockHasher  # noqa: E402
from fastpersist_dist.format.records import ShardRecord  # noqa: E402
from fastpersist_dist.storage.copy import copy_checked  # noqa: E402
from fastpersist_dist.storage.spans import Span, block_spans  # noqa: E402
from fastpersist_dist.storage.persistent import persistent_dir  # noqa: E402

BLOCK = 4 << 20  # the default checksum block


def data_file(path: str, size: int) -> list[Span]:
    """Write ``size`` pseudo-random bytes to ``path`` as back-to-back records; their blocks."""
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
    records, offset = [], 0
    while offset < size:
        n = int(min(size - offset, rng.integers(1 << 20, 40 << 20)))
        hasher = BlockHasher(BLOCK)
        hasher.update(data[offset : offset + n])
        sums = tuple(hasher.finish())
        records.append(ShardRecord(f"r{len(records)}", "tensor", "uint8", (n,), (n,), (0,), None, 0, None, 0,
                                   os.path.basename(path), offset, n, sums))
        offset += n
    with open(path, "wb") as f:
        f.write(data)
    return block_spans(records, BLOCK, size, path)


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _moves(what: str, move: Callable[[], float], size: int, reps: int,
           after: Callable[[], None] = lambda: None) -> None:
    """``reps`` timed ``move()`` calls (``after`` each, untimed): their times and this process's CPU per GiB."""
    times, cpu = [], []
    for _ in range(reps):
        before = _cpu_seconds()
        times.append(move())
        cpu.append((_cpu_seconds() - before) / (size / 2**30))
        after()
    median = statistics.median(times)
    print(f"{what} of {size / 2**30:.3f} GiB: {' '.join(f'{t:.3f}' for t in times)} s; "
          f"median {median:.3f} s ({size / 2**30 / median:.2f} GiB/s)")
    print(f"{what}: this process's CPU per GiB {' '.join(f'{c:.2f}' for c in cpu)} s; median "
          f"{statistics.median(cpu):.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src-dir", required=True, help="where the source file is written (e.g. /dev/shm)")
    parser.add_argument("--dst-dir", required=True, help="where it is copied or fetched to (made, then removed)")
    parser.add_argument("--gib", type=float, default=0.485, help="file size in GiB (default 0.485)")
    parser.add_argument("--reps", type=int, default=5, help="timed copies (default 5)")
    parser.add_argument("--s3", action="store_true", help="upload to and fetch from a SeaweedFS server on loopback "
                        "instead")
    parser.add_argument("--s3-profile", default="s3", choices=("s3", "s3-rust"),
                        help="with --s3: msc's boto3 client (default) or its Rust client")
    args = parser.parse_args()
    size = int(args.gib * 2**30)
    src = os.path.join(args.src_dir, f"tier-copy-{os.getpid()}.distcp")
    dst = os.path.join(args.dst_dir, "copy.distcp")
    os.makedirs(args.dst_dir, exist_ok=True)
    server = None
    try:
        spans = data_file(src, size)
        if args.s3:
            from tests.object_store import SeaweedS3

            server_dir = tempfile.mkdtemp(prefix="tier-copy-s3-")
            server = SeaweedS3(server_dir)
            server.start()
            os.environ["MSC_CONFIG"] = server.msc_config(os.path.join(server_dir, "msc.json"))
            home = persistent_dir(f"msc://{args.s3_profile}/tier-copy")
            _moves("upload", partial(home.put, "copy.distcp", src, spans, size, "upload"), size, args.reps)
            _moves("fetch", partial(home.fetch, "copy.distcp", dst, spans, size, "fetch"), size, args.reps,
                   partial(os.unlink, dst))
        else:
            _moves("copy", partial(copy_checked, src, dst, spans, size, "copy"), size, args.reps,
                   partial(os.unlink, dst))
    finally:
        if server is not None:
            server.stop()
            shutil.rmtree(server.data_dir, ignore_errors=True)
        if os.path.exists(src):
            os.unlink(src)
        shutil.rmtree(args.dst_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
