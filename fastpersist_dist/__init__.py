"""fastpersist-dist: a DeepSpeed DeepNVMe (FastPersist) backend for megatron-core dist_checkpointing.

Importing the package registers its strategies with megatron-core (``registry``):
on 0.16 the ('fastpersist', 1) save and load strategies in megatron's registry;
on 0.17+, which has no registry, our loader as ``load()``'s default. A rank's
writer process imports none of it (``util/roles.py``).

The package's layers, each importing only those below it (docs/development.md):
``tools`` (command line, verify, inspect, benchmarks) -> the megatron adapters
(``strategies``, ``registry``, ``integrations``, ``compat``) -> ``engine`` (save
and load orchestration, the commit protocol, writer processes) -> ``storage``
(bytes through DeepSpeed) and ``plan`` (who writes and reads which bytes) ->
``format`` (the on-disk format) -> ``util``.
"""

import os

from .util.quiet import QUIET_ENV, quiet_dependencies

if os.environ.get(QUIET_ENV) == "1":  # our command's processes (its writers too): first, before any dependency
    quiet_dependencies()

from .util.roles import IS_WRITER  # noqa: E402

if not IS_WRITER:  # a rank's writer process needs none of this (nor megatron-core): see util/roles.py
    # after the filters, which must precede the dependencies' import-time warnings
    from .compat import ASYNC_SAVE_KWARGS, FullyParallelSaveWrapper
    from .engine.async_queue import AsyncSaveQueue
    from .engine.directory import prepare_checkpoint_dir
    from .engine.tiers.background import remove_checkpoint, wait_copies
    from .engine.tiers.state import checkpoint_state, wait_durable
    from .format.records import BACKEND, BACKEND_VERSION
    from .registry import register
    from .strategies.fastpersist_load import FastPersistLoadStrategy
    from .strategies.fastpersist_save import FastPersistSaveStrategy
    from .tools.verify import VerifyReport, verify_checkpoint
    from .util.config import ReadConfig, TierConfig, WriteConfig
    from .util.errors import CorruptCheckpointError, FastPersistError, IncompleteCheckpointError, SaveFailedError

    register()

__all__ = [
    "ASYNC_SAVE_KWARGS",
    "AsyncSaveQueue",
    "BACKEND",
    "BACKEND_VERSION",
    "CorruptCheckpointError",
    "FastPersistError",
    "FastPersistLoadStrategy",
    "FastPersistSaveStrategy",
    "FullyParallelSaveWrapper",
    "IncompleteCheckpointError",
    "ReadConfig",
    "SaveFailedError",
    "TierConfig",
    "VerifyReport",
    "WriteConfig",
    "checkpoint_state",
    "prepare_checkpoint_dir",
    "register",
    "remove_checkpoint",
    "verify_checkpoint",
    "wait_copies",
    "wait_durable",
]
