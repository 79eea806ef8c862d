"""fastpersist-dist: a DeepSpeed DeepNVMe (FastPersist) backend for megatron-core dist_checkpointing.

Importing the package registers its strategies with megatron-core (``registry``):
on 0.16 the ('fastpersist', 1) save and load strategies in megatron's registry;
on 0.17+, which has no registry, our loader as ``load()``'s default. A rank's
writer process imports none of it (``roles``).
"""

import os

if os.environ.get("FASTPERSIST_QUIET") == "1":  # a process our command started (its writer): as quiet as the command
    from fastpersist_dist_cli.quiet import quiet_dependencies

    quiet_dependencies()

from .roles import IS_WRITER  # noqa: E402

if not IS_WRITER:  # a rank's writer process needs none of this (nor megatron-core): see roles.py
    # after the filters, which must precede the dependencies' import-time warnings
    from .async_queue import AsyncSaveQueue
    from .commit import prepare_checkpoint_dir
    from .compat import ASYNC_SAVE_KWARGS, FullyParallelSaveWrapper
    from .config import WriteConfig
    from .errors import CorruptCheckpointError, FastPersistError, IncompleteCheckpointError, SaveFailedError
    from .format import BACKEND, BACKEND_VERSION
    from .registry import register
    from .strategies.fastpersist_load import FastPersistLoadStrategy
    from .strategies.fastpersist_save import FastPersistSaveStrategy

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
    "SaveFailedError",
    "WriteConfig",
    "prepare_checkpoint_dir",
    "register",
]
