"""Megatron-LM's own checkpointing through FastPersist: one call before ``pretrain()``.

Megatron-LM's ``megatron/training/checkpointing.py`` builds its save strategy in
one place and its load strategy in one other, and leaves everything else to
megatron-core. :func:`enable` replaces exactly those two names in that module
(which names is the megatron-core contract's business:
``compat.TRAINING_STRATEGY_SEAMS``) with factories that return our strategies,
and the name of the ``FullyParallelSaveStrategyWrapper`` it puts around ours
(its default; off with ``--no-ckpt-fully-parallel-save``) with megatron's
wrapper reporting our backend (``compat.FullyParallelSaveWrapper``).
All else stays Megatron-LM's: the ``checkpointing_context`` cache, the
fully-parallel load wrapper,
``--async-save`` (its ``AsyncCallsQueue`` runs our ``AsyncRequest``),
``metadata.json``, the tracker file and ``--load``::

    import fastpersist_dist.megatron_lm
    fastpersist_dist.megatron_lm.enable()
    pretrain(...)

or, without editing the launcher::

    torchrun --nproc-per-node 8 -m fastpersist_dist.megatron_lm pretrain_gpt.py <its arguments>
"""

from __future__ import annotations

import importlib
import logging
import os
import runpy
import sys
from types import ModuleType
from typing import Any, Optional

from .. import compat
from ..compat import seams
from ..strategies.fastpersist_load import FastPersistLoadStrategy
from ..strategies.fastpersist_save import FastPersistSaveStrategy
from ..util.errors import FastPersistError

logger = logging.getLogger(__name__)

FRAMEWORK = "Megatron-LM"
TRAINING_MODULE = "megatron.training.checkpointing"
ASYNC_FLAG = "--async-save"  # Megatron-LM's flag for asynchronous checkpoints
USAGE = "usage: python -m fastpersist_dist.megatron_lm SCRIPT [ARGS...]  (e.g. pretrain_gpt.py and its arguments)"


def _training_module() -> ModuleType:
    try:
        return importlib.import_module(TRAINING_MODULE)
    except ImportError as e:
        raise FastPersistError(
            f"fastpersist_dist.megatron_lm needs Megatron-LM's {TRAINING_MODULE} importable (put the "
            f"Megatron-LM checkout on PYTHONPATH): {e}"
        ) from e


def enable(checkpoint_format: str = "torch_dist", *, target: Optional[ModuleType] = None,
           **knobs: Any) -> FastPersistSaveStrategy:
    """Make Megatron-LM's save and load path use FastPersist in this process; returns the save strategy.

    Call once per process before ``pretrain()`` (again to change settings).
    Megatron-LM must run with ``--ckpt-format torch_dist`` (its default). With
    ``--async-save`` among the process's arguments (``sys.argv``, which
    ``pretrain()`` parses), the rank's writer process also starts now and makes
    its aio handle and locked buffer while Megatron-LM builds the model, instead
    of inside the first checkpoint's write (``load_ops()`` of the strategy).

    Args:
        checkpoint_format: ``"torch_dist"`` (default: torch DCP files any
            Megatron-LM loads, plus our checksum sidecar) or ``"fastpersist"``
            (native; faster loads, read only through FastPersist).
        target: the module whose strategy names to replace; default Megatron-LM's
            ``megatron.training.checkpointing``.
        knobs: :class:`FastPersistSaveStrategy` knobs (``io_buffer_mb`` ...).
    """
    module = target if target is not None else _training_module()
    save_name, load_name = compat.TRAINING_STRATEGY_SEAMS
    save_strategy = FastPersistSaveStrategy(checkpoint_format, **knobs)
    replacements = {**seams.factories({save_name: save_strategy, load_name: FastPersistLoadStrategy()}),
                    compat.WRAPPER_SEAM: compat.FullyParallelSaveWrapper}
    seams.replace(FRAMEWORK, [module], replacements,
                  "the way the one released with the installed megatron-core does; use matching versions")
    (logger.info if os.environ.get("RANK", "0") == "0" else logger.debug)(
        "fastpersist: Megatron-LM checkpoints (%s) now save with FastPersistSaveStrategy(%r) in place of %s "
        "and load with FastPersistLoadStrategy (checksums verified) in place of %s",
        module.__name__, checkpoint_format, save_name, load_name,
    )
    if ASYNC_FLAG in sys.argv:
        save_strategy.load_ops()
    return save_strategy


def disable() -> None:
    """Give Megatron-LM its own strategies back (no-op when not enabled)."""
    seams.restore(FRAMEWORK)


def main(argv: Optional[list[str]] = None) -> None:
    """``python -m fastpersist_dist.megatron_lm SCRIPT ARGS``: enable, then run SCRIPT as ``python SCRIPT ARGS`` would."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        raise SystemExit(0 if argv else 2)
    script = argv[0]
    if not os.path.isfile(script):
        raise SystemExit(f"fastpersist_dist.megatron_lm: no such script: {script}\n{USAGE}")
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as for `python SCRIPT` (a Megatron-LM checkout's
    enable()                                                  # pretrain_gpt.py: its megatron.training imports)
    runpy.run_path(script, run_name="__main__")
