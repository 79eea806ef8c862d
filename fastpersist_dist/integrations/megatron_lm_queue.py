"""The queue Megatron-LM's ``--async-save`` runs its checkpoints on once ``megatron_lm.enable()`` ran.

Megatron-LM runs every async checkpoint on megatron-core's ``AsyncCallsQueue``,
whose caller forks the trainer for each save (or hands the request to a
persistent worker process it spawned). Ours need neither: their ``async_fn``
hands the job to the rank's writer process and waits. A forked caller shares
every page of the trainer copy-on-write while it lives, so the training loop
pays a page fault and a 4 KiB copy for each page it writes during the save,
although our writer process, not that child, writes (docs/async.md).

:class:`MegatronLMQueue` has ``AsyncCallsQueue``'s interface: it runs our
requests on :class:`~fastpersist_dist.engine.async_queue.AsyncSaveQueue` (a
thread each) and hands any other request (Megatron-LM's own torch DCP or
logits saves) to megatron's queue, made as Megatron-LM asked for it.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Optional

from ..engine.async_queue import AsyncSaveQueue, runs_in_a_thread

logger = logging.getLogger(__name__)


class MegatronLMQueue:
    """``AsyncCallsQueue``'s interface over our queue, with megatron's (``original``) for requests not ours.

    Finalization is in order within each queue; ``no_dist`` is not honoured for
    ours (finalizing a save is collective: every rank commits it together).
    """

    original: Any = None  # megatron's queue class (set by :func:`queue_class`)

    def __init__(self, *args: Any, **kwargs: Any):
        self._args, self._kwargs = args, kwargs
        self._ours = AsyncSaveQueue()
        self._theirs: Optional[Any] = None

    @classmethod
    def warmup_persistent_caller(cls, *args: Any, **kwargs: Any) -> None:
        """Nothing to start ahead (``--use-persistent-ckpt-worker``): our saves need no worker process, the rank's
        writer process is started by ``enable()``; megatron's starts with the first request not ours."""

    def _megatrons(self) -> Any:
        if self._theirs is None:
            self._theirs = type(self).original(*self._args, **self._kwargs)
        return self._theirs

    def schedule_async_request(self, request: Any) -> int:
        """Ours on a thread of this process; any other on megatron's queue."""
        if runs_in_a_thread(request):
            return self._ours.schedule(request)
        logger.debug("fastpersist: an async request not ours goes to megatron's %s", type(self).original.__name__)
        return self._megatrons().schedule_async_request(request)

    def maybe_finalize_async_calls(self, blocking: bool = False, no_dist: bool = False) -> list[int]:
        """Finalize what is done (collective), ours first; ``blocking``: wait for everything."""
        done = self._ours.maybe_finalize(blocking=blocking)
        if self._theirs is not None:
            done += list(self._theirs.maybe_finalize_async_calls(blocking, no_dist))
        return done

    def get_num_unfinalized_calls(self) -> int:
        """Requests scheduled and not finalized, in both queues."""
        return self._ours.pending + (0 if self._theirs is None else self._theirs.get_num_unfinalized_calls())

    def close(self, abort: bool = False) -> None:
        """Finalize everything (collective); ``abort``: drop our unfinished saves instead, not finalized (left
        uncommitted, but for a tiered save, committed to its local tiers once every rank's write is done)."""
        if abort:
            self._ours = AsyncSaveQueue()
        else:
            self._ours.close()
        if self._theirs is not None:
            self._theirs.close(abort=abort) if abort else self._theirs.close()


@functools.cache
def queue_class(original: Any) -> type:
    """The :class:`MegatronLMQueue` class standing in for megatron's queue class ``original``."""
    return type(original.__name__, (MegatronLMQueue,), {"original": original, "__module__": __name__})
