"""From a megatron sharded state dict to (record, elements) pairs ready to write.

Every tensor shard a rank holds is described, main replica or not, so the
planner can spread replicated bytes over their holders (megatron leaves the
choice of writer to the strategy); objects only where they are the main
replica. Once planned, a rank writes the elements of its records (whole
shards or element ranges of them): only a view's own bytes, never its base
storage. An async save copies them into a host snapshot here; a synchronous
one hands them over as they are, and the write (on the calling thread)
copies accelerator tensors and strided views to the host as it reaches them
(storage/writer.py), so the writer process never touches a device.
ShardedObjects are serialized with ``torch.save`` as the checkpoint format
says (they are arbitrary Python objects; tensor data never goes this way).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_outplace, nested_values
from megatron.core.dist_checkpointing.mapping import (
    ShardedObject,
    ShardedTensor,
    is_main_replica,
)
from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess

from ..format.kinds import CheckpointFormat
from ..format.records import KIND_OBJECT, KIND_TENSOR, ShardRecord, dtype_name
from ..storage.host_copy import copy_to_host
from ..storage.shared_memory import SharedBuffer
from ..util.errors import FastPersistError
from ..util.timing import Phases

logger = logging.getLogger(__name__)

Sharded = Union[ShardedTensor, ShardedObject]


@dataclass
class StagedShard:
    """A record (not yet placed in a file) and the data it will hold: its source tensor, elements or bytes."""

    record: ShardRecord
    data: torch.Tensor


def preprocessed(sharded_state_dict: dict) -> tuple[dict, dict]:
    """The sharded part and the common state that megatron's ``save()`` takes from a state dict.

    Works on a copy of the containers (``save_preprocess`` builds factories in
    place); tensors are not copied. Sharding integrity is not validated here:
    the save itself does.
    """
    copied = dict_list_map_outplace(lambda v: v, sharded_state_dict)
    return save_preprocess(copied, validate_access_integrity=False)


def held_shards(sharded_state_dict: dict) -> list[Sharded]:
    """Every ShardedTensor and main-replica ShardedObject of this rank, in a deterministic order."""
    items = [
        v for v in nested_values(sharded_state_dict)
        if isinstance(v, ShardedTensor) or (isinstance(v, ShardedObject) and is_main_replica(v.replica_id))
    ]
    items.sort(key=lambda v: (v.key, tuple(v.global_offset)))
    return items


def _replica(rid: object) -> Union[int, tuple[int, ...]]:
    return int(rid) if isinstance(rid, int) else tuple(int(r) for r in rid)


def _tensor_record(sh: ShardedTensor, rank: int) -> ShardRecord:
    """Validate a ShardedTensor and describe it (not yet placed in a file)."""
    data = sh.data
    if not isinstance(data, torch.Tensor):
        raise FastPersistError(
            f"rank {rank}: ShardedTensor '{sh.key}' holds {type(data).__name__}, expected a torch.Tensor"
        )
    try:
        name = dtype_name(data.dtype)
    except FastPersistError as e:
        raise FastPersistError(f"rank {rank}: ShardedTensor '{sh.key}': {e}") from None
    return ShardRecord(
        key=sh.key, kind=KIND_TENSOR, dtype=name, local_shape=tuple(sh.local_shape),
        global_shape=tuple(sh.global_shape), global_offset=tuple(sh.global_offset),
        axis_fragmentations=None if sh.axis_fragmentations is None else tuple(sh.axis_fragmentations),
        prepend_axis_num=sh.prepend_axis_num, flattened_range=None, replica_id=_replica(sh.replica_id),
        file="", offset=0, length=data.numel() * data.element_size(),
    )


def stage_object(sh: ShardedObject, rank: int, fmt: CheckpointFormat) -> StagedShard:
    """Serialize a ShardedObject's payload."""
    try:
        payload = torch.frombuffer(bytearray(fmt.object_payload(sh.data)), dtype=torch.uint8)
    except Exception as e:  # noqa: BLE001 - any pickling failure names the key
        raise FastPersistError(f"rank {rank}: ShardedObject '{sh.key}' cannot be serialized: {e}") from e
    record = ShardRecord(
        key=sh.key, kind=KIND_OBJECT, dtype=None, local_shape=(), global_shape=tuple(sh.global_shape),
        global_offset=tuple(sh.global_offset), axis_fragmentations=None, prepend_axis_num=0,
        flattened_range=None, replica_id=_replica(sh.replica_id), file="", offset=0, length=payload.numel(),
    )
    return StagedShard(record, payload)


