"""Adapter for megatron-core >= 0.17 (tested on 0.19.2): no registry, torch_dist-only ``save()``.

``save()`` silently replaces every strategy that is not a
``TorchDistSaveShardedStrategy`` (or the fully-parallel wrapper), so ours
subclasses it, overriding ``save``/``async_save`` entirely. ``load()`` defaults
to ``TorchDistLoadShardedStrategy``: the ``torch_dist`` format (DCP files) is
therefore the default here, so a plain ``load(sd, dir)`` reads our checkpoints.
Async requests are built by the class ``get_async_strategy`` names for the
caller's ``async_strategy`` ("mcore" or "nvrx"). The common state: 0.17 and
0.18 write ``common.pt`` themselves (and load needs it); 0.19 passes it as a
``common_state`` ShardedObject, stored like any object, and on request also
committed as ``common.pt``, which megatron-core <= 0.18 needs to load it.
(0.17.1 and 0.18.2 were read, not run: their save/load/async entry points are
the ones used here.)
"""

from __future__ import annotations

import io
from typing import Any, Callable, Optional

import torch
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.strategies.torch import (
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
    get_async_strategy,
)

from ..errors import FastPersistError

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
COMMON_STATE_KEY = "common_state"  # the ShardedObject megatron's save() adds
COMMON_FILE = "common.pt"  # where megatron-core <= 0.16 looks for it


def request_type(async_strategy: Optional[str]) -> Callable[[Callable[..., None], tuple, list], Any]:
    """The ``AsyncRequest`` class of the caller's queue: ``"mcore"`` (default) or ``"nvrx"``.

    Raises megatron's own error when nvidia-resiliency-ext is missing for "nvrx".
    """
    return get_async_strategy(async_strategy or "mcore", "AsyncRequest")[1]


def megatron_async_queue() -> Any:
    """megatron's own queue for ``async_strategy="mcore"`` (``AsyncCallsQueue``)."""
    return get_async_strategy("mcore", "AsyncCallsQueue")[1]()


def common_files(sharded_state_dict: dict, rank: int, write_common_pt: bool) -> dict[str, bytes]:
    """``common.pt`` (rank 0, when asked) holding the common state, as megatron-core <= 0.16 wrote it."""
    common = sharded_state_dict.get(COMMON_STATE_KEY)
    if not write_common_pt or rank != 0 or not isinstance(common, ShardedObject):
        return {}
    buf = io.BytesIO()
    torch.save(common.data, buf)
    return {COMMON_FILE: buf.getvalue()}


def strategy_input(sharded: dict, common: dict, rank: int) -> dict:
    """What ``save()`` hands the save strategy: the sharded part plus the common state as a ShardedObject."""
    return {**sharded, COMMON_STATE_KEY: ShardedObject(COMMON_STATE_KEY, common, (1,), (0,), replica_id=rank)}


def stock_load(sharded_state_dict: Any, checkpoint_dir: str, async_strategy: Optional[str]) -> Any:
    """megatron's own loader, for torch_dist checkpoints that have no FastPersist sidecar."""
    return TorchDistLoadShardedStrategy().load(sharded_state_dict, checkpoint_dir, async_strategy or "mcore")


def register(save_strategy: Any, load_strategy: Any, backend: str, version: int) -> None:
    """There is no registry to join: say how to use the strategies instead."""
    raise FastPersistError(
        "megatron-core 0.17+ has no strategy registry (megatron's save() would silently replace a "
        f"registered ({backend!r}, {version}) strategy): pass sharded_strategy=FastPersistSaveStrategy() "
        "to dist_checkpointing.save; its default torch_dist format loads with a plain dist_checkpointing.load"
    )
