"""Megatron-LM's own checkpointing through FastPersist: one call before ``pretrain()``.

Megatron-LM's ``megatron/training/checkpointing.py`` builds its save strategy in
one place and its load strategy in one other, and leaves everything else to
megatron-core. :func:`enable` replaces exactly those two names in that module
(which names is the megatron-core contract's business:
``compat.TRAINING_STRATEGY_SEAMS``) with factories that return our strategies,
and the name of the ``FullyParallelSaveStrategyWrapper`` it puts around ours
(its default; off with ``--no-ckpt-fully-parallel-save``) with megatron's
wrapper reporting our backend (``compat.FullyParallelSaveWrapper``).
Its ``--async-save`` queue becomes :class:`~.megatron_lm_queue.MegatronLMQueue`
(the name Megatron-LM's ``megatron/training/async_utils.py`` makes it by:
``compat.MEGATRON_LM_ASYNC_SEAM``), which waits for our saves in a thread
instead of forking the trainer per save, and hands other requests to
megatron's queue. With tiers, Megatron-LM's and megatron-core's own calls on the
checkpoint directory while saving are kept off the persistent tier
(``megatron_lm_files.py``): a persistent tier that cannot be reached does not
stop training. All else stays Megatron-LM's: the ``checkpointing_context``
cache, the fully-parallel load wrapper, ``metadata.json``, the tracker file and
``--load``::

    import fastpersist_dist.megatron_lm
    fastpersist_dist.megatron_lm.enable()
    pretrain(...)

or, without editing the launcher::

    torchrun --nproc-per-node 8 -m fastpersist_dist.megatron_lm pretrain_gpt.py <its arguments>

The runner also takes Megatron-LM's flags for node-local checkpoints
(``--non-persistent-ckpt-type local``, ``--non-persistent-local-ckpt-dir``,
``--replication``, ``--replication-factor``) and gives them to a tiered save
(:func:`translate_local_flags`, docs/tiers.md) instead of nvidia-resiliency-ext.
"""

from __future__ import annotations

import importlib
import logging
import os
import runpy
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Optional

from .. import compat
from ..compat import seams
from ..strategies.fastpersist_load import FastPersistLoadStrategy
from ..strategies.fastpersist_save import FastPersistSaveStrategy
from ..util.config import TierConfig
from ..util.errors import FastPersistError
from .megatron_lm_files import local_first
from .megatron_lm_queue import queue_class

logger = logging.getLogger(__name__)

FRAMEWORK = "Megatron-LM"
TRAINING_MODULE = "megatron.training.checkpointing"
ASYNC_MODULE = "megatron.training.async_utils"  # where Megatron-LM makes its --async-save queue
ASYNC_FLAG = "--async-save"  # Megatron-LM's flag for asynchronous checkpoints
USAGE = "usage: python -m fastpersist_dist.megatron_lm SCRIPT [ARGS...]  (e.g. pretrain_gpt.py and its arguments)"


# Megatron-LM's flags for its node-local (nvidia-resiliency-ext) checkpoints, which a tiered save takes over
TYPE_FLAG, LOCAL_DIR_FLAG = "--non-persistent-ckpt-type", "--non-persistent-local-ckpt-dir"
REPLICATION_FLAG, FACTOR_FLAG = "--replication", "--replication-factor"
DROPPED_FLAGS = ("--replication-jump", "--non-persistent-local-ckpt-algo")  # no meaning here: replica nodes are
# chosen across failure domains (FASTPERSIST_FAILURE_DOMAIN), and every save is ours
GLOBAL_DIR_FLAG, SAVE_FLAG = "--non-persistent-global-ckpt-dir", "--save"
NON_PERSISTENT_SUBDIR = "non_persistent"  # Megatron-LM's default home of non-persistent checkpoints, under --save
DEFAULT_FACTOR = 2  # Megatron-LM's --replication-factor: the machines holding a rank's data, its own included
# The runner's own flags for what Megatron-LM has no flag for (TierConfig's), taken out before Megatron-LM parses
KEEP_LOCAL_FLAG = "--fastpersist-keep-local"
RUNNER_FLAGS = (KEEP_LOCAL_FLAG,)


@dataclass(frozen=True)
class LocalCheckpointFlags:
    """Megatron-LM's arguments with its local-checkpoint flags translated, and the tiers they ask for."""

    argv: list[str]
    tiers: Optional[TierConfig]  # None: no local checkpoints asked for


