"""Registration of the FastPersist strategies with megatron-core, done by ``import fastpersist_dist``.

A plain ``dist_checkpointing.load(sd, dir)`` then reads our checkpoints of
either format with our loader, checksums verified, and hands any other (a
torch DCP checkpoint without our sidecar index: megatron's own) to megatron's
loader unchanged. megatron-core 0.16: through its strategy registry, where
``dist_checkpointing.save(..., sharded_strategy=('fastpersist', 1))`` works too
and ``load()`` picks the loader by a checkpoint's ``metadata.json``;
megatron-core 0.17+ has no registry: our loader becomes what ``load()`` uses
when given no strategy. Megatron keeps one shared instance; ours hold no
per-load state.
"""

from . import compat
from .format.kinds import FASTPERSIST, TORCH_DIST
from .strategies.fastpersist_load import FastPersistLoadStrategy
from .strategies.fastpersist_save import FastPersistSaveStrategy


def register() -> None:
    """Register our default strategies with the installed megatron-core (see the module); idempotent."""
    compat.register(FastPersistSaveStrategy(FASTPERSIST.name), FastPersistLoadStrategy(), FASTPERSIST, TORCH_DIST)
