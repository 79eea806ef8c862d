"""One rank of a tiered-checkpoint run under torchrun: ``python -m tests.tiers_driver ACTION ARGS_JSON``.

``tests/test_tiers.py`` starts torchrun once per node (``--nnodes 2 --node-rank N``), each in a mount
namespace of its own where the same local-tier path is that node's own directory. Actions:

* ``save``: for each of ``saves``, save the state of its ``step`` into its ``checkpoint`` (``local_dir``,
  ``persistent``, ``async`` as it says), then optionally wait until it is durable;
* ``load``: load ``checkpoint`` into a fresh state of ``step`` (with ``loader_local_dir`` if given) and compare.

Prints one line ``RESULT {...}``: what this rank saw, and the warnings it logged.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing

from fastpersist_dist import (ASYNC_SAVE_KWARGS, AsyncSaveQueue, FastPersistLoadStrategy, FastPersistSaveStrategy,
                              checkpoint_state, wait_durable)

from .helpers import empty_like_request, global_tensor, sharded


def state(rank: int, world: int, step: int) -> dict:
    """Rows of ``w`` split over the ranks, ``b`` replicated: what every scenario saves (``step``: the values)."""
    return {"w": sharded("w", global_tensor("w", (64 * world, 256), salt=step), rank, world, 0),
            "b": sharded("b", global_tensor("b", (1000,), salt=step), rank, world, None)}


def _save(rank: int, world: int, args: dict) -> dict:
    ckpt = args["checkpoint"]
    if rank == 0:
        os.makedirs(ckpt, exist_ok=True)
    dist.barrier()
    strategy = FastPersistSaveStrategy(args.get("format"), local_dir=args["local_dir"],
                                       persistent=args.get("persistent", True))
    sd = state(rank, world, args["step"])
    if args.get("async"):
        queue = AsyncSaveQueue()
        queue.schedule(dist_checkpointing.save(sd, ckpt, sharded_strategy=strategy, async_sharded_save=True,
                                               **ASYNC_SAVE_KWARGS))
        queue.close()
    else:
        dist_checkpointing.save(sd, ckpt, sharded_strategy=strategy)
    saved = {"state_after_save": checkpoint_state(ckpt)}
    if args.get("wait_durable"):
        saved["durable"] = wait_durable(ckpt, timeout=120)
    saved["state"] = checkpoint_state(ckpt)
    return saved


def main(action: str, args: dict) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s %(message)s")
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("fastpersist_dist").addHandler(handler)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    result: dict = {"rank": rank, "node": os.environ["GROUP_RANK"], "warnings": warnings}
    if action == "save":
        result["saves"] = [_save(rank, world, one) for one in args["saves"]]
    else:
        ckpt = args["checkpoint"]
        want = state(rank, world, args["step"])
        request = {k: empty_like_request(v) for k, v in want.items()}
        loader = FastPersistLoadStrategy(local_dir=args.get("loader_local_dir"))
        started = time.perf_counter()
        try:
            loaded = dist_checkpointing.load(request, ckpt, sharded_strategy=loader)
        except Exception as e:  # noqa: BLE001 - reported to the test
            result["error"] = f"{type(e).__name__}: {e}"
        else:
            result["equal"] = all(torch.equal(loaded[k], v.data) for k, v in want.items())
        result["seconds"] = time.perf_counter() - started
        result["state"] = checkpoint_state(ckpt)
    dist.barrier()
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(sys.argv[1], json.loads(sys.argv[2]))), flush=True)
