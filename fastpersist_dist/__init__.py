"""fastpersist-dist: a DeepSpeed DeepNVMe (FastPersist) backend for megatron-core dist_checkpointing.

Importing the package registers the ('fastpersist', 1) save and load strategies.
"""

from .async_queue import AsyncSaveQueue
from .commit import prepare_checkpoint_dir
from .config import WriteConfig
from .errors import CorruptCheckpointError, FastPersistError, IncompleteCheckpointError, SaveFailedError
from .format import BACKEND, BACKEND_VERSION
from .registry import register
from .strategies.fastpersist_load import FastPersistLoadStrategy
from .strategies.fastpersist_save import FastPersistSaveStrategy

register()

__all__ = [
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