def stage(sharded_state_dict: dict, rank: int, fmt: CheckpointFormat) -> list[StagedShard]:
    """Validate and describe every held shard; raises on the first invalid one.

    Objects are serialized now; tensors keep their source tensor as ``data``.
    """
    return [
        StagedShard(_tensor_record(sh, rank), sh.data) if isinstance(sh, ShardedTensor) else stage_object(sh, rank, fmt)
        for sh in held_shards(sharded_state_dict)
    ]


def assign(staged: list[StagedShard], records: list[ShardRecord], rank: int) -> list[StagedShard]:
    """Pair the records the plan gives ``rank`` with the shards they come from.

    Tensor data stays the source tensor until :func:`to_elements` (synchronous
    save: the write copies them to the host as it reaches them, see
    storage/writer.py) or :meth:`SnapshotPool.snapshot` (asynchronous save)
    turns it into the record's elements.
    """
    sources = {(s.record.kind, s.record.key, s.record.global_offset): s.data for s in staged}
    try:
        return [StagedShard(r, sources[(r.kind, r.key, r.global_offset)]) for r in records]
    except KeyError as e:
        raise FastPersistError(f"rank {rank}: the write plan names shard {e} that this rank does not hold") from None


def _elements(s: StagedShard) -> torch.Tensor:
    """The source elements a tensor record stores: all of them, or its flattened range."""
    data = s.data.detach()
    if s.record.flattened_range is None:
        return data
    start, stop = s.record.flattened_range
    return data.reshape(-1)[start:stop]


def to_elements(staged: list[StagedShard]) -> None:
    """Point every tensor record at the elements it stores, wherever they are (no copy)."""
    for s in staged:
        if s.record.kind == KIND_TENSOR:
            s.data = _elements(s)


Lease = tuple[tuple, SharedBuffer]


