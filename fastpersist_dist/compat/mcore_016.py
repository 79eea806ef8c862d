"""Adapter for megatron-core <= 0.16: strategy registry, ``base.py`` strategy classes.

``save()`` uses any ``AsyncSaveShardedStrategy`` it is given and writes
``common.pt`` itself; ``load()`` picks the loader registered for the backend
named in ``metadata.json``. The native ``fastpersist`` format is the default.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from megatron.core.dist_checkpointing.strategies import torch as torch_strategies
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue, AsyncRequest
from megatron.core.dist_checkpointing.strategies.base import (
    AsyncSaveShardedStrategy,
    LoadShardedStrategy,
    StrategyAction,
    default_strategies,
    register_default_strategy,
)
from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

from . import seams

DEFAULT_FORMAT = "fastpersist"
# Keyword arguments of megatron's save() for an AsyncRequest that megatron's or our queue runs.
ASYNC_SAVE_KWARGS: dict = {}
SaveStrategyBase = AsyncSaveShardedStrategy
LoadStrategyBase = LoadShardedStrategy
# What Megatron-LM's megatron/training/checkpointing.py (released with this megatron-core) calls, once
# each, to build its save and load strategies: ``get_default_save_sharded_strategy(args.ckpt_format)``
# and ``get_default_load_sharded_strategy(checkpoint_dir)`` (core_v0.16.1). fastpersist_dist.megatron_lm
# replaces these two names there.
TRAINING_STRATEGY_SEAMS = ("get_default_save_sharded_strategy", "get_default_load_sharded_strategy")
# The name Megatron-LM's megatron/training/async_utils.py (released with this megatron-core) makes its
# --async-save queue by: megatron-core's AsyncCallsQueue class, imported there by name.
MEGATRON_LM_ASYNC_SEAM = "AsyncCallsQueue"


def megatron_lm_async_replacement(current: Any, queue_class: Callable[[Any], Any]) -> Any:
    """What stands in for ``MEGATRON_LM_ASYNC_SEAM``: the class ``queue_class`` makes around megatron's."""
    return queue_class(current)


# megatron's fully-parallel save wrapper reports the backend of the strategy it wraps here (0.17+'s does not).
FullyParallelSaveWrapper = FullyParallelSaveStrategyWrapper


def request_type(async_strategy: Optional[str]) -> Callable[[Callable[..., None], tuple, list], AsyncRequest]:
    """How to make the request megatron's (and our) async queue runs; 0.16 has one kind of queue."""
    return AsyncRequest


def megatron_async_queue_class() -> type:
    """megatron's own queue class of async requests (its temporal caller forks a process per request)."""
    return AsyncCallsQueue


def stock_load(sharded_state_dict: Any, checkpoint_dir: str, async_strategy: Optional[str]) -> Any:
    """megatron's own loader, for torch_dist checkpoints that have no FastPersist sidecar."""
    return TorchDistLoadShardedStrategy().load(sharded_state_dict, checkpoint_dir)


# What get_default_strategy() calls before every lookup, re-registering megatron's own torch_dist strategies.
TORCH_DEFAULTS_SEAM = "register_default_torch_strategies"


class _TorchDefaultsThenOurLoader:
    """megatron's torch_dist registrations, then our loader registered over its torch_dist loader.

    Registering ours once would not last: megatron registers its own again
    before every lookup. Ours hands checkpoints without our sidecar index
    (megatron's own) to megatron's loader unchanged.
    """

    def __init__(self, megatrons: Callable[[], None], load_strategy: Any, backend: str, version: int):
        self.megatrons, self.load_strategy, self.key = megatrons, load_strategy, (backend, version)

    def __call__(self) -> None:
        self.megatrons()
        register_default_strategy(StrategyAction.LOAD_SHARDED, *self.key, self.load_strategy)


def register(save_strategy: Any, load_strategy: Any, native: Any, torch_dist: Any) -> None:
    """Register our save and load strategies for the native format and our loader for torch_dist; idempotent.

    ``native``, ``torch_dist``: the formats (``backend``, ``version``). With
    the loader registered for both, a plain ``load(sd, dir)`` verifies the
    checksums of either format.
    """
    key = (native.backend, native.version)
    if key not in default_strategies[StrategyAction.SAVE_SHARDED.value]:
        register_default_strategy(StrategyAction.SAVE_SHARDED, *key, save_strategy)
    if key not in default_strategies[StrategyAction.LOAD_SHARDED.value]:
        register_default_strategy(StrategyAction.LOAD_SHARDED, *key, load_strategy)
    megatrons = getattr(torch_strategies, TORCH_DEFAULTS_SEAM)
    if not isinstance(megatrons, _TorchDefaultsThenOurLoader):
        hook = _TorchDefaultsThenOurLoader(megatrons, load_strategy, torch_dist.backend, torch_dist.version)
        seams.replace(seams.MEGATRON_CORE, [torch_strategies], {TORCH_DEFAULTS_SEAM: hook}, "as megatron-core 0.16 does")
        hook()
