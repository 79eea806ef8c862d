#!/usr/bin/env python
"""What an async save call costs at least on this machine, and what its writer process holds.

    .venv/bin/python scripts/snapshot_floor.py --gib 0.5 --reps 3 --ranks 2

Per repetition: allocating and mapping a snapshot buffer of that size (a new
``SharedBuffer``: what the first async save call of a process does unless
``load_ops(sd)`` ran), then copying a tensor of that size into it twice (the
second is the steady-state call's floor: the call's streaming copy into mapped memory), on one
thread. Then, with ``--ranks N``, N processes copy their own tensor into their
own buffer at the same instants, as N ranks of one host do in an async save
call (they share the memory bandwidth). Last, one writer process is started
and its memory read from ``/proc/<pid>/smaps_rollup``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

import torch

from fastpersist_dist.engine.writer_process import writer_client
from fastpersist_dist.storage.host_copy import copy_to_host
from fastpersist_dist.storage.shared_memory import SharedBuffer


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _copier(nbytes: int, reps: int, barrier: mp.synchronize.Barrier, out: mp.Queue) -> None:
    """One rank's steady-state copies, each started with the other ranks' (the barrier)."""
    torch.set_num_threads(1)
    source = torch.randn(nbytes // 4)
    buffer = SharedBuffer(nbytes)
    dest = buffer.tensor.view(torch.float32)
    copy_to_host(dest, source)
    times = []
    for _ in range(reps):
        barrier.wait()
        times.append(_timed(lambda: copy_to_host(dest, source)))
    out.put(statistics.median(times))


def concurrent_copies(nbytes: int, ranks: int, reps: int) -> list[float]:
    """Median seconds per copy of each of ``ranks`` processes copying ``nbytes`` at the same instants."""
    ctx = mp.get_context("fork")
    barrier, out = ctx.Barrier(ranks), ctx.Queue()
    procs = [ctx.Process(target=_copier, args=(nbytes, reps, barrier, out)) for _ in range(ranks)]
    for p in procs:
        p.start()
    medians = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=0.5)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=1, help="also copy in this many processes at once")
    args = parser.parse_args()
    torch.set_num_threads(1)
    nbytes = int(args.gib * (1 << 30)) // 4 * 4
    source = torch.randn(nbytes // 4)
    for rep in range(args.reps):
        buffers: list[SharedBuffer] = []
        alloc = _timed(lambda: buffers.append(SharedBuffer(nbytes)))
        first, again = (_timed(lambda: copy_to_host(buffers[0].tensor.view(torch.float32), source)) for _ in range(2))
        print(f"rep {rep + 1}: {nbytes / (1 << 30):.2f} GiB buffer allocated+mapped {alloc:.3f} s; "
              f"copy into it {first:.3f} s, again {again:.3f} s ({nbytes / again / (1 << 30):.1f} GiB/s)")
        buffers[0].close()
    if args.ranks > 1:
        medians = concurrent_copies(nbytes, args.ranks, max(args.reps, 5))
        print(f"{args.ranks} processes copying {nbytes / (1 << 30):.2f} GiB each at once: median "
              + ", ".join(f"{m:.3f} s ({nbytes / m / (1 << 30):.1f} GiB/s)" for m in medians))
    client = writer_client()
    ready = _timed(client.wait_ready)
    with open(f"/proc/{client.pid}/smaps_rollup") as f:
        fields = {k.rstrip(":"): int(v) for k, v, *_ in (line.split() for line in f) if k.rstrip(":") in
                  ("Rss", "Pss", "Private_Dirty")}
    print(f"writer process: serving after {ready:.2f} s; " + ", ".join(f"{k} {v / 1024:.0f} MiB"
                                                                       for k, v in fields.items()))


if __name__ == "__main__":
    main()
