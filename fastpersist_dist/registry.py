"""Registration of the FastPersist strategies with megatron-core's strategy registry (0.16).

After ``import fastpersist_dist`` on megatron-core 0.16,
``dist_checkpointing.save(..., sharded_strategy=('fastpersist', 1))`` works, and
``dist_checkpointing.load`` picks our loader from a checkpoint's
``metadata.json`` unasked. Megatron keeps one shared instance per (action,
backend, version); ours hold no per-save state. megatron-core 0.17+ has no
registry: :func:`register` raises there, saying what to do instead.
"""

from . import compat
from .format import BACKEND, BACKEND_VERSION
from .strategies.fastpersist_load import FastPersistLoadStrategy
from .strategies.fastpersist_save import FastPersistSaveStrategy


def register() -> None:
    """Register the default save and load strategies for ('fastpersist', 1); idempotent."""
    compat.register(FastPersistSaveStrategy("fastpersist"), FastPersistLoadStrategy(), BACKEND, BACKEND_VERSION)
