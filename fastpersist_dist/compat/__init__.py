"""The one place that knows which megatron-core is installed.

megatron-core changed its strategy contract in 0.17: the strategy registry is
gone (0.19 also deleted ``strategies/base.py``), ``save()`` keeps only
``TorchDistSaveShardedStrategy`` subclasses, ``load()`` passes an
``async_strategy`` and async requests come from ``get_async_strategy``. Each
contract has a thin adapter module exporting the same names; the engine and
the strategies import them from here and never test versions themselves.
Separately, 0.19 stopped writing ``common.pt`` in ``save()`` and hands the
common state to the strategy instead: two more thin modules, picked the same way.
"""

from __future__ import annotations

import importlib.util

from megatron.core.dist_checkpointing import serialization as _serialization

if importlib.util.find_spec("megatron.core.dist_checkpointing.strategies.base") is not None:
    from megatron.core.dist_checkpointing.strategies import base as _base

    _HAS_REGISTRY = hasattr(_base, "register_default_strategy")
else:
    _HAS_REGISTRY = False

if _HAS_REGISTRY:
    from . import mcore_016 as _adapter
else:
    from . import mcore_017 as _adapter  # type: ignore[no-redef]

# save() writes common.pt itself on megatron-core <= 0.16 (through its registered common strategy) and on
# 0.17/0.18 (serialization.save_common); 0.19 hands the common state to the sharded strategy instead.
if _HAS_REGISTRY or hasattr(_serialization, "save_common"):
    from . import common_pt_by_megatron as _common
else:
    from . import common_state_object as _common  # type: ignore[no-redef]

from .metadata_json import megatron_config  # noqa: E402 - every version's, after the picks above

REGISTRY = _HAS_REGISTRY  # save() and load() look strategies up by (backend, version)
DEFAULT_FORMAT = _adapter.DEFAULT_FORMAT
ASYNC_SAVE_KWARGS = _adapter.ASYNC_SAVE_KWARGS
SaveStrategyBase = _adapter.SaveStrategyBase
LoadStrategyBase = _adapter.LoadStrategyBase
request_type = _adapter.request_type
megatron_async_queue_class = _adapter.megatron_async_queue_class
common_files = _common.common_files
stock_load = _adapter.stock_load
strategy_input = _common.strategy_input
register = _adapter.register
TRAINING_STRATEGY_SEAMS = _adapter.TRAINING_STRATEGY_SEAMS
MEGATRON_LM_ASYNC_SEAM = _adapter.MEGATRON_LM_ASYNC_SEAM
megatron_lm_async_replacement = _adapter.megatron_lm_async_replacement
FullyParallelSaveWrapper = _adapter.FullyParallelSaveWrapper
WRAPPER_SEAM = "FullyParallelSaveStrategyWrapper"  # the name Megatron-LM and NeMo build that wrapper by

__all__ = [
    "ASYNC_SAVE_KWARGS",
    "DEFAULT_FORMAT",
    "FullyParallelSaveWrapper",
    "REGISTRY",
    "LoadStrategyBase",
    "MEGATRON_LM_ASYNC_SEAM",
    "SaveStrategyBase",
    "TRAINING_STRATEGY_SEAMS",
    "WRAPPER_SEAM",
    "common_files",
    "megatron_async_queue_class",
    "megatron_config",
    "megatron_lm_async_replacement",
    "request_type",
    "register",
    "stock_load",
    "strategy_input",
]
