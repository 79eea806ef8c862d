"""torchtitan's checkpoints through FastPersist: the entry point users import.

    from fastpersist_dist.torchtitan import FastPersistCheckpointManager

    config.checkpoint = FastPersistCheckpointManager.Config(enable=True, interval=500)

The integration itself is :mod:`fastpersist_dist.integrations.torchtitan`.
"""

from .integrations.torchtitan import FastPersistCheckpointManager

__all__ = ["FastPersistCheckpointManager"]