def translate_local_flags(argv: list[str]) -> LocalCheckpointFlags:
    """Megatron-LM's node-local checkpoint flags onto a tiered save. Pure.

    ``--non-persistent-ckpt-type local --non-persistent-local-ckpt-dir DIR``:
    every checkpoint is written to ``DIR`` on each node first. ``--replication
    --replication-factor F``: ``F - 1`` other nodes keep replicas. Megatron-LM's
    non-persistent checkpoints (``--non-persistent-save-interval``) become its
    ``global`` ones, under ``--non-persistent-global-ckpt-dir`` (default
    ``SAVE/non_persistent``), which stay local (replicated, never copied to the
    persistent tier); its persistent ones (``--save-interval``) are copied to
    ``--save`` in the background. The runner's own ``--fastpersist-keep-local
    N`` sets ``TierConfig``'s ``keep_local`` (with local checkpoints only).
    Other arguments pass unchanged.
    """
    values: dict[str, Optional[str]] = {}
    rest: list[str] = []
    takes_value = (TYPE_FLAG, LOCAL_DIR_FLAG, FACTOR_FLAG, KEEP_LOCAL_FLAG, *DROPPED_FLAGS)
    switches = (REPLICATION_FLAG,)
    i = 0
    while i < len(argv):
        flag, eq, value = argv[i].partition("=")
        if flag in takes_value:
            if not eq:
                if i + 1 >= len(argv):
                    raise FastPersistError(f"{flag} needs a value")
                value, i = argv[i + 1], i + 1
            values[flag] = value
        elif flag in switches and not eq:
            values[flag] = None
        else:
            rest.append(argv[i])
        i += 1
    ours = [f for f in RUNNER_FLAGS if f in values]
    if values.get(TYPE_FLAG) != "local":
        if ours:
            raise FastPersistError(f"{', '.join(ours)}: settings of local checkpoints, which need {TYPE_FLAG} local")
        return LocalCheckpointFlags(list(argv), None)  # no local checkpoints: Megatron-LM's arguments as they were
    local_dir = values.get(LOCAL_DIR_FLAG)
    if not local_dir:
        raise FastPersistError(f"{TYPE_FLAG} local needs {LOCAL_DIR_FLAG} DIR: the node-local directory, the same "
                               "path on every node")
    factor = int(values.get(FACTOR_FLAG) or DEFAULT_FACTOR) if REPLICATION_FLAG in values else 1
    if factor < 1:
        raise FastPersistError(f"{FACTOR_FLAG} {factor}: it counts the machines holding a rank's data, at least 1")
    non_persistent = _value(rest, GLOBAL_DIR_FLAG)
    if non_persistent is None:
        save = _value(rest, SAVE_FLAG)
        non_persistent = os.path.join(save, NON_PERSISTENT_SUBDIR) if save else None
    try:
        keep = values.get(KEEP_LOCAL_FLAG)
        tiers = TierConfig(os.path.abspath(local_dir), replicas=factor - 1, local_only_under=non_persistent,
                           keep_local=int(keep) if keep else TierConfig.keep_local)
    except ValueError as e:
        raise FastPersistError(f"{' '.join(ours)}: {e}") from e
    return LocalCheckpointFlags([*rest, TYPE_FLAG, "global"], tiers)


def _value(argv: list[str], flag: str) -> Optional[str]:
    """The value of ``flag`` in ``argv`` (``--flag V`` or ``--flag=V``; the last one), None without it."""
    found = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            found = argv[i + 1]
        elif arg.startswith(flag + "="):
            found = arg[len(flag) + 1:]
    return found


def _megatron_lm_module(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise FastPersistError(
            f"fastpersist_dist.megatron_lm needs Megatron-LM's {name} importable (put the "
            f"Megatron-LM checkout on PYTHONPATH): {e}"
        ) from e


def enable(checkpoint_format: str = "torch_dist", *, target: Optional[ModuleType] = None,
           async_target: Optional[ModuleType] = None, **knobs: Any) -> FastPersistSaveStrategy:
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
        async_target: the module whose async queue name to replace; default
            Megatron-LM's ``megatron.training.async_utils`` where ``target`` is
            not given, none where it is.
        knobs: :class:`FastPersistSaveStrategy` knobs (``io_buffer_mb`` ...).
    """
    module = target if target is not None else _megatron_lm_module(TRAINING_MODULE)
    if async_target is None and target is None:
        async_target = _megatron_lm_module(ASYNC_MODULE)
    save_name, load_name = compat.TRAINING_STRATEGY_SEAMS
    save_strategy = FastPersistSaveStrategy(checkpoint_format, **knobs)
    replacements = {**seams.factories({save_name: save_strategy, load_name: FastPersistLoadStrategy()}),
                    compat.WRAPPER_SEAM: compat.FullyParallelSaveWrapper}
    # with tiers, megatron's and Megatron-LM's own calls while saving kept off the persistent tier
    replacements.update(local_first(lambda name: seams.original(FRAMEWORK, module, name), save_strategy.tiers))
    mismatch = "the way the one released with the installed megatron-core does; use matching versions"
    seams.replace(FRAMEWORK, [module], replacements, mismatch)
    if async_target is not None:
        seam = compat.MEGATRON_LM_ASYNC_SEAM
        current = seams.original(FRAMEWORK, async_target, seam)  # None: replace() says the module lacks it
        replacement = None if current is None else compat.megatron_lm_async_replacement(current, queue_class)
        seams.replace(FRAMEWORK, [async_target], {seam: replacement}, mismatch)
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
    """``python -m fastpersist_dist.megatron_lm SCRIPT ARGS``: enable (Megatron-LM's local-checkpoint flags
    translated), then run SCRIPT as ``python SCRIPT ARGS`` would."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        raise SystemExit(0 if argv else 2)
    script = argv[0]
    if not os.path.isfile(script):
        raise SystemExit(f"fastpersist_dist.megatron_lm: no such script: {script}\n{USAGE}")
    flags = translate_local_flags(argv[1:])
    sys.argv = [script, *flags.argv]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as for `python SCRIPT` (a Megatron-LM checkout's
    if flags.tiers is not None:                               # pretrain_gpt.py: its megatron.training imports)
        (logger.info if os.environ.get("RANK", "0") == "0" else logger.debug)(
            "fastpersist: Megatron-LM's local checkpoints go to %s on each node with %d replicas, the last %d kept "
            "there; persistent ones are then copied to --save, non-persistent ones (under %s) stay local",
            flags.tiers.local_dir, flags.tiers.replicas, flags.tiers.keep_local, flags.tiers.local_only_under)
    enable(tiers=flags.tiers)
    runpy.run_path(script, run_name="__main__")
