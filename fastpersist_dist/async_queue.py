"""A device-agnostic queue of async checkpoint requests with a forked writer per request.

megatron-core's ``AsyncCallsQueue`` runs the same ``AsyncRequest`` objects, but
in 0.16 its temporal caller calls ``torch.cuda.synchronize()`` and all-reduces
a tensor on ``torch.cuda.current_device()``, and its persistent worker calls
``torch.cuda.set_device``: none of that runs on a CPU-only torch. This queue
has the same semantics (requests are finalized in order, on all ranks, only
once every rank's writer is done) and works with gloo and NCCL alike.

The writer is forked after staging, so it never touches an accelerator; it
creates its own aio handle (one inherited over fork would hang).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import time
from collections import deque
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

logger = logging.getLogger(__name__)


@dataclass
class _Active:
    index: int
    request: AsyncRequest
    process: Optional[mp.process.BaseProcess]
    started: float


def _flag_device() -> torch.device:
    """Where the all-reduced 'still writing' flag must live for this process group's backend."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class AsyncSaveQueue:
    """Schedule ``AsyncRequest``s and finalize them once every rank has written.

    A save issued while earlier ones still write simply queues behind them: its
    writer starts at once (each writes its own directory), and finalization is in
    issue order. ``maybe_finalize(blocking=True)`` waits for all of them.
    """

    def __init__(self) -> None:
        self._active: deque[_Active] = deque()
        self._count = 0

    def schedule(self, request: AsyncRequest) -> int:
        """Start ``request``'s writer in a forked process; returns its index. Collective-free."""
        process = None
        if request.async_fn is not None:
            process = mp.get_context("fork").Process(
                target=request.async_fn, args=request.async_fn_args, kwargs=request.async_fn_kwargs, daemon=True
            )
            process.start()
        self._count += 1
        self._active.append(_Active(self._count, request, process, time.perf_counter()))
        return self._count

    def maybe_finalize(self, blocking: bool = False) -> list[int]:
        """Finalize, in order, every request whose writers are done on all ranks (collective).

        Returns the indices finalized. A failed save raises here, on every rank,
        after its request has left the queue.
        """
        done: list[int] = []
        while self._active:
            head = self._active[0]
            if blocking and head.process is not None:
                head.process.join()
            writing = torch.tensor([int(head.process is not None and head.process.is_alive())], device=_flag_device())
            dist.all_reduce(writing)
            if writing.item():
                break
            self._active.popleft()
            if head.process is not None:
                head.process.join()
            logger.info("fastpersist: async save %d written in %.2f s", head.index, time.perf_counter() - head.started)
            for fn in head.request.finalize_fns:
                fn()
            done.append(head.index)
        return done

    @property
    def pending(self) -> int:
        """Requests scheduled but not yet finalized."""
        return len(self._active)

    def close(self) -> None:
        """Wait for and finalize everything still queued (collective)."""
        self.maybe_finalize(blocking=True)
