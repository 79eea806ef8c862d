#!/usr/bin/env python
"""How long an async save takes to become durable beside loops that load the host differently.

    .venv/bin/python scripts/durable_beside_loop.py --dir /work/fp_durable --gib 1 --reps 3

Two ranks (gloo, TP=2) hold the benchmark's GPT state and run ``load_ops(sd)``
as a trainer does. Per repetition and loop kind, a synchronous save of the
state is timed, then an async save into another directory, from the call until
``AsyncSaveQueue.maybe_finalize`` (called after every loop step) commits it,
while the loop steps: ``sleep`` (50 ms asleep: nothing competes with the
writer), ``spin`` (50 ms of busy CPU, no memory traffic) or ``memory`` (the
benchmark's in-place update of the whole state, as in ``bench-train``).
Prints rank 0's medians, which tell the writer's own delay (``sleep``) from
what competition for the cores and the memory adds.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time

import torch.distributed as dist
from megatron.core import dist_checkpointing

from fastpersist_dist import ASYNC_SAVE_KWARGS, AsyncSaveQueue, FastPersistSaveStrategy, prepare_checkpoint_dir
from fastpersist_dist.tools.bench.runner import BenchConfig, on_ranks
from fastpersist_dist.tools.bench.training_loop import _trainer, train_step

STEP_S = 0.05


def _spin() -> None:
    end = time.perf_counter() + STEP_S
    while time.perf_counter() < end:
        pass


def _rank(rank: int, world: int, args: argparse.Namespace) -> dict[str, list[float]]:
    """This rank's seconds: synchronous saves, and durable beside each loop kind."""
    _, sd, tensors = _trainer(rank, BenchConfig(ranks=2, tp=2, gib=args.gib))
    FastPersistSaveStrategy().load_ops(sd)
    loops = {"sleep": lambda: time.sleep(STEP_S), "spin": _spin, "memory": lambda: train_step(tensors)}
    queue, times = AsyncSaveQueue(), {name: [] for name in ("sync", *loops)}
    for rep in range(args.reps):
        for name, step in loops.items():
            sync_dir, async_dir = (os.path.join(args.dir, f"{name}{rep}{suffix}") for suffix in ("_sync", "_async"))
            prepare_checkpoint_dir(sync_dir)
            dist.barrier()
            start = time.perf_counter()
            dist_checkpointing.save(sd, sync_dir, sharded_strategy=FastPersistSaveStrategy())
            times["sync"].append(time.perf_counter() - start)
            prepare_checkpoint_dir(async_dir)
            dist.barrier()
            start = time.perf_counter()
            queue.schedule(dist_checkpointing.save(sd, async_dir, sharded_strategy=FastPersistSaveStrategy(),
                                                   async_sharded_save=True, **ASYNC_SAVE_KWARGS))
            while True:
                step()
                if queue.maybe_finalize(blocking=False):
                    break
            times[name].append(time.perf_counter() - start)
            dist.barrier()
            if rank == 0:  # on /dev/shm, kept checkpoints would take the machine's memory
                for path in (sync_dir, async_dir):
                    shutil.rmtree(path)
    queue.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    times = on_ranks(2, _rank, args)[0]
    shutil.rmtree(args.dir, ignore_errors=True)
    sync = statistics.median(times.pop("sync"))
    print(f"synchronous save: median {sync:.3f} s of {args.reps * len(times)}")
    for name, seconds in times.items():
        durable = statistics.median(seconds)
        print(f"durable beside a '{name}' loop: median {durable:.3f} s ({durable / sync:.2f}x the synchronous "
              f"save), each {', '.join(f'{t:.2f}' for t in seconds)}")


if __name__ == "__main__":
    main()
