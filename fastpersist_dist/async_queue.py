"""A device-agnostic queue of async checkpoint requests with a forked writer per request.

megatron-core's ``AsyncCallsQueue`` runs the same ``AsyncRequest`` objects, but
in 0.16 its temporal caller calls ``torch.cuda.synchronize()`` and all-reduces
a tensor on ``torch.cuda.current_device()``, and its persistent worker calls
``torch.cuda.set_device``: none of that runs on a CPU-only torch. This queue
has the same semantics (requests are finalized in order, on all ranks, only
once every rank's writer is done) and works with gloo and NCCL alike.

The writer is forked after staging, so it never touches an accelerator; it
creates its own aio handle (one inherited over fork would hang). It dies with
the trainer that forked it (``PR_SET_PDEATHSIG``): an orphaned writer would go
on writing, and leave a status file, in a directory that a restarted job may
be saving into again, and it holds the trainer's inherited sockets open, so the
other ranks would notice the death only after the process-group timeout
(120 s against 0.25 s in tests/test_faults.py). The kernel sends that signal
when the forking *thread* exits, so schedule from a thread that lives as long
as training (the main one).
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import os
import signal
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

from .errors import SaveFailedError

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


@dataclass
class _Active:
    index: int
    request: AsyncRequest
    process: Optional[mp.process.BaseProcess]
    started: float


def collective_device() -> torch.device:
    """Where tensors for collectives must live under this process group's backend (NCCL: the GPU)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _run_writer(trainer_pid: int, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
    """Entry of the forked writer: arrange to be killed with the trainer, then write."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        logger.warning("fastpersist: writer %d cannot tie its life to trainer %d: %s",
                       os.getpid(), trainer_pid, os.strerror(ctypes.get_errno()))
    if os.getppid() != trainer_pid:  # the trainer died before prctl took effect
        logger.error("fastpersist: trainer %d died before its writer %d started; nothing written",
                     trainer_pid, os.getpid())
        return
    fn(*args, **kwargs)


def _exit_description(exitcode: Optional[int]) -> str:
    if exitcode is not None and exitcode < 0:
        return f"was killed by signal {-exitcode} ({signal.strsignal(-exitcode)})"
    return f"exited with code {exitcode}"


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
                target=_run_writer,
                args=(os.getpid(), request.async_fn, request.async_fn_args, request.async_fn_kwargs or {}),
                daemon=True,
            )
            process.start()
        self._count += 1
        self._active.append(_Active(self._count, request, process, time.perf_counter()))
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
            if blocking and head.process is not None:
                head.process.join()
            writing = torch.tensor([int(head.process is not None and head.process.is_alive())], device=collective_device())
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
            if head.process is not None:
                head.process.join()
                if head.process.exitcode != 0:  # its missing status fails the commit below on every rank
                    logger.error("fastpersist: rank %d: the writer of async save %d (pid %d) %s", dist.get_rank(),
                                 head.index, head.process.pid, _exit_description(head.process.exitcode))
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
