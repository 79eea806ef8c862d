"""``FastPersistLoadStrategy``: megatron's load-strategy contract over our load engine.

Reads both formats, with any target sharding, verifying checksums: the native
``fastpersist`` one and our ``torch_dist`` one (through its sidecar index). A
``torch_dist`` checkpoint without our sidecar (written by megatron itself) is
handed to megatron's stock loader.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Optional, Union

import torch.distributed as dist
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, nested_values
from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

from .. import compat
from ..checkpoint_formats import BACKENDS, DCP_METADATA_FILE
from ..commit import check_markers, read_index, read_top
from ..errors import FastPersistError
from ..format import INDEX_FILE, CheckpointIndex
from ..load_engine import Loader, requested_boxes, sharded_metadata, tensors_metadata
from ..read_exchange import fail_together, sharing_group
from ..config import DirectIO, WriteConfig
from ..dcp_metadata import without_strides
from ..storage.deepspeed_ops import aio_resources
from ..storage.reader import ShardReader
from ..storage.stream_reader import on_memory_filesystem, open_stream

logger = logging.getLogger(__name__)


class _StockMetadataReader(TorchDistLoadShardedStrategy):
    """megatron's own metadata reading of a checkpoint it wrote, on every torch.

    megatron-core passes every field of torch DCP's tensor properties to
    ``torch.empty``, which fails on torch 2.15's ``strides``
    (:func:`~fastpersist_dist.dcp_metadata.without_strides`); otherwise megatron's
    reading, its storage backends included, unchanged.
    """

    def load_tensors_metadata(self, checkpoint_dir: Path, metadata: Any = None) -> Any:
        if metadata is None:  # read by load_sharded_metadata, which hands it back here
            return {k: v for k, v in self.load_sharded_metadata(checkpoint_dir).items() if isinstance(v, ShardedTensor)}
        return super().load_tensors_metadata(checkpoint_dir, without_strides(metadata))


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _stock_checkpoint(checkpoint_dir: str) -> bool:
    """A torch DCP checkpoint with no FastPersist sidecar: megatron's own, or any DCP writer's."""
    return (not os.path.lexists(os.path.join(checkpoint_dir, INDEX_FILE))
            and os.path.lexists(os.path.join(checkpoint_dir, DCP_METADATA_FILE)))


class FastPersistLoadStrategy(compat.LoadStrategyBase):
    """Reads FastPersist checkpoints (either format), with any target sharding.

    Args:
        verify_checksums: check the XXH3 checksum of every block read (default on).
        trust_objects: unpickle ShardedObjects without torch's ``weights_only``
            restriction. Only for checkpoints from a trusted source.
        read_threads: preads in flight per rank where the load does not stream
            (I/O of one overlaps the checksum and copy of another).
        direct_io: "auto" reads verified loads with large O_DIRECT aio reads
            through the aio handle and locked buffer of ``WriteConfig()`` (shared
            with this process's synchronous saves), except on in-memory filesystems
            (tmpfs), and falls back to pread where aio or O_DIRECT is unavailable;
            "on" raises there instead; "off" always uses pread.
        share_reads: "auto" (default) and "on": bytes that several ranks need
            (resharded loads, replicated tensors) are read by one of them and sent
            to the others over ``parallel_group``, which makes the load
            collective over that group, as megatron's own loaders are; "auto"
            reads unshared where the checkpoint is on an in-memory filesystem
            (tmpfs: a read is a memory copy, cheaper than a transfer); "off":
            every rank reads all it needs itself, independently of the others.
        parallel_group: the ranks that share reads; default: the default process
            group when it has at most 64 ranks (each rank gathers every rank's
            read list), else no sharing unless a group (one node's ranks) is given.
    """

    def __init__(self, verify_checksums: bool = True, trust_objects: bool = False, read_threads: int = 2,
                 direct_io: DirectIO = "auto", share_reads: DirectIO = "auto",
                 parallel_group: Optional[dist.ProcessGroup] = None):
        if read_threads < 1:
            raise ValueError(f"read_threads must be >= 1, got {read_threads}")
        for name, value in (("direct_io", direct_io), ("share_reads", share_reads)):
            if value not in ("auto", "on", "off"):
                raise ValueError(f"{name} must be 'auto', 'on' or 'off', got {value!r}")
        super().__init__()
        # megatron-core 0.19's load() dequantizes FP8 (Transformer Engine) tensors itself unless the
        # strategy says it does so per tensor; ours reads raw bytes into plain tensors, so it does not.
        self.stream_ckpt_dequant = False
        self.verify_checksums = verify_checksums
        self.trust_objects = trust_objects
        self.read_threads = read_threads
        self.direct_io = direct_io
        self.share_reads = share_reads
        self.parallel_group = parallel_group

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
        ckpt = str(checkpoint_dir)
        if _stock_checkpoint(ckpt):
            logger.info("fastpersist: %s has no %s; loading it with megatron's torch_dist loader (no checksums)",
                        ckpt, INDEX_FILE)
            return compat.stock_load(sharded_state_dict, ckpt, async_strategy)
        start = time.perf_counter()
        rank = _rank()
        who = f"rank {rank}"
        group = sharing_group(self.share_reads != "off", self.parallel_group)
        with ExitStack() as closing:
            try:
                index = read_index(ckpt, who, requested_boxes(nested_values(sharded_state_dict)))
                reader = closing.enter_context(ShardReader(ckpt, index, self.verify_checksums, who))
                stream = open_stream(reader, lambda: aio_resources(WriteConfig().aio), self.direct_io)
                loader = Loader(index, reader, rank, self.trust_objects, stream)
                dict_list_map_inplace(loader.load, sharded_state_dict)
            except Exception as e:
                if group is not None:
                    fail_together(e, group, who)  # the others raise naming this rank, at their next gather
                raise
            loader.run(self.read_threads, group, self.share_reads == "on" or not on_memory_filesystem(ckpt))
        seconds = time.perf_counter() - start
        sent, received = loader.exchanged
        (logger.info if rank == 0 else logger.debug)(
            "fastpersist: rank %d loaded %.3f GiB from %s in %.2f s (%.2f GiB/s, checksums %s, %s%s)",
            rank, loader.nbytes / 2**30, ckpt, seconds, loader.nbytes / 2**30 / max(seconds, 1e-9),
            "verified" if self.verify_checksums else "not verified", "O_DIRECT aio" if stream else "pread",
            f"; read for other ranks {sent / 2**30:.3f} GiB, received {received / 2**30:.3f} GiB"
            if sent or received else "",
        )
        return sharded_state_dict

    def _index(self, checkpoint_dir: Union[str, Path]) -> Optional[CheckpointIndex]:
        return None if _stock_checkpoint(str(checkpoint_dir)) else read_index(str(checkpoint_dir), f"rank {_rank()}")

    def load_tensors_metadata(self, checkpoint_dir: Union[str, Path]) -> Any:
        """Global shape and dtype of every stored tensor, as data-less ShardedTensors (a paged index: no page read)."""
        ckpt, who = str(checkpoint_dir), f"rank {_rank()}"
        if _stock_checkpoint(ckpt):
            return _StockMetadataReader().load_tensors_metadata(Path(checkpoint_dir))
        top = read_top(ckpt, who)
        check_markers(ckpt, top, who)
        return tensors_metadata(top)

    def load_sharded_metadata(self, checkpoint_dir: Union[str, Path]) -> Any:
        """Tensor metadata plus every stored ShardedObject, keyed by its unique key."""
        index = self._index(checkpoint_dir)
        if index is None:
            return _StockMetadataReader().load_sharded_metadata(Path(checkpoint_dir))
        return sharded_metadata(index)
