"""torch DCP's ``.metadata`` for the records of a ``torch_dist``-format checkpoint. Pure (no I/O).

torch's ``FileSystemReader`` unpickles ``.metadata`` (a
``torch.distributed.checkpoint.metadata.Metadata``) and reads each item from
``storage_data``: a tensor item is a ``torch.save`` archive at a byte range of a
``.distcp`` file, an object item the raw bytes of a ``torch.save`` payload.
Megatron keys tensors by ``ShardedTensor.key`` and objects by
``ShardedObject.unique_key``; a tensor chunk is the global box of the shard
(prepended axes included), as megatron's own ``torch_dist`` writes it.

The file is pickled so that every torch from 2.13 on reads it, whichever torch
wrote it: torch 2.15 added a ``strides`` field to ``TensorProperties``, whose
pickled state older torch refuses ("too many values to unpack (expected 5)").
We never set it, and torch 2.15 reads the five-field state as ``strides=None``.
"""

from __future__ import annotations

import copyreg
import io
import pickle
import uuid
from typing import Iterable, Union

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ..util.errors import FastPersistError
from .coverage import record_extents
from .layout import Extent
from .records import KIND_TENSOR, ShardRecord, dtype_from_name

DCP_VERSION = "1.0.0"  # torch.distributed.checkpoint.filesystem.CURRENT_DCP_VERSION when written


def object_fqn(record: ShardRecord) -> str:
    """DCP key of an object record: megatron's ``ShardedObject.unique_key``."""
    # Imported here: the writer process imports this module (via commit) but no megatron-core.
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject(record.key, None, record.global_shape, record.global_offset, 0).unique_key


def stored_box(record: ShardRecord) -> Extent:
    """The one global box a tensor record holds (a DCP chunk); raises if it holds several.

    Pieces planned for the ``torch_dist`` format are cut at whole rows, so each is one box.
    """
    extents = record_extents(record)
    if len(extents) != 1:
        raise FastPersistError(f"{record.describe()}: a torch_dist chunk must be one box, this record holds {len(extents)}")
    return extents[0]


def build_metadata(records: Iterable[ShardRecord], checkpoint_dir: str) -> Metadata:
    """The DCP ``Metadata`` describing ``records`` (placed in their files, with their framing)."""
    state: dict[str, Union[TensorStorageMetadata, BytesStorageMetadata]] = {}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    for r in records:
        if r.kind == KIND_TENSOR:
            box = stored_box(r)
            md = state.setdefault(r.key, TensorStorageMetadata(
                properties=TensorProperties(dtype=dtype_from_name(r.dtype)), size=torch.Size(r.global_shape), chunks=[],
            ))
            md.chunks.append(ChunkStorageMetadata(offsets=torch.Size(box.offset), sizes=torch.Size(box.shape)))
            index = MetadataIndex(r.key, torch.Size(box.offset))
        else:
            fqn = object_fqn(r)
            state[fqn] = BytesStorageMetadata()
            index = MetadataIndex(fqn)
        storage[index] = _StorageInfo(relative_path=r.file, offset=r.offset, length=r.length)
    return Metadata(
        state_dict_metadata=state, planner_data=None, storage_data=storage,
        storage_meta=StorageMeta(checkpoint_id=checkpoint_dir, save_id=str(uuid.uuid4())), version=DCP_VERSION,
    )


_FIVE_FIELDS = 5  # TensorProperties' pickled state up to torch 2.14: dtype, layout, requires_grad, memory format, pin_memory


def _tensor_properties_portably(props: TensorProperties) -> tuple:
    """How pickle stores ``props``: as every torch does, with the state cut to the fields all of them read."""
    state = props.__getstate__()
    if getattr(props, "strides", None) is None:
        state = state[:_FIVE_FIELDS]
    return copyreg.__newobj__, (TensorProperties,), state


def without_strides(metadata: Metadata) -> Metadata:
    """``metadata`` (changed in place) with the ``strides`` field of each tensor's properties taken off.

    For megatron-core (0.16.1 and 0.19.2 seen), which rebuilds a tensor's metadata as
    ``torch.empty(size, **properties.__dict__)``: torch 2.15 sets ``strides`` on
    every ``TensorProperties`` it unpickles, and ``torch.empty`` takes no such
    argument. The attribute then reads as the class default, None (unset).
    """
    for item in metadata.state_dict_metadata.values():
        if isinstance(item, TensorStorageMetadata):
            vars(item.properties).pop("strides", None)
    return metadata


def pickled(metadata: Metadata) -> bytes:
    """``.metadata`` as torch's ``FileSystemWriter.finish`` pickles it, readable by older torch (see above)."""
    out = io.BytesIO()
    pickler = pickle.Pickler(out)
    pickler.dispatch_table = {**copyreg.dispatch_table, TensorProperties: _tensor_properties_portably}
    pickler.dump(metadata)
    return out.getvalue()


def metadata_bytes(records: Iterable[ShardRecord], checkpoint_dir: str) -> bytes:
    """``.metadata`` of ``records`` (:func:`build_metadata`), pickled."""
    return pickled(build_metadata(records, checkpoint_dir))
