"""From a megatron sharded state dict to (record, host bytes) pairs ready to write.

Only main replicas are kept (megatron leaves skipping the others to the
strategy). Tensors become 1-D uint8 views of contiguous host memory: only a
view's own bytes, never its base storage. Accelerator tensors are copied to
the host here, in the training process, so the writer never touches a device.
ShardedObjects are serialized with ``torch.save`` (they are arbitrary Python
objects; tensor data never goes this way).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Union

import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, is_main_replica

from .errors import FastPersistError
from .format import KIND_OBJECT, KIND_TENSOR, ShardRecord, dtype_name

Sharded = Union[ShardedTensor, ShardedObject]


@dataclass
class StagedShard:
    """A record (not yet placed in a file) and the host bytes it will hold."""

    record: ShardRecord
    data: torch.Tensor


def main_replicas(sharded_state_dict: dict) -> list[Sharded]:
    """Every ShardedTensor/ShardedObject this rank must write, in a deterministic order."""
    items = [
        v for v in nested_values(sharded_state_dict)
        if isinstance(v, (ShardedTensor, ShardedObject)) and is_main_replica(v.replica_id)
    ]
    items.sort(key=lambda v: (v.key, tuple(v.global_offset)))
    return items


def _replica(rid: object) -> Union[int, tuple[int, ...]]:
    return int(rid) if isinstance(rid, int) else tuple(int(r) for r in rid)


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """1-D uint8 view of a contiguous host tensor's own bytes (zero-copy)."""
    return tensor.reshape(-1).view(torch.uint8)


def stage_tensor(sh: ShardedTensor, rank: int, snapshot: bool) -> StagedShard:
    """Validate a ShardedTensor and expose its bytes as a host uint8 tensor.

    With ``snapshot`` the bytes are a private copy, so the caller may modify
    the tensor as soon as this returns.
    """
    data = sh.data
    if not isinstance(data, torch.Tensor):
        raise FastPersistError(
            f"rank {rank}: ShardedTensor '{sh.key}' holds {type(data).__name__}, expected a torch.Tensor"
        )
    try:
        name = dtype_name(data.dtype)
    except FastPersistError as e:
        raise FastPersistError(f"rank {rank}: ShardedTensor '{sh.key}': {e}") from None
    host = data.detach()
    if host.device.type != "cpu":
        host = host.to("cpu")
    host = host.contiguous()
    if snapshot and host.untyped_storage().data_ptr() == data.untyped_storage().data_ptr():
        host = host.clone()
    record = ShardRecord(
        key=sh.key, kind=KIND_TENSOR, dtype=name, local_shape=tuple(sh.local_shape),
        global_shape=tuple(sh.global_shape), global_offset=tuple(sh.global_offset),
        axis_fragmentations=None if sh.axis_fragmentations is None else tuple(sh.axis_fragmentations),
        prepend_axis_num=sh.prepend_axis_num, flattened_range=None, replica_id=_replica(sh.replica_id),
        file="", offset=0, length=host.numel() * host.element_size(),
    )
    return StagedShard(record, tensor_bytes(host))


def stage_object(sh: ShardedObject, rank: int) -> StagedShard:
    """Serialize a ShardedObject's payload."""
    buf = io.BytesIO()
    try:
        torch.save(sh.data, buf)
    except Exception as e:  # noqa: BLE001 - any pickling failure names the key
        raise FastPersistError(f"rank {rank}: ShardedObject '{sh.key}' cannot be serialized: {e}") from e
    payload = torch.frombuffer(bytearray(buf.getbuffer()), dtype=torch.uint8)
    record = ShardRecord(
        key=sh.key, kind=KIND_OBJECT, dtype=None, local_shape=(), global_shape=tuple(sh.global_shape),
        global_offset=tuple(sh.global_offset), axis_fragmentations=None, prepend_axis_num=0,
        flattened_range=None, replica_id=_replica(sh.replica_id), file="", offset=0, length=payload.numel(),
    )
    return StagedShard(record, payload)


def stage(sharded_state_dict: dict, rank: int, snapshot: bool) -> list[StagedShard]:
    """Stage every main replica of ``sharded_state_dict``; raises on the first invalid one."""
    return [
        stage_tensor(sh, rank, snapshot) if isinstance(sh, ShardedTensor) else stage_object(sh, rank)
        for sh in main_replicas(sharded_state_dict)
    ]
