"""Exceptions raised by fastpersist-dist.

They derive from megatron's ``CheckpointingException`` so callers that already
catch megatron checkpoint errors keep working; every message names the file,
key and rank involved where one exists. In a rank's writer process, which
imports no megatron-core, they derive from ``Exception`` (see ``roles``).
"""

from .roles import IS_WRITER

if IS_WRITER:
    _Base = Exception
else:
    from megatron.core.dist_checkpointing.core import CheckpointingException as _Base


class FastPersistError(_Base):  # type: ignore[valid-type,misc]
    """Base class of every error this package raises."""


class IncompleteCheckpointError(FastPersistError):
    """The directory holds no committed FastPersist index (crash or save in progress)."""


class CorruptCheckpointError(FastPersistError):
    """The checkpoint exists but its bytes or index contradict each other."""


class SaveFailedError(FastPersistError):
    """A save failed on at least one rank; nothing was committed."""
