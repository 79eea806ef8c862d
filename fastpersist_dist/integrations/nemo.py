"""NeMo's checkpoints through FastPersist: one call before the trainer saves or loads.

NeMo 2's ``MegatronCheckpointIO`` (``nemo.lightning.io.pl``, the checkpoint IO
of its ``MegatronStrategy``) and NeMo 1's ``DistributedCheckpointIO``
(``nemo.utils.callbacks.dist_ckpt_io``) build their ``dist_checkpointing``
strategies by calling ``get_default_save_sharded_strategy`` (or
``TorchDistSaveShardedStrategy`` when ``torch_dist_multiproc`` is set) and, for
``parallel_load=True``, ``get_default_load_sharded_strategy``, imported from
megatron-core into those two modules. :func:`enable` replaces exactly these
names there, and the name of the ``FullyParallelSaveStrategyWrapper`` that its
``parallel_save`` (default) puts around ours with megatron's wrapper reporting
our backend (``compat.FullyParallelSaveWrapper``). Everything else stays NeMo's:
``AsyncFinalizableCheckpointIO`` and its megatron ``AsyncCallsQueue`` for
``async_save=True``, the ``weights/`` subdirectory, ``metadata.json``, resume::

    import fastpersist_dist.nemo
    fastpersist_dist.nemo.enable()
    trainer.fit(model, data)  # or llm.pretrain(...)

NeMo 2.0 to 2.7 run on megatron-core up to 0.18 (0.19 removed the
``strategies/base.py`` they import); NeMo 3 has no LLM collection (its successor
is Megatron-Bridge).
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Any

from .. import compat
from ..compat import seams
from ..engine.tiers.background import remove_checkpoint
from ..strategies.fastpersist_load import FastPersistLoadStrategy
from ..strategies.fastpersist_save import FastPersistSaveStrategy
from ..util.errors import FastPersistError

logger = logging.getLogger(__name__)

FRAMEWORK = "NeMo"
CHECKPOINT_IO_MODULES = ("nemo.lightning.io.pl", "nemo.utils.callbacks.dist_ckpt_io")  # NeMo 2's, NeMo 1's
SAVE_NAMES = ("get_default_save_sharded_strategy", "TorchDistSaveShardedStrategy")
LOAD_NAMES = ("get_default_load_sharded_strategy",)
MISMATCH = ("as NeMo 2.0-2.7's MegatronCheckpointIO does (nemo.lightning.io.pl on megatron-core <= 0.18); "
            "NeMo 3 and Megatron-Bridge are not supported")
STRATEGY_MODULE = "nemo.lightning.pytorch.strategies.megatron_strategy"  # its MegatronStrategy removes checkpoints
REMOVAL = "remove_checkpoint"


def _remove_when_safe(strategy: Any, filepath: Any) -> None:
    """``MegatronStrategy.remove_checkpoint`` with tiered saves: NeMo's removal of an older checkpoint
    (``save_top_k``), on global rank 0, handed to :func:`fastpersist_dist.remove_checkpoint`, which removes it
    once the checkpoints saved before the call are durable (a link, NeMo's ``-last``, goes at once)."""
    from nemo.lightning.ckpt_utils import ckpt_to_dir

    ckpt = ckpt_to_dir(filepath)
    if os.path.islink(ckpt):  # NeMo's own removal unlinks a link (on global rank 0) and leaves its target
        megatron_strategy = _checkpoint_io_module(STRATEGY_MODULE).MegatronStrategy
        seams.original(FRAMEWORK, megatron_strategy, REMOVAL)(strategy, filepath)
    elif strategy.is_global_zero:
        remove_checkpoint(str(ckpt))


def _checkpoint_io_module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise FastPersistError(f"fastpersist_dist.nemo needs NeMo's {name} importable "
                               f"(pip install 'nemo_toolkit[lightning]'): {e}") from e


def enable(checkpoint_format: str = "torch_dist", *, async_save: bool = False, **knobs: Any) -> FastPersistSaveStrategy:
    """Make NeMo's distributed checkpoints save and load through FastPersist in this process.

    Call once per process before the first save or load (again to change
    settings); returns the save strategy. Keep NeMo's own ``save_ckpt_format``
    at ``"torch_dist"`` (its async path refuses other names); what is written
    is chosen here.

    Args:
        checkpoint_format: ``"torch_dist"`` (default: torch DCP files that NeMo
            without FastPersist loads, plus our checksum sidecar) or
            ``"fastpersist"`` (native; faster loads, read only through FastPersist).
        async_save: NeMo's ``async_save=True`` is in use: start the rank's writer
            process now (its aio handle and locked buffer), not inside the first
            checkpoint's write.
        knobs: :class:`FastPersistSaveStrategy` knobs (``io_buffer_mb`` ...). With tiers (``local_dir``,
            ``tiers``) NeMo's ``MegatronStrategy`` also removes the checkpoints its ``save_top_k`` gives up
            through :func:`fastpersist_dist.remove_checkpoint`: never before the newer ones are durable.

    Loads verify checksums through our loader in both formats: NeMo's
    ``parallel_load=True`` hands it ours, and otherwise megatron-core's default
    loader is ours since ``import fastpersist_dist`` (``registry``).
    """
    modules = [_checkpoint_io_module(name) for name in CHECKPOINT_IO_MODULES]
    # Each module imports its megatron-core names in one try block and leaves them all out where one import
    # fails (NeMo 1's also imports the tensorstore strategy): such a module cannot save at all; NeMo 2's must.
    modules = modules[:1] + [module for module in modules[1:] if getattr(module, "HAVE_MEGATRON_CORE", True)]
    save_strategy = FastPersistSaveStrategy(checkpoint_format, **knobs)
    load_strategy = FastPersistLoadStrategy()
    replacements = {**seams.factories({**dict.fromkeys(SAVE_NAMES, save_strategy),
                                       **dict.fromkeys(LOAD_NAMES, load_strategy)}),
                    compat.WRAPPER_SEAM: compat.FullyParallelSaveWrapper}
    seams.restore(FRAMEWORK)  # each call starts from NeMo's own names
    seams.replace(FRAMEWORK, modules, replacements, MISMATCH)
    if save_strategy.tiers is not None:
        megatron_strategy = _checkpoint_io_module(STRATEGY_MODULE).MegatronStrategy
        seams.replace(FRAMEWORK, [megatron_strategy], {REMOVAL: _remove_when_safe}, MISMATCH)
    (logger.info if os.environ.get("RANK", "0") == "0" else logger.debug)(
        "fastpersist: NeMo checkpoints (%s) now save with FastPersistSaveStrategy(%r) and load with "
        "FastPersistLoadStrategy (checksums verified) where NeMo asks for a strategy%s",
        ", ".join(CHECKPOINT_IO_MODULES), checkpoint_format,
        "" if save_strategy.tiers is None else
        f"; tiered (local tier {save_strategy.tiers.local_dir}): MegatronStrategy removes a checkpoint once the "
        "checkpoints saved before are durable",
    )
    if async_save:
        save_strategy.load_ops()
    return save_strategy


def disable() -> None:
    """Give NeMo its own strategies back (no-op when not enabled)."""
    seams.restore(FRAMEWORK)
