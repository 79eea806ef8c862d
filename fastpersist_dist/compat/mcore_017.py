"""Adapter for megatron-core >= 0.17 (tested on 0.17.1, 0.18.2, 0.19.2): no registry, torch_dist-only ``save()``.

``save()`` silently replaces every strategy that is not a
``TorchDistSaveShardedStrategy`` (or the fully-parallel wrapper), so ours
subclasses it, overriding ``save``/``async_save`` entirely. ``load()`` builds
``TorchDistLoadShardedStrategy()`` when given no strategy: the ``torch_dist``
format (DCP files) is therefore the default here, so that megatron's own
loader reads our checkpoints, and :func:`register` makes ``load()`` build ours
instead, which verifies them (and reads the native format) and hands every
other checkpoint to megatron's.
Async requests are built by the class ``get_async_strategy`` names for the
caller's ``async_strategy`` ("mcore" or "nvrx"). Who writes the common state
is a separate question (``common_pt_by_megatron``, ``common_state_object``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from megatron.core.dist_checkpointing import serialization
from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
from megatron.core.dist_checkpointing.strategies.torch import (
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
    get_async_strategy,
)

from . import seams

DEFAULT_FORMAT = "torch_dist"
# Keyword arguments of megatron's save() for an AsyncRequest that megatron's or our queue runs
# (its default, "nvrx", needs nvidia-resiliency-ext).
ASYNC_SAVE_KWARGS: dict = {"async_strategy": "mcore"}
SaveStrategyBase = TorchDistSaveShardedStrategy
LoadStrategyBase = TorchDistLoadShardedStrategy
# What Megatron-LM's megatron/training/checkpointing.py (released with this megatron-core) calls, once
# each, to build its save and load strategies: the two classes themselves, constructed with Megatron-LM's
# options (core_v0.17.1, core_v0.18.2, core_r0.19.0). fastpersist_dist.megatron_lm replaces these two
# names there.
TRAINING_STRATEGY_SEAMS = ("TorchDistSaveShardedStrategy", "TorchDistLoadShardedStrategy")
# The name Megatron-LM's megatron/training/async_utils.py makes its --async-save queue through: megatron-core's
# get_async_strategy(args.async_strategy), whose "AsyncCallsQueue" it constructs (0.17.1, 0.18.2, 0.19.2).
MEGATRON_LM_ASYNC_SEAM = "get_async_strategy"
QUEUE_MODULE = "AsyncCallsQueue"


def megatron_lm_async_replacement(current: Any, queue_class: Callable[[Any], Any]) -> Any:
    """What stands in for ``MEGATRON_LM_ASYNC_SEAM``: ``get_async_strategy`` answering, for the queue, the class
    ``queue_class`` makes around the one megatron's answers; everything else as megatron's."""

    def get_async_strategy(async_strategy: str = "nvrx", module: Optional[str] = None) -> tuple:
        strategy, found = current(async_strategy, module)
        if module == QUEUE_MODULE:
            return strategy, queue_class(found)
        if module is None:
            return strategy, {**found, QUEUE_MODULE: queue_class(found[QUEUE_MODULE])}
        return strategy, found

    return get_async_strategy


class FullyParallelSaveWrapper(FullyParallelSaveStrategyWrapper):
    """megatron's fully-parallel save wrapper, reporting the backend of the strategy it wraps.

    0.17+'s wrapper reports its own ``backend="torch_dist"`` whatever it wraps
    (0.16's reports the wrapped strategy's), and ``save()`` writes
    ``metadata.json`` from the wrapper: a native checkpoint saved through it
    said "torch_dist" there, so ``verify`` refused it and megatron-core 0.16's
    ``load()`` picked its torch_dist loader for it. Megatron-LM and NeMo build
    the wrapper by this name, which ``megatron_lm.enable()`` and
    ``nemo.enable()`` replace with this class.
    """

    def __init__(self, strategy: Any, *args: Any, **kwargs: Any):
        if len(args) < 3:  # args: (parallelization_group, do_cache_distribution, backend, version)
            kwargs.setdefault("backend", strategy.backend)
            kwargs.setdefault("version", strategy.version)
        super().__init__(strategy, *args, **kwargs)


def request_type(async_strategy: Optional[str]) -> Callable[[Callable[..., None], tuple, list], Any]:
    """The ``AsyncRequest`` class of the caller's queue: ``"mcore"`` (default) or ``"nvrx"``.

    Raises megatron's own error when nvidia-resiliency-ext is missing for "nvrx".
    """
    return get_async_strategy(async_strategy or "mcore", "AsyncRequest")[1]


def megatron_async_queue_class() -> type:
    """megatron's own queue class for ``async_strategy="mcore"`` (``AsyncCallsQueue``)."""
    return get_async_strategy("mcore", "AsyncCallsQueue")[1]


def stock_load(sharded_state_dict: Any, checkpoint_dir: str, async_strategy: Optional[str]) -> Any:
    """megatron's own loader, for torch_dist checkpoints that have no FastPersist sidecar."""
    return TorchDistLoadShardedStrategy().load(sharded_state_dict, checkpoint_dir, async_strategy or "mcore")


# The name megatron-core's load(), load_tensors_metadata(), load_sharded_metadata() and
# get_default_load_sharded_strategy() build their default loader by, in serialization.py (0.17.1-0.19.2).
DEFAULT_LOADER_SEAM = "TorchDistLoadShardedStrategy"


def register(save_strategy: Any, load_strategy: Any, native: Any, torch_dist: Any) -> None:
    """Make ``load()`` with no strategy use ``load_strategy``; there is no registry for ``save_strategy``.

    As with the loaders registered on 0.16, a plain ``load(sd, dir)`` verifies
    the checksums of our checkpoints and reads the native format too (megatron's
    own loader checks nothing, and cannot read the native format). Ours hands a
    torch DCP checkpoint without our sidecar index (megatron's own, any DCP
    writer's) to megatron's loader unchanged. ``save()`` replaces any strategy
    that is not a ``TorchDistSaveShardedStrategy``, a ``(backend, version)``
    tuple included, so ours is passed as an instance. Idempotent.
    """
    del save_strategy, native, torch_dist
    seams.replace(seams.MEGATRON_CORE, [serialization], seams.factories({DEFAULT_LOADER_SEAM: load_strategy}),
                  "as megatron-core 0.17.1-0.19.2 do")
