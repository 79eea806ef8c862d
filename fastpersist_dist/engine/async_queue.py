"""A device-agnostic queue of async checkpoint requests, each waited for by a thread.

megatron-core's ``AsyncCallsQueue`` runs the same ``AsyncRequest`` objects, but
in 0.16 its temporal caller calls ``torch.cuda.synchronize()`` and all-reduces
a tensor on ``torch.cuda.current_device()``, and its persistent worker calls
``torch.cuda.set_device``: none of that runs on a CPU-only torch. This queue
has the same semantics (requests are finalized in order, on all ranks, only
once every rank's writer is done) and works with gloo and NCCL alike.

Our requests' ``async_fn`` only hands the job to the rank's persistent writer
process (see writer_process.py) and waits, so it runs here in a thread: no
process is forked per save. A forked caller (megatron's temporal queue) shares
every page of the trainer copy-on-write while it lives, and the training loop
then pays a page fault and a 4 KiB copy for each page it modifies during the save.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

from ..util.errors import SaveFailedError
from .writer_process import write_in_writer

logger = logging.getLogger(__name__)


@dataclass
class _Active:
    index: int
    request: AsyncRequest
    thread: Optional[threading.Thread]
    started: float


def collective_device() -> torch.device:
    """Where tensors for collectives must live under this process group's backend (NCCL: the GPU)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _call(index: int, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
    try:
        fn(*args, **kwargs)
    except BaseException:  # noqa: BLE001 - ours never raise; another request's failure shows at finalize
        logger.exception("fastpersist: the async function of save %d raised", index)


def runs_in_a_thread(request: Any) -> bool:
    """Whether ``request`` is one of ours (every async save's ``async_fn`` hands the job to the rank's writer
    process and waits), which a thread of this process serves without a caller process."""
    return getattr(request, "async_fn", None) is write_in_writer


class AsyncSaveQueue:
    """Schedule ``AsyncRequest``s and finalize them once every rank has written.

    A save issued while earlier ones still write queues behind them (the rank's
    writer takes them in order), and finalization is in issue order.
    ``maybe_finalize(blocking=True)`` waits for all of them.
    """

    def __init__(self) -> None:
        self._active: deque[_Active] = deque()
        self._count = 0

    def schedule(self, request: AsyncRequest) -> int:
        """Start ``request``'s ``async_fn`` in a thread; returns its index. Collective-free."""
        self._count += 1
        thread = None
        if request.async_fn is not None:
            thread = threading.Thread(
                target=_call, name=f"fastpersist-async-save-{self._count}", daemon=True,
                args=(self._count, request.async_fn, request.async_fn_args, request.async_fn_kwargs or {}),
            )
            thread.start()
        self._active.append(_Active(self._count, request, thread, time.perf_counter()))
        return self._count

    def maybe_finalize(self, blocking: bool = False) -> list[int]:
        """Finalize, in order, every request whose writers are done on all ranks (collective).

        Returns the indices finalized. A failed save raises here, on every rank,
        after its request has left the queue. If another rank died or hung past
        the process group's timeout, ``SaveFailedError`` is raised here (or by the
        commit), and the save is not committed.
        """
        done: list[int] = []
        while self._active:
            head = self._active[0]
            if blocking and head.thread is not None:
                head.thread.join()
            alive = head.thread is not None and head.thread.is_alive()
            writing = torch.tensor([int(alive)], device=collective_device())
            try:
                dist.all_reduce(writing)
            except RuntimeError as e:  # torch's DistError family: a rank died or timed out
                raise SaveFailedError(
                    f"rank {dist.get_rank()}: async save {head.index} cannot be finalized, a rank died or timed out "
                    f"({type(e).__name__}: {e}); it was not committed (no rank got to commit it)"
                ) from e
            if writing.item():
                break
            self._active.popleft()
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
