"""Removing keys from a committed checkpoint (megatron's ``remove_sharded_tensors``), crash-safe and resumable.

Each step is idempotent, and they run in an order where a crash at any point
leaves a checkpoint that loads right or refuses to load; running the removal
again finishes it:

1. :func:`free_removed_bytes`: the removed records' bytes are punched out of
   the data files. Offsets and file sizes stay, so every kept record and its
   checksums are untouched; a removed record the index still lists reads as
   zeros, which fail its checksums.
2. :func:`write_dcp_metadata` (``torch_dist`` only): DCP's ``.metadata`` is
   rebuilt from the kept records. megatron's and torch's loaders see the
   removal from here on; ours refuses the checkpoint until step 3, since the
   index names the old ``.metadata``.
3. :func:`commit_index`: the index without the removed keys replaces the old
   one (one rename).

The removed keys' pages stay in the index part files, listed by nothing. A
checkpoint saved with ``separation_hint`` equal to the prefix holds the
removed bytes as one range at the end of each data file. Where the filesystem
punches no holes, their bytes stay where they are (a warning says how many);
the rest of the removal holds.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, replace
from typing import Optional, Union

from ..format.checksum import digest_bytes
from ..format.dcp_metadata import metadata_bytes
from ..format.index_pages import PagedIndex
from ..format.kinds import DCP_METADATA_FILE
from ..format.records import CONTAINER_TORCH_SAVE, INDEX_FILE, CheckpointIndex, ShardRecord
from ..format.tiers import TIERS_FILE
from ..storage.files import atomic_write, cannot_punch, punch_holes
from ..util.errors import FastPersistError
from .index_reader import read_top_and_records

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Removal:
    """What a removal took out of a checkpoint."""

    keys: tuple[str, ...]  # sorted
    records: int
    nbytes: int  # bytes of the removed records
    freed: bool  # whether the filesystem gave those bytes back


@dataclass(frozen=True)
class Committed:
    """A committed checkpoint as the removal sees it: its top level and every record."""

    directory: str
    top: Union[PagedIndex, CheckpointIndex]
    index: CheckpointIndex

    @classmethod
    def read(cls, checkpoint_dir: str, who: str) -> "Committed":
        """Every record of ``checkpoint_dir`` (a filesystem directory, not a tiered checkpoint)."""
        if "://" in checkpoint_dir:
            raise FastPersistError(f"{who}: removing keys needs a filesystem directory, not {checkpoint_dir}")
        if os.path.exists(os.path.join(checkpoint_dir, TIERS_FILE)):
            raise FastPersistError(
                f"{who}: {checkpoint_dir} is a tiered checkpoint: the copies in the nodes' local tiers keep their "
                "own index, so keys cannot be removed from it in one place; load it and save it untiered instead")
        return cls(checkpoint_dir, *read_top_and_records(checkpoint_dir, who))

    def split(self, key_prefix: str) -> tuple[list[ShardRecord], list[ShardRecord]]:
        """(kept, removed) records."""
        kept = [r for r in self.index.records if not r.key.startswith(key_prefix)]
        removed = [r for r in self.index.records if r.key.startswith(key_prefix)]
        return kept, removed


def free_removed_bytes(checkpoint: Committed, removed: list[ShardRecord], who: str) -> bool:
    """Step 1: punch the bytes of ``removed`` out of their data files; whether the filesystem could."""
    by_file: dict[str, list[tuple[int, int]]] = {}
    for r in sorted(removed, key=lambda r: (r.file, r.offset)):
        ranges = by_file.setdefault(r.file, [])
        if ranges and ranges[-1][0] + ranges[-1][1] == r.offset:  # adjacent (separation_hint): one hole
            ranges[-1] = (ranges[-1][0], ranges[-1][1] + r.length)
        else:
            ranges.append((r.offset, r.length))
    for name, ranges in sorted(by_file.items()):
        path = os.path.join(checkpoint.directory, name)
        try:
            punch_holes(path, ranges)
        except OSError as e:
            if cannot_punch(e):
                logger.warning("fastpersist: %s: the filesystem of %s punches no holes: the removed keys' %d bytes "
                               "stay in its data files (%s)", who, checkpoint.directory,
                               sum(r.length for r in removed), e)
                return False
            raise FastPersistError(f"{who}: freeing the removed keys' bytes in {path} failed: {e}") from e
    return True


def write_dcp_metadata(checkpoint: Committed, kept: list[ShardRecord]) -> Optional[str]:
    """Step 2 (``torch_dist``): DCP's ``.metadata`` of the kept records; its XXH3 (None for the native format)."""
    if checkpoint.index.container != CONTAINER_TORCH_SAVE:
        return None
    data = metadata_bytes(kept, checkpoint.directory)
    atomic_write(os.path.join(checkpoint.directory, DCP_METADATA_FILE), data)
    return digest_bytes(data)


def commit_index(checkpoint: Committed, key_prefix: str, kept: list[ShardRecord], metadata: Optional[str]) -> None:
    """Step 3: the index without the keys beginning with ``key_prefix`` replaces the old one."""
    top = checkpoint.top
    if isinstance(top, PagedIndex):
        new: Union[PagedIndex, CheckpointIndex] = replace(
            top, keys={k: e for k, e in top.keys.items() if not k.startswith(key_prefix)},
            metadata_xxh3_64=metadata or top.metadata_xxh3_64)
    else:
        new = replace(top, records=tuple(kept), metadata_xxh3_64=metadata or top.metadata_xxh3_64)
    atomic_write(os.path.join(checkpoint.directory, INDEX_FILE), new.to_json_bytes())


def remove_keys(checkpoint_dir: str, key_prefix: str) -> Removal:
    """Remove every key beginning with ``key_prefix`` from the checkpoint (see the module); nothing to remove: an
    empty :class:`Removal`. Run it in one process while nothing else writes or loads the checkpoint."""
    if not key_prefix:
        raise ValueError("key_prefix must not be empty: it would remove every key")
    who = f"pid {os.getpid()} on {socket.gethostname()}"
    checkpoint = Committed.read(checkpoint_dir, who)
    kept, removed = checkpoint.split(key_prefix)
    if not removed:
        return Removal((), 0, 0, True)
    freed = free_removed_bytes(checkpoint, removed, who)
    commit_index(checkpoint, key_prefix, kept, write_dcp_metadata(checkpoint, kept))
    removal = Removal(tuple(sorted({r.key for r in removed})), len(removed), sum(r.length for r in removed), freed)
    logger.info("fastpersist: removed %d keys beginning with %r from %s (%d records, %.3f GiB%s)", len(removal.keys),
                key_prefix, checkpoint_dir, removal.records, removal.nbytes / 2**30, "" if freed else ", not freed")
    return removal