class SnapshotPool:
    """Shared host buffers for async snapshots, reused across saves of the same structure.

    One pool per process (every strategy instance uses it, so a fresh strategy
    per save pays no first-use cost). One buffer holds every tensor of a save,
    back to back (64-byte aligned), in shared memory the rank's writer process
    maps (``on_new`` shares it, ``on_drop`` takes it back). When a save is
    finalized its buffer returns here and the next save of the same structure
    reuses it; a save issued before that gets a buffer of its own. Peak extra
    host memory is therefore (saves in flight) x (bytes this rank writes).
    Returned buffers are kept up to the most saves ever in flight at once: a
    trainer whose saves overlapped once (a save slower than the interval
    between them) will likely overlap again, and allocating a buffer costs its
    call ten times the copy. A buffer for another structure is dropped.
    """

    ALIGN = 64

    def __init__(self, on_new: Callable[[SharedBuffer], None], on_drop: Callable[[SharedBuffer], None]) -> None:
        self._free: list[Lease] = []  # newest last
        self._leased = 0  # buffers of saves not yet finalized
        self._most_leased = 1  # the most at once so far: how many free ones are worth keeping
        self._on_new, self._on_drop = on_new, on_drop

    def snapshot(self, staged: list[StagedShard], phases: Optional[Phases] = None) -> Lease:
        """Copy each tensor record's elements into a buffer; ``data`` becomes the buffer's bytes.

        Returns the lease to :meth:`release` once the bytes are written. ``phases``
        gets the time to get the buffer ("buffer") and to copy into it ("copy").
        """
        phases = phases or Phases()
        tensors, signature, offsets, total = self._layout(staged)
        on_device = any(s.data.device.type != "cpu" for s in tensors)
        start = time.perf_counter()
        buffer, new = self._acquire(signature, total, pinned=on_device)
        phases.mark("buffer")
        if new and self._leased:
            logger.info("fastpersist: this async save allocated a snapshot buffer of %.2f GiB (%.2f s of its call) "
                        "because %d earlier one(s) still hold theirs; %d are kept for later saves from now on: "
                        "finalize each save before the next one (checkpoint less often than a save takes to become "
                        "durable) to need one", total / (1 << 30), time.perf_counter() - start, self._leased,
                        max(self._most_leased, self._leased + 1))
        for s, off in zip(tensors, offsets):
            dest = buffer.tensor[off : off + s.record.length]
            if s.record.length:
                source = _elements(s)
                target = dest.view(source.dtype).view(source.shape)
                if source.device.type == "cpu":
                    copy_to_host(target, source)
                else:
                    target.copy_(source, non_blocking=True)
            s.data = dest
        if on_device:
            torch.accelerator.synchronize()
        phases.mark("copy")
        if new:  # after the copy: the writer maps (and faults in) the pages while training goes on
            self._on_new(buffer)
        self._leased += 1
        self._most_leased = max(self._most_leased, self._leased)
        return signature, buffer

    def reserve(self, staged: list[StagedShard]) -> None:
        """Allocate (and share) the buffer that a snapshot of ``staged`` will take, without copying.

        It is kept as the free buffer: the next snapshot of the same structure
        copies into memory that is already allocated and mapped.
        """
        tensors, signature, _, total = self._layout(staged)
        on_device = any(s.data.device.type != "cpu" for s in tensors)
        buffer, new = self._acquire(signature, total, pinned=on_device)
        if new:
            self._on_new(buffer)
        self._keep((signature, buffer))

    def _layout(self, staged: list[StagedShard]) -> tuple[list[StagedShard], tuple, list[int], int]:
        """The tensor records, the structure's signature, each one's offset in the buffer, the buffer's size."""
        tensors = [s for s in staged if s.record.kind == KIND_TENSOR]
        signature = tuple((s.record.key, s.record.global_offset, s.record.flattened_range, s.record.length)
                          for s in tensors)
        offsets, total = [], 0
        for s in tensors:
            offsets.append(total)
            total += -(-s.record.length // self.ALIGN) * self.ALIGN
        return tensors, signature, offsets, total

    def release(self, lease: Lease) -> None:
        """Take back a buffer whose bytes are written (called at finalize), for later saves (:meth:`_keep`)."""
        self._leased -= 1
        self._keep(lease)

    def _keep(self, lease: Lease) -> None:
        """Keep ``lease`` free (the next save most likely has the latest one's structure), up to the most in flight."""
        self._drop_unlike(lease[0])
        self._free.append(lease)
        while len(self._free) > self._most_leased:
            self._drop(self._free.pop(0)[1])

    def _drop_unlike(self, signature: tuple) -> None:
        """Drop the free buffers of another structure than ``signature``'s (the state's structure changed)."""
        for old in self._free:
            if old[0] != signature:
                self._drop(old[1])
        self._free = [f for f in self._free if f[0] == signature]

    def _drop(self, buffer: SharedBuffer) -> None:
        self._on_drop(buffer)
        buffer.close()

    def _acquire(self, signature: tuple, total: int, pinned: bool) -> tuple[SharedBuffer, bool]:
        """A free buffer of ``signature`` (the newest), else a new one (True: not yet shared with ``on_new``)."""
        self._drop_unlike(signature)
        if self._free:
            return self._free.pop()[1], False
        return SharedBuffer(total, pinned=pinned), True
