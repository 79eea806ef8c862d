"""The ways ``bench-train``'s loop checkpoints, and the loop's configuration.

Each way (a :class:`Checkpointer`) is what a trainer does with one backend: a
start-up step, the async save call, a non-blocking finalize at every step, and
a synchronous save of the same state (the ratios' denominator).
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Optional

import torch
from megatron.core import dist_checkpointing

from ... import compat
from ...engine.async_queue import AsyncSaveQueue
from ...integrations.megatron_lm_queue import queue_class
from ...strategies.fastpersist_save import FastPersistSaveStrategy
from ...util.config import TierConfig
from .baselines import torch_dist_cpu_shims
from .runner import BenchConfig

ACCELERATOR_COMPUTE_MS = 250.0


def default_compute_ms() -> float:
    """Matmul time per step when not given: none on a host, where rewriting the state is a step's
    worth of memory traffic, and ``ACCELERATOR_COMPUTE_MS`` on a GPU, which
    rewrites it in milliseconds: saves every 10 steps would otherwise always overlap, whatever the backend."""
    return ACCELERATOR_COMPUTE_MS if torch.cuda.is_available() else 0.0


@dataclass(frozen=True)
class LoopConfig:
    """The loop: ``steps`` steps, an async checkpoint every ``every`` steps (not at the last one), and
    ``compute_ms`` of matrix products per step besides the update (None: :func:`default_compute_ms`)."""

    bench: BenchConfig
    steps: int = 30
    every: int = 10
    compute_ms: Optional[float] = None
    local_dir: Optional[str] = None  # the local tier of tiered contenders
    persistent: Optional[str] = None  # their persistent tier (a directory or msc:// URL); default the bench's
    nodes: int = 1  # the ranks split into this many nodes on this machine (nodes.py); with 2+, replicas=1
    share_reads: str = "auto"  # ReadConfig's, for the restarts of tiered contenders

    @property
    def replicas(self) -> int:
        return 1 if self.nodes > 1 else 0

    @property
    def step_compute_ms(self) -> float:
        return default_compute_ms() if self.compute_ms is None else self.compute_ms

    @property
    def save_steps(self) -> list[int]:
        return [s for s in range(1, self.steps) if s % self.every == 0]


class Checkpointer:
    """One way to checkpoint asynchronously: the save call, a non-blocking finalize, a synchronous save."""

    checkpoints = True
    uses_writer = False  # whether the rank's persistent writer process counts towards this one's memory
    tiered = False  # whether a finalized save is only local, durable later on the persistent tier
    replicas = 0  # tiered: how many other nodes keep each node's files

    def shims(self) -> ContextManager[Any]:
        return nullcontext()

    def start(self, sd: dict) -> None:
        """What a trainer does once at start-up for this way of saving (before its first loop)."""

    def save(self, sd: dict, ckpt: str) -> None:
        raise NotImplementedError

    def finalize(self, blocking: bool) -> int:
        """Finalize what is done (collective); how many saves were finalized."""
        return 0

    def sync_save(self, sd: dict, ckpt: str) -> None:
        raise NotImplementedError


class _None(Checkpointer):
    """The reference loop: no checkpoints."""

    checkpoints = False


class _Ours(Checkpointer):
    """``save(..., sharded_strategy=FastPersistSaveStrategy(), async_sharded_save=True)``, a fresh strategy each."""

    uses_writer = True

    def __init__(self, cfg: BenchConfig, megatron_queue: bool, tiers: Optional[TierConfig] = None,
                 megatron_lm: bool = False):
        self._write = cfg.write
        self._megatron = megatron_queue or megatron_lm
        # Megatron-LM's --async-save queue once megatron_lm.enable() ran: ours for our requests
        queue = queue_class(compat.megatron_async_queue_class()) if megatron_lm else compat.megatron_async_queue_class()
        self._queue: Any = queue() if self._megatron else AsyncSaveQueue()
        self._tiers = tiers
        self.tiered = tiers is not None
        self.replicas = 0 if tiers is None else tiers.replicas

    def _strategy(self) -> FastPersistSaveStrategy:
        return FastPersistSaveStrategy(config=self._write, tiers=self._tiers)

    def shims(self) -> ContextManager[Any]:
        return torch_dist_cpu_shims() if self._megatron else nullcontext()

    def start(self, sd: dict) -> None:
        self._strategy().load_ops(sd)  # plan + snapshot buffer, as docs/async.md advises

    def save(self, sd: dict, ckpt: str) -> None:
        request = dist_checkpointing.save(sd, ckpt, sharded_strategy=self._strategy(), async_sharded_save=True,
                                          **compat.ASYNC_SAVE_KWARGS)
        if self._megatron:
            self._queue.schedule_async_request(request)
        else:
            self._queue.schedule(request)

    def finalize(self, blocking: bool) -> int:
        if self._megatron:
            return len(self._queue.maybe_finalize_async_calls(blocking=blocking))
        return len(self._queue.maybe_finalize(blocking=blocking))

    def sync_save(self, sd: dict, ckpt: str) -> None:
        dist_checkpointing.save(sd, ckpt, sharded_strategy=self._strategy())


def _tiered(loop: "LoopConfig") -> Checkpointer:
    if loop.local_dir is None:
        raise ValueError("fastpersist_tiered needs a local tier: bench-train --local-dir PATH")
    return _Ours(loop.bench, megatron_queue=False, tiers=TierConfig(os.path.abspath(loop.local_dir),
                                                                    replicas=loop.replicas))


class _TorchDist(Checkpointer):
    """megatron's torch_dist async save on megatron's own AsyncCallsQueue (fork, copy-on-write)."""

    def __init__(self, cfg: BenchConfig):
        self._queue = compat.megatron_async_queue_class()()

    def shims(self) -> ContextManager[Any]:
        return torch_dist_cpu_shims()

    def save(self, sd: dict, ckpt: str) -> None:
        request = dist_checkpointing.save(sd, ckpt, sharded_strategy=("torch_dist", 1), async_sharded_save=True,
                                          **compat.ASYNC_SAVE_KWARGS)
        self._queue.schedule_async_request(request)

    def finalize(self, blocking: bool) -> int:
        return len(self._queue.maybe_finalize_async_calls(blocking=blocking))

    def sync_save(self, sd: dict, ckpt: str) -> None:
        dist_checkpointing.save(sd, ckpt, sharded_strategy=("torch_dist", 1))


CHECKPOINTERS: dict[str, Callable[["LoopConfig"], Checkpointer]] = {
    "none": lambda loop: _None(),
    "torch_dist": lambda loop: _TorchDist(loop.bench),
    "fastpersist_megatron_queue": lambda loop: _Ours(loop.bench, megatron_queue=True),
    "fastpersist_megatron_lm": lambda loop: _Ours(loop.bench, megatron_queue=False, megatron_lm=True),
    "fastpersist": lambda loop: _Ours(loop.bench, megatron_queue=False),
    "fastpersist_tiered": _tiered,
}
WHAT = {
    "none": "no checkpoints (the reference loop)",
    "torch_dist": "megatron torch_dist async on megatron's AsyncCallsQueue (forks a caller per save)",
    "fastpersist_megatron_queue": "FastPersistSaveStrategy() per save on megatron's AsyncCallsQueue (forks a caller "
                                  "per save, which hands the job to our writer and becomes a small waiter)",
    "fastpersist_megatron_lm": "FastPersistSaveStrategy() per save on the queue Megatron-LM's --async-save gets "
                               "with fastpersist_dist.megatron_lm (ours for our saves: no caller forked)",
    "fastpersist": "FastPersistSaveStrategy() per save on AsyncSaveQueue (a thread per save; the rank's writer "
                   "process writes)",
    "fastpersist_tiered": "FastPersistSaveStrategy(local_dir=...) per save on AsyncSaveQueue: committed on the local "
                          "tier, then copied to the persistent tier in the background",
}
DEFAULT_LOOP_CONTENDERS = ("none", "torch_dist", "fastpersist_megatron_queue", "fastpersist_megatron_lm", "fastpersist")
