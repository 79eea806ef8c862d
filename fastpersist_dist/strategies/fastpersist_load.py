"""``FastPersistLoadStrategy``: fills requested shards from any saved sharding.

Each requested ShardedTensor is a box of its global tensor; every stored
extent that intersects it contributes exactly the intersecting elements, so a
checkpoint saved on 2 ranks loads whole on 1 rank or split on 4. Coverage is
counted: a request not fully covered by the checkpoint is an error, never
uninitialized memory.
"""

from __future__ import annotations

import io
import logging
import math
import pickle
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Union

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedStateDict, ShardedTensor
from megatron.core.dist_checkpointing.strategies.base import LoadShardedStrategy

from ..commit import read_index
from ..errors import FastPersistError
from ..format import BACKEND, BACKEND_VERSION, KIND_OBJECT, KIND_TENSOR, CheckpointIndex, ShardRecord, dtype_from_name
from ..layout import Extent, intersect
from ..storage.reader import ShardReader, record_extents

logger = logging.getLogger(__name__)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class _Loader:
    """One load: the index grouped by key, and an open reader."""

    def __init__(self, index: CheckpointIndex, reader: ShardReader, rank: int, trust_objects: bool):
        self.reader = reader
        self.rank = rank
        self.trust_objects = trust_objects
        self.tensors: dict[str, list[ShardRecord]] = defaultdict(list)
        self.objects: dict[tuple[str, tuple[int, ...]], ShardRecord] = {}
        for r in index.records:
            if r.kind == KIND_TENSOR:
                self.tensors[r.key].append(r)
            else:
                self.objects[(r.key, r.global_offset)] = r
        self.nbytes = 0
        # Reads are planned per request, then run in file order (see run()).
        self.reads: list[tuple[ShardRecord, Extent, tuple[int, ...], tuple[int, ...], torch.Tensor]] = []

    def load(self, item: Any) -> Any:
        if isinstance(item, ShardedTensor):
            return self.load_tensor(item)
        if isinstance(item, ShardedObject):
            return self.load_object(item)
        return item

    def load_tensor(self, sh: ShardedTensor) -> torch.Tensor:
        where = f"rank {self.rank}: tensor '{sh.key}' (global offset {tuple(sh.global_offset)})"
        records = self.tensors.get(sh.key)
        if not records:
            raise FastPersistError(f"{where} is not in checkpoint {self.reader.dir}")
        saved_shape = records[0].global_shape
        if saved_shape != tuple(sh.global_shape) and not sh.allow_shape_mismatch:
            raise FastPersistError(
                f"{where}: requested global shape {tuple(sh.global_shape)} but the checkpoint holds {saved_shape}"
            )
        dest = sh.data
        if not isinstance(dest, torch.Tensor) or tuple(dest.shape) != tuple(sh.local_shape):
            dest = torch.empty(sh.local_shape, dtype=sh.dtype)
        box_dest = dest.detach()  # loads in place, also into parameters that require grad
        for _ in range(sh.prepend_axis_num):
            box_dest = box_dest.unsqueeze(0)
        req_off = tuple(sh.global_offset)
        req_shape = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
        covered = 0
        for rec in records:
            for ext in record_extents(rec):
                inter = intersect(req_off, req_shape, ext.offset, ext.shape)
                if inter is None:
                    continue
                off, shape = inter
                view = box_dest[tuple(slice(o - r, o - r + n) for o, r, n in zip(off, req_off, shape))]
                self.reads.append((rec, ext, tuple(o - e for o, e in zip(off, ext.offset)), shape, view))
                covered += math.prod(shape)
        wanted = intersect(req_off, req_shape, (0,) * len(saved_shape), saved_shape)
        expected = 0 if wanted is None else math.prod(wanted[1])
        if covered != expected:
            kind = "overlapping shards in the index" if covered > expected else "shards missing from the checkpoint"
            raise FastPersistError(f"{where}: {covered} of {expected} elements found ({kind})")
        self.nbytes += covered * dtype_from_name(records[0].dtype).itemsize
        return dest

    def run(self, threads: int) -> None:
        """Execute the planned reads sorted by file and offset: sequential I/O, whatever the dict order.

        With ``threads`` > 1, consecutive reads run on a small pool, so one
        read's I/O overlaps another's checksum and copy (all release the GIL).
        """
        self.reads.sort(key=lambda r: (r[0].file, r[0].offset + r[1].byte_start))
        reads, self.reads = self.reads, []
        if threads <= 1 or len(reads) < 2:
            for rec, ext, sub_off, shape, view in reads:
                self.reader.read_box(rec, ext, sub_off, shape, view)
            return
        self.reader.open_all({rec.file for rec, *_ in reads})
        with ThreadPoolExecutor(threads, thread_name_prefix="fastpersist-read") as pool:
            for done in [pool.submit(self.reader.read_box, *read) for read in reads]:
                done.result()

    def load_object(self, sh: ShardedObject) -> Any:
        rec = self.objects.get((sh.key, tuple(sh.global_offset)))
        if rec is None:
            raise FastPersistError(
                f"rank {self.rank}: object '{sh.unique_key}' is not in checkpoint {self.reader.dir}"
            )
        payload = self.reader.read_object(rec)
        self.nbytes += len(payload)
        try:
            return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=not self.trust_objects)
        except pickle.UnpicklingError as e:
            raise FastPersistError(
                f"rank {self.rank}: object '{sh.unique_key}' needs types outside torch's weights_only "
                f"allow-list ({e}); for a checkpoint you trust, use FastPersistLoadStrategy(trust_objects=True) "
                "or torch.serialization.add_safe_globals"
            ) from e


