"""Where a load finds each file of a tiered checkpoint: the nearest intact copy first.

For each data file, in order: this node's local copy (its own ranks' files
and the replicas it keeps for other nodes), when that copy is of the same
checkpoint (same id); then the persistent tier, once the file was copied
there and checked (the checkpoint durable, or the file's drain marker there).
Files this rank cannot reach are read by a rank that can (another node's
local copy: ``read_exchange.py``); a copy whose bytes fail their checksums is
left for the next one (``storage/reader.py``).

The index comes from this node's copy, else from the persistent tier: its
committed index once durable, before that the pending one. From an object
store, the index and each data file a rank reads are fetched into this node's
local copy first (checked on the way), which then serves the next load; the
ranks of a node that need the same file fetch it once (``storage.files.made_once``).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

from ...format.checksum import digest_bytes
from ...format.records import INDEX_FILE, CheckpointIndex
from ...format.tiers import DURABLE, TIERS_FILE, TierManifest, local_copy_dir
from ...storage.copy import AtomicFile, block_spans
from ...storage.files import made_once
from ...storage.persistent import PersistentDir, PosixDir, persistent_dir
from ...util.errors import FastPersistError
from .state import drained_files, newest_durable_beside, pending_dir, read_manifest
from .topology import describe_node

logger = logging.getLogger(__name__)


@dataclass
class Copies:
    """Where one load reads a tiered checkpoint from (see the module)."""

    checkpoint_dir: str
    manifest: TierManifest
    local: str  # this node's copy
    index_dir: str  # a local directory holding the index files
    # data file -> its copies' directories, nearest first
    dirs: dict[str, tuple[str, ...]] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)  # data file -> why no copy is reachable from here
    home: Optional[PersistentDir] = None  # an object store the data files are fetched from (None: a filesystem)
    local_ok: bool = False  # whether this node's copy is of this checkpoint

    def of(self, data_file: str) -> tuple[str, ...]:
        return self.dirs.get(data_file, ())

    def locate(self, independent: bool = False) -> None:
        """Each data file's copies (this node's, the persistent tier's): every file of the checkpoint, whichever a
        load requests, since a rank may read for another one that it cannot reach. ``independent``: no rank reads
        for another in this load (``share_reads="off"``), which the error for a file out of reach says."""
        durable = self.manifest.state == DURABLE
        home = persistent_dir(self.checkpoint_dir)
        files = sorted(self.manifest.files)
        there = set(files) if durable else drained_files(home, self.manifest)
        for data_file in files:
            found = [self.local] if self.local_ok and os.path.exists(os.path.join(self.local, data_file)) else []
            if data_file in there:
                found.append(home.url)
            if found:
                self.dirs[data_file] = tuple(found)
        unreachable = [f for f in files if f not in self.dirs]
        if unreachable:
            beside = newest_durable_beside(self.checkpoint_dir)
            for f in unreachable:
                rank = self.manifest.files[f]
                holders = ", ".join(str(n) for n in self.manifest.holders(f))
                why = ("; this node has no copy, and with share_reads='off' no other rank reads it for this one: "
                       "load with share_reads='auto' (collective) to read it from those nodes" if independent
                       else f", and no rank of this load holds an intact copy{beside}")
                self.missing[f] = (f"{f} (rank {rank}) of checkpoint {self.checkpoint_dir}, which is not durable, is "
                                   f"kept only in the local tiers of nodes {holders}{why}")

    def fetcher(self, whole: Callable[[], CheckpointIndex],
                who: str) -> Optional[tuple[str, str, Callable[[str], str]]]:
        """(the object store's URL, this node's copy, a function fetching a data file from there into it), None for
        a filesystem: the reader then opens the persistent tier's files where they are. ``whole``: the whole index
        (a fetch checks every block of the file)."""
        if self.home is None:
            return None
        home, since = self.home, time.time()  # a file another rank of this node fetched since then is this load's

        def fetch(data_file: str) -> str:
            index = whole()
            path = os.path.join(self.local, data_file)
            size = index.files[data_file]
            spans = block_spans([r for r in index.records if r.file == data_file], index.checksum_block_bytes,
                                size, home.where(data_file))
            start = time.perf_counter()
            if made_once(path, lambda: home.fetch(data_file, path, spans, size, who), since):
                logger.info("fastpersist: %s: fetched %s (%.3f GiB) into %s in %.2f s, every block checked", who,
                            home.where(data_file), size / 2**30, self.local, time.perf_counter() - start)
            else:
                logger.debug("fastpersist: %s: %s was fetched into %s by another rank of this node meanwhile (waited "
                             "%.2f s)", who, data_file, self.local, time.perf_counter() - start)
            return path

        return home.url, self.local, fetch


def _same_checkpoint(local: str, manifest: TierManifest) -> bool:
    """Whether the node's copy at ``local`` is of ``manifest``'s checkpoint (same id), index committed."""
    try:
        mine = read_manifest(PosixDir(local))
    except FastPersistError as e:
        logger.warning("fastpersist: %s: this node's copy %s is unusable (%s); looking elsewhere", describe_node(),
                       local, e)
        return False
    return (mine is not None and mine.checkpoint_id == manifest.checkpoint_id
            and os.path.exists(os.path.join(local, INDEX_FILE)))


def tiers_manifest(checkpoint_dir: str) -> Optional[TierManifest]:
    """The tiers manifest of ``checkpoint_dir``, None for a checkpoint that is not tiered."""
    return read_manifest(persistent_dir(checkpoint_dir))


def copies_for_load(checkpoint_dir: str, manifest: TierManifest, who: str, local_dir: Optional[str] = None) -> Copies:
    """Where a load of the tiered checkpoint ``checkpoint_dir`` (``manifest``: its tiers manifest) reads.

    ``local_dir``: the local tier's root on this node (default: the one the
    checkpoint records). Raises ``FastPersistError`` where no index of it can
    be found, naming the newest durable checkpoint beside it.
    """
    home = persistent_dir(checkpoint_dir)
    local = local_copy_dir(local_dir or manifest.local_dir, checkpoint_dir)
    copies = Copies(checkpoint_dir, manifest, local, local, home=None if home.local_path is not None else home,
                    local_ok=_same_checkpoint(local, manifest))
    if copies.local_ok:
        return copies
    source = home if manifest.state == DURABLE else pending_dir(home)
    if home.local_path is not None:
        index = source.read(INDEX_FILE)
        if index is None:
            raise FastPersistError(f"{who}: checkpoint {checkpoint_dir} has no index in {source.url} and this "
                                   f"node's copy {local} is not of it{newest_durable_beside(checkpoint_dir)}")
        _check_tied(index, manifest, source.where(INDEX_FILE))
        return replace(copies, index_dir=str(source.local_path))
    _restore_index(source, manifest, local, who)
    return replace(copies, local_ok=True)


def _check_tied(index: bytes, manifest: TierManifest, where: str) -> None:
    """The index read is the one the manifest names (not one of a save into the same directory under way)."""
    if digest_bytes(index) != manifest.index_xxh3_64:
        raise FastPersistError(f"{where} is not the index of the checkpoint its tiers manifest describes (a save into "
                               f"{manifest.checkpoint_dir} under way?); try again once that save is committed")


def _write_whole(path: str, data: bytes) -> None:
    out = AtomicFile(path)  # under a name of this process's: the node's other ranks may write the same file
    try:
        out.write(data)
        out.commit()
    except BaseException:
        out.abandon()
        raise


def _restore_index(source: PersistentDir, manifest: TierManifest, local: str, who: str) -> None:
    """The index files from ``source`` (an object store) into this node's copy ``local``, then its manifest:
    the copy is of this checkpoint from then on, holding whichever data files get fetched into it."""
    os.makedirs(local, exist_ok=True)
    for name in manifest.index_files:
        data = source.read(name)
        if data is None:
            raise FastPersistError(f"{who}: checkpoint {manifest.checkpoint_dir}: {source.where(name)} is missing "
                                   f"and this node's copy {local} is not of it"
                                   f"{newest_durable_beside(manifest.checkpoint_dir)}")
        if name == INDEX_FILE:
            _check_tied(data, manifest, source.where(name))
        _write_whole(os.path.join(local, name), data)
    _write_whole(os.path.join(local, TIERS_FILE), manifest.to_json_bytes())
    logger.info("fastpersist: %s: the index of %s fetched into this node's copy %s", who, manifest.checkpoint_dir,
                local)
