#!/usr/bin/env python
"""How long an async save takes to become durable beside loops that load the host differently.

    .venv/bin/python scripts/durable_beside_loop.py --dir /work/fp_durable --gib 1 --reps 3
    .venv-0.19/bin/python scripts/durable_beside_loop.py --dir /work/fp_durable --gib 1 --reps 3 \
        --local-dir /dev/shm/fp_local

Two ranks (gloo, TP=2) hold the benchmark's GPT state and run ``load_ops(sd)``
as a trainer does. Per repetition and loop kind, a synchronous save of the
state straight into ``--dir`` is timed, then an async save into another
directory there, while the loop steps: ``sleep`` (50 ms asleep: nothing
competes with the writer), ``spin`` (50 ms of busy CPU, no memory traffic) or
``memory`` (the benchmark's in-place update of the whole state, as in
``bench-train``); ``AsyncSaveQueue.maybe_finalize`` runs after every step.
Straight, the async save is durable once finalize commits it. With
``--local-dir`` it is tiered (``TierConfig(local_dir)``, ``--dir`` its
persistent tier): the local commit is seen by finalize, and the
time to durable is the one its manifest records (the loop steps on until
then). Prints rank 0's medians, which tell the writer's own delay (``sleep``)
from what competition for the cores and the memory adds.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from typing import Callable, Optional

import torch.distributed as dist
from megatron.core import dist_checkpointing

from fastpersist_dist import (ASYNC_SAVE_KWARGS, AsyncSaveQueue, FastPersistSaveStrategy, TierConfig,
                              prepare_checkpoint_dir)
from fastpersist_dist.engine.tiers.state import checkpoint_state
from fastpersist_dist.format.tiers import DURABLE
from fastpersist_dist.tools.bench.runner import BenchConfig, on_ranks
from fastpersist_dist.tools.bench.training_loop import LoopConfig, _durable_after, _trainer, train_step

STEP_S = 0.05


def _spin() -> None:
    end = time.perf_counter() + STEP_S
    while time.perf_counter() < end:
        pass


def _durable_s(ckpt: str, called_at: float, step: Callable[[], None]) -> float:
    """A tiered save's seconds from its call (unix time) to durable, as its manifest records; the loop steps
    until then."""
    while checkpoint_state(ckpt) != DURABLE:
        step()
    return _durable_after(ckpt, called_at)


def _rank(rank: int, world: int, args: argparse.Namespace) -> dict[str, list[float]]:
    """This rank's seconds: synchronous saves; committed (and durable, tiered) beside each loop kind."""
    t = _trainer(rank, LoopConfig(BenchConfig(ranks=2, tp=2, gib=args.gib), compute_ms=0))
    tiers: Optional[TierConfig] = None
    if args.local_dir:
        tiers = TierConfig(os.path.abspath(args.local_dir))
    FastPersistSaveStrategy().load_ops(t.sd)
    if tiers is not None:
        FastPersistSaveStrategy(tiers=tiers).load_ops(t.sd)
    loops = {"sleep": lambda: time.sleep(STEP_S), "spin": _spin, "memory": lambda: train_step(t.tensors, t.compute)}
    queue, times = AsyncSaveQueue(), {"sync": []}
    for rep in range(args.reps):
        for name, step in loops.items():
            sync_dir, async_dir = (os.path.join(args.dir, f"{name}{rep}{suffix}") for suffix in ("_sync", "_async"))
            prepare_checkpoint_dir(sync_dir)
            dist.barrier()
            start = time.perf_counter()
            dist_checkpointing.save(t.sd, sync_dir, sharded_strategy=FastPersistSaveStrategy())
            times["sync"].append(time.perf_counter() - start)
            prepare_checkpoint_dir(async_dir)
            dist.barrier()
            start, called_at = time.perf_counter(), time.time()
            strategy = FastPersistSaveStrategy(tiers=tiers)
            queue.schedule(dist_checkpointing.save(t.sd, async_dir, sharded_strategy=strategy, async_sharded_save=True,
                                                   **ASYNC_SAVE_KWARGS))
            while True:
                step()
                if queue.maybe_finalize(blocking=False):
                    break
            times.setdefault(f"committed beside '{name}'", []).append(time.perf_counter() - start)
            if tiers is not None:
                times.setdefault(f"durable beside '{name}'", []).append(_durable_s(async_dir, called_at, step))
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
    parser.add_argument("--local-dir", help="tiered async saves with this local tier, --dir their persistent one")
    args = parser.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    times = on_ranks(2, _rank, args)[0]
    shutil.rmtree(args.dir, ignore_errors=True)
    if args.local_dir:
        shutil.rmtree(args.local_dir, ignore_errors=True)
    sync = statistics.median(times.pop("sync"))
    print(f"synchronous save straight to --dir: median {sync:.3f} s of {args.reps * 3}")
    for name, seconds in times.items():
        median = statistics.median(seconds)
        print(f"{name} loop: median {median:.3f} s ({median / sync:.2f}x the synchronous save), each "
              f"{', '.join(f'{s:.2f}' for s in seconds)}")


if __name__ == "__main__":
    main()
