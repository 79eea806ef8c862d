"""``FastPersistWriter``: torch.distributed.checkpoint's ``StorageWriter`` contract over our writer and commit.

Thin: DCP plans (which rank writes which chunk, replicated state written once
by its dedup planner), stages (``async_save``'s stager) and gathers; this
class turns each rank's planned items into our records, framed as DCP's own
files frame them (a ``torch.save`` archive per tensor chunk, the raw bytes of
any other object), writes them through the engine's writer
(``storage/writer.py``: DeepNVMe, O_DIRECT, every block checksummed as it
streams) into ``__<rank>_0.distcp``, and hands DCP the records as its write
results. The coordinator's ``finish`` commits: our index (the records and
their checksums, and the digest of ``.metadata``), then DCP's ``.metadata``,
last and atomically: what DCP's ``FileSystemReader`` reads, and our
``FastPersistReader`` too, checked.
"""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ..engine.directory import invalidate
from ..format.checksum import digest_bytes
from ..format.dcp_metadata import pickled
from ..format.kinds import DCP_METADATA_FILE, TORCH_DIST
from ..format.records import INDEX_FILE, KIND_OBJECT, KIND_TENSOR, CheckpointIndex, ShardRecord, dtype_name
from ..plan.writes import place_in_rank_file
from ..storage import writer
from ..storage.files import atomic_write, fsync_path
from ..util.config import WriteConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _RankFile:
    """A rank's part of the global plan: its data file."""

    rank: int
    name: str


def _record(item: WriteItem, data: Any, file: str) -> tuple[ShardRecord, torch.Tensor]:
    """One planned item as our record (not placed yet) and the tensor of its bytes."""
    if item.type == WriteItemType.BYTE_IO:
        payload = torch.frombuffer(bytearray(data.getbuffer()), dtype=torch.uint8)
        return ShardRecord(item.index.fqn, KIND_OBJECT, None, (), (), (), None, 0, None, 0, file, 0,
                           payload.numel()), payload
    tensor = data.detach()
    chunk = item.tensor_data.chunk
    return ShardRecord(item.index.fqn, KIND_TENSOR, dtype_name(tensor.dtype), tuple(chunk.sizes),
                       tuple(item.tensor_data.size), tuple(chunk.offsets), None, 0, None, 0, file, 0,
                       tensor.numel() * tensor.element_size()), tensor


class FastPersistWriter(StorageWriter):
    """Writes a DCP checkpoint into the directory ``path`` through DeepSpeed DeepNVMe, every byte checksummed.

    ``dcp.save(state_dict, storage_writer=FastPersistWriter(path))``, or
    ``dcp.async_save`` (either async kind; staging is DCP's stager's). Knobs:
    :class:`fastpersist_dist.WriteConfig`'s (``io_buffer_mb`` ...), or
    ``config=``.
    """

    def __init__(self, path: Union[str, os.PathLike], config: Optional[WriteConfig] = None, **knobs: Any):
        super().__init__()
        if config is not None and knobs:
            raise ValueError("pass either config= or individual knobs, not both")
        self.path = os.path.abspath(str(path))
        self.config = config or WriteConfig(**knobs)

    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None:
        if checkpoint_id is not None:
            self.path = os.path.abspath(str(checkpoint_id))

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """The coordinator makes the directory and takes the commit markers of a checkpoint there away (and its
        files but for the data files this save rewrites) before any rank writes: DCP's planning collectives
        come between."""
        if is_coordinator:
            os.makedirs(self.path, exist_ok=True)
            world = dist.get_world_size() if dist.is_initialized() else 1
            invalidate(self.path, frozenset(TORCH_DIST.data_file(r) for r in range(world)))

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [SavePlan(p.items, _RankFile(rank, TORCH_DIST.data_file(rank)), p.planner_data, p.usable)
                for rank, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> "Future[list[WriteResult]]":
        """This rank's items in its data file, written and checksummed; their records as DCP's write results."""
        part: _RankFile = plan.storage_data
        pairs = [_record(item, planner.resolve_data(item), part.name) for item in plan.items]
        frames = [TORCH_DIST.frame(record) for record, _ in pairs]
        placed = place_in_rank_file([r for r, _ in pairs], part.name, [(len(p), len(s)) for p, s in frames])
        items = [writer.WriteItem(r, t, p, s) for r, (_, t), (p, s) in zip(placed, pairs, frames)]
        done: Future[list[WriteResult]] = Future()
        if not items:
            done.set_result([])
            return done
        written = writer.write_rank_file(os.path.join(self.path, part.name), items, self.config, part.rank)
        done.set_result([WriteResult(index=item.index, size_in_bytes=r.length, storage_data=r)
                         for item, r in zip(plan.items, written.records)])
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """The coordinator's commit: our index, then ``.metadata`` (the checkpoint's marker), each atomic."""
        records = [res.storage_data for rank in results for res in rank]
        metadata.storage_data = {res.index: _StorageInfo(res.storage_data.file, res.storage_data.offset,
                                                         res.storage_data.length) for rank in results for res in rank}
        data = pickled(metadata)
        sizes: dict[str, int] = {}
        for r in records:
            sizes[r.file] = max(sizes.get(r.file, 0), r.offset + r.length)
        index = CheckpointIndex(world_size=len(results), checksum_block_bytes=self.config.checksum_block_bytes,
                                files=sizes, records=tuple(records), container=TORCH_DIST.container,
                                metadata_xxh3_64=digest_bytes(data))
        atomic_write(os.path.join(self.path, INDEX_FILE), index.to_json_bytes())
        atomic_write(os.path.join(self.path, DCP_METADATA_FILE), data)
        fsync_path(self.path)
        logger.info("fastpersist: committed %s: %d files, %.3f GiB, %d records", self.path, len(sizes),
                    sum(sizes.values()) / 2**30, len(records))

    def storage_meta(self) -> Optional[StorageMeta]:
        return StorageMeta(checkpoint_id=self.path, save_id=str(uuid.uuid4()))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike]) -> bool:
        return FileSystem.validate_checkpoint_id(checkpoint_id)
