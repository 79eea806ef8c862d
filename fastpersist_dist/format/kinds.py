"""The two on-disk formats the engine writes, as plain descriptions. Pure.

* ``fastpersist`` (native): records back to back in ``fastpersist_r<rank>.bin``,
  committed by ``fastpersist_index.json``. Read by our loader only; fastest to
  read and resharded without unpickling anything.
* ``torch_dist``: torch DCP files (``__<rank>_0.distcp`` + ``.metadata``), the
  format of megatron's ``torch_dist`` backend, so megatron's stock loader and
  ``torch.distributed.checkpoint.load`` read it. Each tensor record is a
  ``torch.save`` archive (see ``torch_container``); ``fastpersist_index.json``
  is a sidecar with every record's byte range and checksums, and ``.metadata``
  (written last) commits the checkpoint.

Everything format-specific the engine needs is a field or method here: file
names, the commit marker, how a record is framed and how an object is
serialized. megatron's ``metadata.json`` names ``backend``/``version``.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import torch

from ..util.errors import FastPersistError
from .dcp_metadata import stored_box
from .records import (
    BACKEND,
    BACKEND_VERSION,
    CONTAINER_RAW,
    CONTAINER_TORCH_SAVE,
    INDEX_FILE,
    KIND_TENSOR,
    ShardRecord,
    data_file_name,
    dtype_from_name,
)
from .torch_container import tensor_container

DCP_METADATA_FILE = ".metadata"  # torch.distributed.checkpoint's name
MEGATRON_CONFIG_FILE = "metadata.json"  # megatron-core's (dist_checkpointing.core.CONFIG_FNAME): backend, version


@dataclass(frozen=True)
class CheckpointFormat:
    """One on-disk format: names, commit marker, record framing, object serialization."""

    name: str  # what users pass as ``checkpoint_format``
    backend: str  # megatron's metadata.json "sharded_backend"
    version: int  # ... and "sharded_backend_version"
    container: str

    @property
    def marker(self) -> str:
        """The file written last at commit and removed first when overwriting: it makes the checkpoint."""
        return DCP_METADATA_FILE if self.container == CONTAINER_TORCH_SAVE else INDEX_FILE

    @property
    def dcp_readable(self) -> bool:
        """Whether torch DCP (and so megatron-core 0.17+'s common-state loader) can read its items."""
        return self.container == CONTAINER_TORCH_SAVE

    def data_file(self, rank: int) -> str:
        """Name of ``rank``'s data file."""
        return data_file_name(rank, self.container)

    def frame(self, record: ShardRecord) -> tuple[bytes, bytes]:
        """Bytes written before and after a record's elements: a torch.save archive of its one box."""
        if self.container == CONTAINER_RAW or record.kind != KIND_TENSOR:
            return b"", b""
        container = tensor_container(dtype_from_name(record.dtype), stored_box(record).shape)
        return container.prefix, container.suffix

    def object_payload(self, data: Any) -> bytes:
        """Serialized ShardedObject: ``torch.save`` of it, or of a one-item list as megatron's torch_dist does."""
        buf = io.BytesIO()
        torch.save([data] if self.container == CONTAINER_TORCH_SAVE else data, buf)
        return buf.getvalue()

    def object_from_loaded(self, loaded: Any, where: str) -> Any:
        """The object from what ``torch.load`` returned for a payload (see :meth:`object_payload`)."""
        if self.container != CONTAINER_TORCH_SAVE:
            return loaded
        if not isinstance(loaded, list) or len(loaded) != 1:
            raise FastPersistError(f"{where}: a torch_dist object payload must be a one-item list, got {type(loaded).__name__}")
        return loaded[0]


FASTPERSIST = CheckpointFormat("fastpersist", BACKEND, BACKEND_VERSION, CONTAINER_RAW)
TORCH_DIST = CheckpointFormat("torch_dist", "torch_dist", 1, CONTAINER_TORCH_SAVE)
FORMATS = {f.name: f for f in (FASTPERSIST, TORCH_DIST)}
BY_CONTAINER = {f.container: f for f in FORMATS.values()}
BACKENDS = sorted({(f.backend, f.version) for f in FORMATS.values()})  # what metadata.json may name for ours
# Each format's commit marker: removed first when a checkpoint is overwritten or removed, whichever format wrote it
MARKERS = tuple(sorted({f.marker for f in FORMATS.values()}))


def checkpoint_format(name: str) -> CheckpointFormat:
    """The format called ``name``; raises naming the choices."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"checkpoint_format must be one of {sorted(FORMATS)}, got {name!r}") from None
