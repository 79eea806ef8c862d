"""``FastPersistReader``: torch.distributed.checkpoint's ``StorageReader`` contract over our reader, checked.

Thin: DCP plans which rank reads which piece of which stored chunk into which
tensor (resharding through its planners); this class finds each stored chunk's
record in our index by its place in its file (DCP's ``.metadata`` says where),
and reads the piece through the engine's reader (``storage/reader.py``), every
checksum block it touches verified. ``.metadata`` is the one our index names
(its XXH3). A DCP checkpoint without our index (written by DCP's own
``FileSystemWriter``) is read by DCP's ``FileSystemReader``, unchecked, as it
says once.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
from typing import Any, Optional, Union

import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..engine.index_reader import read_index
from ..format.checksum import digest_bytes
from ..format.dcp_metadata import stored_box
from ..format.kinds import DCP_METADATA_FILE
from ..format.records import INDEX_FILE, CheckpointIndex, ShardRecord
from ..storage.reader import ShardReader
from ..util.errors import CorruptCheckpointError

logger = logging.getLogger(__name__)


def _who() -> str:
    return f"rank {dist.get_rank() if dist.is_initialized() else 0}"


class FastPersistReader(StorageReader):
    """Reads the DCP checkpoint in the directory ``path``, verifying every block against our index.

    ``dcp.load(state_dict, storage_reader=FastPersistReader(path))``.
    """

    def __init__(self, path: Union[str, os.PathLike]):
        super().__init__()
        self.path = os.path.abspath(str(path))
        self._index: Optional[CheckpointIndex] = None
        self._stock: Optional[FileSystemReader] = None  # a checkpoint without our index
        self._metadata: Optional[Metadata] = None

    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None:
        if checkpoint_id is not None:
            self.path = os.path.abspath(str(checkpoint_id))
        self._index = self._stock = self._metadata = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's ``.metadata``, once checked against our index's digest of it."""
        if not os.path.exists(os.path.join(self.path, INDEX_FILE)):
            if self._stock is None:
                logger.warning("fastpersist: %s has no %s (written by another DCP writer): reading it with DCP's "
                               "FileSystemReader, without checksums", self.path, INDEX_FILE)
                self._stock = FileSystemReader(self.path)
            return self._stock.read_metadata(*args, **kwargs)
        who = _who()
        self._index = read_index(self.path, who)
        where = os.path.join(self.path, DCP_METADATA_FILE)
        with open(where, "rb") as f:
            data = f.read()
        if digest_bytes(data) != self._index.metadata_xxh3_64:
            raise CorruptCheckpointError(f"{who}: {where} is not the one committed with {INDEX_FILE} (its XXH3 "
                                         "differs): the checkpoint was rewritten or damaged")
        return pickle.loads(data)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._metadata = metadata
        if self._stock is not None:
            self._stock.set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> "Future[None]":
        """Each planned piece read, verified, into the tensor DCP's planner names (objects: its bytes)."""
        if self._stock is not None:
            return self._stock.read_data(plan, planner)
        assert self._index is not None and self._metadata is not None, "read_metadata first"
        placed: dict[tuple[str, int], ShardRecord] = {(r.file, r.offset): r for r in self._index.records}
        with ShardReader(self.path, self._index, True, _who()) as reader:
            for item in plan.items:
                info = self._metadata.storage_data[item.storage_index]
                record = placed.get((info.relative_path, info.offset))
                if record is None or record.length != info.length:
                    raise CorruptCheckpointError(
                        f"{_who()}: {self.path}: {item.storage_index.fqn} lies at {info.relative_path} bytes "
                        f"{info.offset}+{info.length} by {DCP_METADATA_FILE}, where {INDEX_FILE} has no record")
                if item.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(item, io.BytesIO(reader.read_object(record)))
                    continue
                dest = planner.resolve_tensor(item).detach()
                reader.read_box(record, stored_box(record), tuple(item.storage_offsets), tuple(item.lengths), dest)
                planner.commit_tensor(item, dest)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike]) -> bool:
        return FileSystem.validate_checkpoint_id(checkpoint_id)
