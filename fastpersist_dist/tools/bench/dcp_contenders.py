"""The benchmark's torch.distributed.checkpoint contenders: the same state as the megatron ones, as DTensors.

Each megatron ``ShardedTensor`` of the benchmark state becomes a DTensor on a
(data-parallel, tensor-parallel) device mesh: replicated over the data-parallel
ranks, split on its tensor-parallel axis where it is. DCP's planner then writes
each chunk once, spread over the ranks that hold it (its dedup planner), as
ours spreads replicated state; a load into the resharded state's DTensors is
DCP's resharding. ``FileSystemWriter`` gets one thread per core of its rank
(its default is one), the count that serves it best where cores are the limit.
"""

from __future__ import annotations

import os
import time
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ...strategies.dcp_reader import FastPersistReader
from ...strategies.dcp_writer import FastPersistWriter
from ...util.config import WriteConfig
from ...util.per_process import PerProcess

_meshes: PerProcess[dict[tuple[str, int, int], DeviceMesh]] = PerProcess(dict)
# Collective on first use: the gloo group DCP's async saves run their collectives on
_async_group: PerProcess[dist.ProcessGroup] = PerProcess(lambda: dist.new_group(backend="gloo"))


def _mesh(device: torch.device, tp: int) -> DeviceMesh:
    """Collective on first use: the (dp, tp) mesh of every rank, TP over consecutive ranks (as the state's)."""
    world = dist.get_world_size()
    key = (device.type, world, tp)
    if key not in _meshes.get():
        _meshes.get()[key] = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    return _meshes.get()[key]


def as_dtensors(sd: dict) -> dict[str, DTensor]:
    """Collective on first use: ``sd``'s ShardedTensors as DTensors over the same local tensors."""
    first = next(iter(sd.values()))
    tp = max((s.axis_fragmentations[axis] for s in sd.values() for axis in range(len(s.global_shape))
              if s.local_shape[axis] != s.global_shape[axis]), default=1)
    mesh = _mesh(first.data.device, tp)
    out = {}
    for key, sh in sd.items():
        split = [a for a in range(len(sh.global_shape)) if sh.local_shape[a] != sh.global_shape[a]]
        placements = (Replicate(), Shard(split[0]) if split else Replicate())
        out[key] = DTensor.from_local(sh.data, mesh, placements, run_check=False, shape=torch.Size(sh.global_shape),
                                      stride=torch.empty(sh.global_shape, device="meta").stride())
    return out


def _threads() -> int:
    """FileSystemWriter's threads: one per core of this rank."""
    return max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())))


def filesystem_save(sd: dict, ckpt: str, _: WriteConfig) -> None:
    dcp.save(as_dtensors(sd), storage_writer=FileSystemWriter(ckpt, thread_count=_threads()))


def async_save(sd: dict, ckpt: str, _: WriteConfig) -> Optional[float]:
    """``dcp.async_save``, process kind, staged into pinned shared memory where there is a GPU (else shared
    memory), with FileSystemWriter; until written. Returns the seconds the call blocked."""
    stager = DefaultStager(StagingOptions(use_pinned_memory=torch.cuda.is_available(), use_shared_memory=True,
                                          use_async_staging=False, use_non_blocking_copy=False))
    start = time.perf_counter()
    try:
        saving = dcp.async_save(as_dtensors(sd), storage_writer=FileSystemWriter(ckpt, thread_count=_threads()),
                                process_group=_async_group.get(), async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                                async_stager=stager)
        blocked = time.perf_counter() - start
        saving.result()
    finally:
        stager.close()
    return blocked


def filesystem_load(template: dict, ckpt: str, _: WriteConfig) -> dict:
    return _load(template, FileSystemReader(ckpt))


def ours_save(sd: dict, ckpt: str, config: WriteConfig) -> None:
    dcp.save(as_dtensors(sd), storage_writer=FastPersistWriter(ckpt, config=config))


def ours_load(template: dict, ckpt: str, _: WriteConfig) -> dict:
    return _load(template, FastPersistReader(ckpt))


def _load(template: dict, reader: Any) -> dict:
    """DCP's load into ``template``'s tensors (as DTensors); every key, to be checked."""
    dcp.load(as_dtensors(template), storage_reader=reader)
    return {key: sh.data for key, sh in template.items()}
