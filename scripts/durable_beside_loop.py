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
Prints the medians (rank 0), which tell the writer's own delay (``sleep``) from
what competition for the cores and the memory adds.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from megatron.core import dist_checkpointing

from fastpersist_dist import ASYNC_SAVE_KWARGS, AsyncSaveQueue, FastPersistSaveStrategy, prepare_checkpoint_dir
from fastpersist_dist.bench.gpt_state import GptShape, gpt_sharded_state_dict
from fastpersist_dist.bench.runner import init_rank
from fastpersist_dist.bench.training_loop import train_step

STEP_S = 0.05


def _spin() -> None:
    end = time.perf_counter() + STEP_S
    while time.perf_counter() < end:
        pass


def _rank(rank: int, port: int, args: argparse.Namespace) -> None:
    init_rank(rank, 2, port)
    sd = gpt_sharded_state_dict(GptShape.for_bytes(int(args.gib * (1 << 30)), 2), 2, rank, 2, torch.device("cpu"))
    tensors = [sh.data for sh in sd.values()]
    train_step(tensors)
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
    queue.close()
    if rank == 0:
        sync = statistics.median(times["sync"])
        print(f"synchronous save: median {sync:.3f} s of {len(times['sync'])}")
        for name in loops:
            durable = statistics.median(times[name])
            print(f"durable beside a '{name}' loop: median {durable:.3f} s ({durable / sync:.2f}x the synchronous "
                  f"save), each {', '.join(f'{t:.2f}' for t in times[name])}")
        shutil.rmtree(args.dir, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(port, args), nprocs=2)


if __name__ == "__main__":
    main()
