"""``FastPersistLoadStrategy``: megatron's load-strategy contract over our load engine.

Reads both formats, with any target sharding, verifying checksums: the native
``fastpersist`` one and our ``torch_dist`` one (through its sidecar index). A
``torch_dist`` checkpoint without our sidecar (written by megatron itself) is
handed to megatron's stock loader.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any, Optional, Union

import torch.distributed as dist
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

from .. import compat
from ..engine.load import LoadEngine, foreign_checkpoint
from ..engine.remove import remove_keys
from ..format.dcp_metadata import without_strides
from ..format.kinds import BACKENDS
from ..format.records import INDEX_FILE
from ..storage.persistent import checkpoint_url
from ..util.config import ReadConfig
from ..util.errors import FastPersistError

logger = logging.getLogger(__name__)


class _StockMetadataReader(TorchDistLoadShardedStrategy):
    """megatron's own metadata reading of a checkpoint it wrote, on every torch.

    megatron-core passes every field of torch DCP's tensor properties to
    ``torch.empty``, which fails on torch 2.15's ``strides``
    (:func:`~fastpersist_dist.format.dcp_metadata.without_strides`); otherwise megatron's
    reading, its storage backends included, unchanged.
    """

    def load_tensors_metadata(self, checkpoint_dir: Path, metadata: Any = None) -> Any:
        if metadata is None:  # read by load_sharded_metadata, which hands it back here
            return {k: v for k, v in self.load_sharded_metadata(checkpoint_dir).items() if isinstance(v, ShardedTensor)}
        return super().load_tensors_metadata(checkpoint_dir, without_strides(metadata))


class FastPersistLoadStrategy(compat.LoadStrategyBase):
    """Reads FastPersist checkpoints (either format), with any target sharding.

    Args:
        config: a :class:`fastpersist_dist.util.config.ReadConfig`, or its knobs
            as keyword arguments (``verify_checksums``, ``trust_objects``,
            ``read_threads``, ``direct_io``, ``share_reads``, the aio knobs).
        parallel_group: the ranks that share reads; default: the default process
            group when it has at most 64 ranks (each rank gathers every rank's
            read list), else no sharing unless a group (one node's ranks) is given.
    """

    def __init__(self, config: Optional[ReadConfig] = None, parallel_group: Optional[dist.ProcessGroup] = None,
                 **knobs: Any):
        if config is not None and knobs:
            raise ValueError("pass either config= or individual knobs, not both")
        super().__init__()
        # megatron-core 0.19's load() dequantizes FP8 (Transformer Engine) tensors itself unless the
        # strategy says it does so per tensor; ours reads raw bytes into plain tensors, so it does not.
        self.stream_ckpt_dequant = False
        self.config = config or ReadConfig(**knobs)
        self._engine = LoadEngine(self.config, parallel_group)

    @property
    def can_handle_sharded_objects(self) -> bool:
        """ShardedObjects are read from our data files."""
        return True

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        """Our two formats' backends can be read."""
        if loaded_backend not in {b for b, _ in BACKENDS}:
            raise FastPersistError(
                f"checkpoint backend is {loaded_backend!r}; FastPersistLoadStrategy reads "
                f"{sorted({b for b, _ in BACKENDS})}"
            )

    def check_version_compatibility(self, loaded_version: int) -> None:
        """Only versions this code knows can be read."""
        if loaded_version not in {v for _, v in BACKENDS}:
            raise FastPersistError(f"checkpoint backend version {loaded_version!r} is not supported")

    def load(self, sharded_state_dict: Any, checkpoint_dir: Union[str, Path], async_strategy: Optional[str] = None) -> Any:
        """Replace every ShardedTensor/ShardedObject with its loaded value (tensors in place when possible).

        ``async_strategy`` (passed by megatron-core 0.17+) matters only for
        checkpoints handed to megatron's stock loader.
        """
        ckpt = checkpoint_url(checkpoint_dir)
        if foreign_checkpoint(ckpt):  # megatron's loader logs nothing here: a line per load would be noise
            logger.debug("fastpersist: %s has no %s; loading it with megatron's torch_dist loader (no checksums)",
                        ckpt, INDEX_FILE)
            return compat.stock_load(sharded_state_dict, ckpt, async_strategy)
        return self._engine.load(sharded_state_dict, ckpt)

    def load_tensors_metadata(self, checkpoint_dir: Union[str, Path]) -> Any:
        """Global shape and dtype of every stored tensor, as data-less ShardedTensors (a paged index: no page read)."""
        if foreign_checkpoint(checkpoint_url(checkpoint_dir)):
            return _StockMetadataReader().load_tensors_metadata(Path(checkpoint_dir))
        return self._engine.tensors_metadata(checkpoint_url(checkpoint_dir))

    def load_sharded_metadata(self, checkpoint_dir: Union[str, Path]) -> Any:
        """Tensor metadata plus every stored ShardedObject, keyed by its unique key."""
        if foreign_checkpoint(checkpoint_url(checkpoint_dir)):
            return _StockMetadataReader().load_sharded_metadata(Path(checkpoint_dir))
        return self._engine.sharded_metadata(checkpoint_url(checkpoint_dir))

    def remove_sharded_tensors(self, checkpoint_dir: Union[str, Path], key_prefix: str) -> None:
        """Remove every tensor and object whose key begins with ``key_prefix`` (megatron's
        ``dist_checkpointing.remove_sharded_tensors``); call it in one process, with no save or load running.

        Ours: the keys leave the index (and DCP's ``.metadata``), their bytes are
        freed, every other key stays verified; a crash half-way leaves a checkpoint
        that loads right or refuses to, and running it again finishes it
        (``engine/remove.py``). megatron's own checkpoints: megatron's removal.
        Nothing begins with the prefix: a warning, as megatron's.
        """
        ckpt = checkpoint_url(checkpoint_dir)
        if foreign_checkpoint(ckpt):
            TorchDistLoadShardedStrategy().remove_sharded_tensors(str(checkpoint_dir), key_prefix)
            return
        if not remove_keys(ckpt, key_prefix).keys:
            warnings.warn(f'There are no keys in {ckpt} that begin with "{key_prefix}". Skipping removal.')