class FastPersistLoadStrategy(LoadShardedStrategy):
    """Reads FastPersist checkpoints, with any target sharding.

    Args:
        verify_checksums: check the XXH3 checksum of every block read (default on).
        trust_objects: unpickle ShardedObjects without torch's ``weights_only``
            restriction. Only for checkpoints from a trusted source.
        read_threads: reads in flight per rank (I/O of one overlaps the checksum
            and copy of another).
    """

    def __init__(self, verify_checksums: bool = True, trust_objects: bool = False, read_threads: int = 2):
        if read_threads < 1:
            raise ValueError(f"read_threads must be >= 1, got {read_threads}")
        self.verify_checksums = verify_checksums
        self.trust_objects = trust_objects
        self.read_threads = read_threads

    @property
    def can_handle_sharded_objects(self) -> bool:
        """ShardedObjects are read from our data files."""
        return True

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        """Only FastPersist checkpoints can be read."""
        if loaded_backend != BACKEND:
            raise FastPersistError(
                f"checkpoint backend is {loaded_backend!r}; FastPersistLoadStrategy reads only {BACKEND!r}"
            )

    def check_version_compatibility(self, loaded_version: int) -> None:
        """Only versions this code knows can be read."""
        if loaded_version != BACKEND_VERSION:
            raise FastPersistError(
                f"checkpoint backend version {loaded_version!r} is not supported (this reader knows {BACKEND_VERSION})"
            )

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Union[str, Path]) -> ShardedStateDict:
        """Replace every ShardedTensor/ShardedObject with its loaded value (tensors in place when possible)."""
        start = time.perf_counter()
        rank = _rank()
        index = read_index(str(checkpoint_dir), f"rank {rank}")
        with ShardReader(str(checkpoint_dir), index, self.verify_checksums, f"rank {rank}") as reader:
            loader = _Loader(index, reader, rank, self.trust_objects)
            dict_list_map_inplace(loader.load, sharded_state_dict)
            loader.run(self.read_threads)
        seconds = time.perf_counter() - start
        logger.info(
            "fastpersist: rank %d loaded %.3f GiB from %s in %.2f s (%.2f GiB/s, checksums %s)",
            rank, loader.nbytes / 2**30, checkpoint_dir, seconds, loader.nbytes / 2**30 / max(seconds, 1e-9),
            "verified" if self.verify_checksums else "not verified",
        )
        return sharded_state_dict

    def load_tensors_metadata(self, checkpoint_dir: Union[str, Path]) -> ShardedStateDict:
        """Global shape and dtype of every stored tensor, as data-less ShardedTensors."""
        index = read_index(str(checkpoint_dir), f"rank {_rank()}")
        out: dict[str, ShardedTensor] = {}
        for r in index.records:
            if r.kind == KIND_TENSOR and r.key not in out:
                meta = torch.empty(r.global_shape, dtype=dtype_from_name(r.dtype), device="meta")
                out[r.key] = ShardedTensor.from_rank_offsets(r.key, meta).without_data()
        return out

    def load_sharded_metadata(self, checkpoint_dir: Union[str, Path]) -> ShardedStateDict:
        """Tensor metadata plus every stored ShardedObject, keyed by its unique key."""
        out: dict[str, Any] = dict(self.load_tensors_metadata(checkpoint_dir))
        for r in read_index(str(checkpoint_dir), f"rank {_rank()}").records:
            if r.kind == KIND_OBJECT:
                obj = ShardedObject(r.key, None, r.global_shape, r.global_offset, 0)
                out[obj.unique_key] = obj
        return out
