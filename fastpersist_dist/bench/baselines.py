"""The contenders' save calls, and the CPU shims megatron's torch_dist needs.

megatron-core 0.16's torch_dist save calls ``torch.cuda.synchronize()`` and
``torch.cuda.current_device()`` unconditionally, so on a CPU-only torch it
cannot run. For the baseline alone, inside :func:`torch_dist_cpu_shims`, both
are stubbed (no-op, and "cpu"); FastPersist never runs under these stubs.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from functools import lru_cache
from typing import Callable, Iterator, Optional

import torch
from megatron.core import dist_checkpointing

from ..async_queue import AsyncSaveQueue
from ..strategies.fastpersist_save import FastPersistSaveStrategy

SHIM_NOTE = "torch_dist ran with torch.cuda.synchronize/current_device stubbed (CPU-only torch)"


@contextmanager
def torch_dist_cpu_shims() -> Iterator[None]:
    """Stub the two CUDA calls torch_dist makes, only where CUDA is absent."""
    if torch.cuda.is_available():
        yield
        return
    saved = torch.cuda.synchronize, torch.cuda.current_device
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.synchronize, torch.cuda.current_device = saved


def _torch_dist_save(sd: dict, ckpt: str) -> None:
    with torch_dist_cpu_shims():
        dist_checkpointing.save(sd, ckpt, sharded_strategy=("torch_dist", 1))


def _fastpersist_save(sd: dict, ckpt: str) -> None:
    dist_checkpointing.save(sd, ckpt, sharded_strategy=FastPersistSaveStrategy())


@lru_cache(maxsize=None)
def _async_tools() -> tuple[FastPersistSaveStrategy, AsyncSaveQueue]:
    """One strategy per process, so its snapshot buffer is reused across saves, as in training."""
    return FastPersistSaveStrategy(), AsyncSaveQueue()


def _fastpersist_async_save(sd: dict, ckpt: str) -> float:
    """Async save until durable; returns how long the call blocked the caller."""
    strategy, queue = _async_tools()
    start = time.perf_counter()
    queue.schedule(dist_checkpointing.save(sd, ckpt, sharded_strategy=strategy, async_sharded_save=True))
    blocked = time.perf_counter() - start
    queue.maybe_finalize(blocking=True)
    return blocked


def _torch_dist_load(template: dict, ckpt: str) -> dict:
    with torch_dist_cpu_shims():
        return dist_checkpointing.load(template, ckpt)


def _fastpersist_load(template: dict, ckpt: str) -> dict:
    return dist_checkpointing.load(template, ckpt)  # our loader, picked from metadata.json


# name -> (save(sd, dir) -> seconds the call blocked if async, load(template, dir) -> state dict)
CONTENDERS: dict[str, tuple[Callable[[dict, str], Optional[float]], Callable[[dict, str], dict]]] = {
    "fastpersist": (_fastpersist_save, _fastpersist_load),
    "fastpersist_async": (_fastpersist_async_save, _fastpersist_load),
    "torch_dist": (_torch_dist_save, _torch_dist_load),
}
