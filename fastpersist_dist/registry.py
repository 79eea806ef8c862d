"""Registration of the FastPersist strategies with megatron-core.

After ``import fastpersist_dist``, ``dist_checkpointing.save(...,
sharded_strategy=('fastpersist', 1))`` works, and ``dist_checkpointing.load``
picks our loader from a checkpoint's ``metadata.json`` unasked. Megatron keeps
one shared instance per (action, backend, version); ours hold no per-save state.
"""

from megatron.core.dist_checkpointing.strategies.base import (
    StrategyAction,
    default_strategies,
    register_default_strategy,
)

from .format import BACKEND, BACKEND_VERSION
from .strategies.fastpersist_load import FastPersistLoadStrategy
from .strategies.fastpersist_save import FastPersistSaveStrategy


def register() -> None:
    """Register the default save and load strategies for ('fastpersist', 1); idempotent."""
    key = (BACKEND, BACKEND_VERSION)
    if key not in default_strategies[StrategyAction.SAVE_SHARDED.value]:
        register_default_strategy(StrategyAction.SAVE_SHARDED, BACKEND, BACKEND_VERSION, FastPersistSaveStrategy())
    if key not in default_strategies[StrategyAction.LOAD_SHARDED.value]:
        register_default_strategy(StrategyAction.LOAD_SHARDED, BACKEND, BACKEND_VERSION, FastPersistLoadStrategy())
