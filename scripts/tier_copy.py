#!/usr/bin/env python
"""How fast one data file moves between tiers, every block checked: the drain's copy and an object-store fetch.

    .venv-0.19/bin/python scripts/tier_copy.py --src-dir /dev/shm --dst-dir /work/tier-copy --gib 0.485 --reps 5
    .venv-0.19/bin/python scripts/tier_copy.py --src-dir /dev/shm --dst-dir /dev/shm/tier-copy --s3 --reps 5

Writes one file of pseudo-random bytes cut into records of 1 to 40 MiB (like
a rank's share of the benchmark's GPT state) into ``--src-dir``, with its
block checksums, then times ``copy_checked`` of it into ``--dst-dir`` (what
a drain to a persistent directory and a fetch from one do). With ``--s3`` it
starts a SeaweedFS server on loopback (``tests/object_store.py``), uploads
the file once (timed) and times fetches of it into ``--dst-dir`` instead (what
a load from an object store does). Prints each repetition and the median.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from functools import partial

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fastpersist_dist.format.checksum import BlockHasher  # noqa: E402
from fastpersist_dist.format.records import ShardRecord  # noqa: E402
from fastpersist_dist.storage.copy import Span, block_spans, copy_checked  # noqa: E402
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src-dir", required=True, help="where the source file is written (e.g. /dev/shm)")
    parser.add_argument("--dst-dir", required=True, help="where it is copied or fetched to (made, then removed)")
    parser.add_argument("--gib", type=float, default=0.485, help="file size in GiB (default 0.485)")
    parser.add_argument("--reps", type=int, default=5, help="timed copies (default 5)")
    parser.add_argument("--s3", action="store_true", help="fetch from a SeaweedFS server on loopback instead")
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
            home = persistent_dir("msc://s3/tier-copy")
            print(f"upload: {home.put('copy.distcp', src, spans, size, 'upload'):.3f} s")
            move = partial(home.fetch, "copy.distcp", dst, spans, size, "fetch")
        else:
            move = partial(copy_checked, src, dst, spans, size, "copy")
        times = []
        for _ in range(args.reps):
            times.append(move())
            os.unlink(dst)
        median = statistics.median(times)
        print(f"{'fetch' if args.s3 else 'copy'} of {size / 2**30:.3f} GiB: {' '.join(f'{t:.3f}' for t in times)} s; "
              f"median {median:.3f} s ({size / 2**30 / median:.2f} GiB/s)")
    finally:
        if server is not None:
            server.stop()
            shutil.rmtree(server.data_dir, ignore_errors=True)
        if os.path.exists(src):
            os.unlink(src)
        shutil.rmtree(args.dst_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
