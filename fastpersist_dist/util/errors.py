"""Exceptions raised by fastpersist-dist.

They derive from both exceptions megatron's ``torch_dist`` backend raises:
megatron's ``CheckpointingException`` and torch DCP's ``CheckpointException``
(a key the checkpoint lacks, a failed read or write). Code that catches either
catches ours, wherever megatron's backend would have raised its own; the
message stays ours and names the file, key and rank involved where one exists.
In a rank's writer process, which imports no megatron-core, they derive from
``Exception`` (see ``roles``).
"""

import traceback
from typing import Any

from .roles import IS_WRITER

if IS_WRITER:
    _BASES: tuple[type, ...] = (Exception,)
else:
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from torch.distributed.checkpoint.api import CheckpointException

    _BASES = (CheckpointingException, CheckpointException)


class FastPersistError(*_BASES):  # type: ignore[misc]
    """Base class of every error this package raises."""

    __str__ = BaseException.__str__  # our message, not CheckpointException's list of ranks

    @property
    def failures(self) -> dict[int, Any]:
        """``CheckpointException``'s view: this process's rank, with this error and where it was raised."""
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        return {rank: (self, traceback.extract_tb(self.__traceback__))}


class IncompleteCheckpointError(FastPersistError):
    """The directory holds no committed FastPersist index (crash or save in progress)."""


class CorruptCheckpointError(FastPersistError):
    """The checkpoint exists but its bytes or index contradict each other."""


class SaveFailedError(FastPersistError):
    """A save failed on at least one rank; nothing was committed."""
