"""fastpersist-dist: a DeepSpeed DeepNVMe (FastPersist) backend for megatron-core dist_checkpointing.

On megatron-core 0.16, importing the package registers the ('fastpersist', 1)
save and load strategies; 0.17+ has no registry (see ``compat``).
"""

from . import compat
from .compat import ASYNC_SAVE_KWARGS
from .async_queue import AsyncSaveQueue
from .commit import prepare_checkpoint_dir
from .config import WriteConfig
from .errors import CorruptCheckpointError, FastPersistError, IncompleteCheckpointError, SaveFailedError
from .format import BACKEND, BACKEND_VERSION
from .registry import register
from .strategies.fastpersist_load import FastPersistLoadStrategy
from .strategies.fastpersist_save import FastPersistSaveStrategy

if compat.REGISTRY:
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
    "IncompleteCheckpointError",
    "SaveFailedError",
    "WriteConfig",
    "prepare_checkpoint_dir",
    "register",
]
