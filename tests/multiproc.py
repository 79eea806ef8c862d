"""Run a function on N real ranks (forked processes, gloo) and collect results or tracebacks."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import socket
import traceback
from typing import Any, Callable

import torch.distributed as dist


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable, args: tuple, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
        result = fn(rank, world, *args)
        dist.barrier()
        queue.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - reported to the test
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world: int, fn: Callable, *args: Any, timeout: float = 300) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` forked ranks; return per-rank results.

    Raises AssertionError with every failing rank's traceback, or if a rank hangs.
    """
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, tuple[bool, Any]] = {}
    try:
        for _ in range(world):
            rank, ok, value = queue.get(timeout=timeout)
            results[rank] = (ok, value)
    except Exception as e:  # queue.Empty: some rank hung or died
        raise AssertionError(f"ranks {sorted(set(range(world)) - set(results))} did not finish: {e!r}") from None
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    failures = [f"--- rank {r} ---\n{v}" for r, (ok, v) in sorted(results.items()) if not ok]
    if failures:
        raise AssertionError("\n".join(failures))
    return [results[r][1] for r in range(world)]
