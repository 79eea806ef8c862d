"""Where a load finds each file of a tiered checkpoint: this node's copy, then a copy another rank of the load
holds (``read_exchange.py``), then the persistent tier (docs/design.md, "Loading a tiered checkpoint").

Before the checkpoint is durable, a persistent copy is looked up (its drain marker) only for a file this node
lacks or whose nearer copies failed. From an object store the index and each data file are fetched into this
node's copy first, once a node.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Optional

from ...format.checksum import digest_bytes
from ...format.records import INDEX_FILE, CheckpointIndex
from ...format.tiers import DURABLE, TIERS_FILE, TierManifest, local_copy_dir
from ...storage.copy import AtomicFile
from ...storage.spans import block_spans
from ...storage.files import made_once
from ...storage.persistent import PersistentDir, PosixDir, checkpoint_url, persistent_dir
from ...util.errors import CorruptCheckpointError, FastPersistError
from ...util.events import FETCHED, UNREACHABLE, event
from .state import (check_current, drained_files, drained_marker, newest_durable_beside, pending_dir,
                    read_manifest)
from .topology import describe_node

logger = logging.getLogger(__name__)


# Up to this many files' persistent copies are looked up one marker each; more, with one listing of the
# persistent tier (on an object store a listing is a request per thousand names, data files and markers).
LOOKUPS_MAX = 16


@dataclass
class Copies:
    """Where one load reads a tiered checkpoint from (see the module); a ``storage.reader.CopySource``."""

    checkpoint_dir: str
    manifest: TierManifest
    local: str  # this node's copy
    index_dir: str  # a local directory holding the index files
    # data file -> the copies known so far, nearest first
    dirs: dict[str, tuple[str, ...]] = field(default_factory=dict)
    home: Optional[PersistentDir] = None  # an object store the data files are fetched from (None: a filesystem)
    local_ok: bool = False  # whether this node's copy is of this checkpoint
    offline: bool = False  # the persistent tier cannot be reached: the local tiers alone are read
    independent: bool = False  # no rank reads for another in this load (share_reads="off")
    looked: set[str] = field(default_factory=set)  # data files whose persistent copy was looked for
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def of(self, name: str) -> tuple[str, ...]:
        return self.dirs.get(name, ())

    def near(self) -> frozenset[str]:
        """The data files this node's own copy holds: what a shared load prefers this node to read for the ranks
        that need them, before any rank reads the persistent tier."""
        return frozenset(name for name, where in self.dirs.items() if where[:1] == (self.local,))

    def locate(self, requested: Iterable[str], independent: bool = False) -> None:
        """Find this node's copies of every file and the persistent tier's: all of them where the checkpoint is
        durable, else those of the ``requested`` files this node lacks (others on demand: :meth:`further`).
        ``independent``: no rank reads for another in this load (``share_reads="off"``)."""
        self.independent = independent
        home = persistent_dir(self.checkpoint_dir).url if self.manifest.state == DURABLE and not self.offline else None
        for data_file in self.manifest.files:
            found = [self.local] if self.local_ok and os.path.exists(os.path.join(self.local, data_file)) else []
            if home is not None:
                found.append(home)
            if found:
                self.dirs[data_file] = tuple(found)
        if home is not None:
            self.looked.update(self.manifest.files)
        self._look_up([f for f in requested if f in self.manifest.files and f not in self.dirs])

    def further(self, name: str) -> bool:
        """Add the persistent tier's copy of ``name`` where it was not looked for yet and is there; whether it was."""
        with self._lock:
            known = len(self.of(name))
            self._look_up([name])
            return len(self.of(name)) > known

    def _look_up(self, names: list[str]) -> None:
        """Add the persistent tier to the copies of those of ``names`` copied there and checked (their drain markers;
        the state durable by now: all of them)."""
        names = [n for n in names if n not in self.looked]
        if not names or self.offline:
            return
        self.looked.update(names)
        home = persistent_dir(self.checkpoint_dir)
        if len(names) > LOOKUPS_MAX:
            there = drained_files(home, self.manifest) & set(names)
        else:
            there = {n for n in names if home.read(drained_marker(self.manifest, n)) is not None}
        if len(there) < len(names):  # markers go once the checkpoint is durable
            current = read_manifest(home)
            if current is not None and current.checkpoint_id == self.manifest.checkpoint_id \
                    and current.state == DURABLE:
                there = set(names)
        for name in there:
            self.dirs[name] = (*self.of(name), home.url)
        logger.debug("fastpersist: %s: %d of %d data files looked up are on the persistent tier %s", describe_node(),
                     len(there), len(names), home.url)

    def why_missing(self, name: str) -> str:
        """Why no copy of data file ``name`` can be read from this node, naming the newest durable checkpoint beside
        it where no rank of the load reads it for this one."""
        if name not in self.manifest.files:
            return "it is in no tier this load knows"
        holders = ", ".join(str(n) for n in self.manifest.holders(name))
        why = ("; this node has no copy, and with share_reads='off' no other rank reads it for this one: load with "
               "share_reads='auto' (collective) to read it from those nodes" if self.independent
               else f", and no rank of this load holds an intact copy{newest_durable_beside(self.checkpoint_dir)}")
        return (f"{name} (rank {self.manifest.files[name]}) of checkpoint {self.checkpoint_dir}, which is not durable, "
                f"is kept only in the local tiers of nodes {holders}{why}")

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
                            home.where(data_file), size / 2**30, self.local, time.perf_counter() - start,
                            extra=event(FETCHED, file=data_file))
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


def tiers_manifest(checkpoint_dir: str, local_dir: Optional[str], who: str) -> tuple[Optional[TierManifest], bool]:
    """The tiers manifest of ``checkpoint_dir`` (None: not tiered), and whether it is this node's copy's, read
    because the persistent tier cannot be reached: then the load reads the local tiers alone, warned. That takes
    ``local_dir``, this node's local tier (the manifest naming it is out of reach)."""
    try:
        return read_manifest(persistent_dir(checkpoint_dir)), False
    except CorruptCheckpointError:
        raise
    except FastPersistError as e:
        if local_dir is None:
            raise
        local = local_copy_dir(local_dir, checkpoint_dir)
        try:
            mine = read_manifest(PosixDir(local))
        except FastPersistError:
            mine = None
        if mine is None or checkpoint_url(mine.checkpoint_dir) != checkpoint_url(checkpoint_dir):
            raise FastPersistError(f"{e}; this node's copy {local} is not of it either") from e
        logger.warning("fastpersist: %s: the persistent tier of %s cannot be reached (%s): loading checkpoint %s "
                       "from the local tiers alone, as this node's copy %s records it (%s)", who, checkpoint_dir, e,
                       mine.checkpoint_id, local, mine.state, extra=event(UNREACHABLE, checkpoint=checkpoint_dir))
        return mine, True


def copies_for_load(checkpoint_dir: str, manifest: TierManifest, who: str, local_dir: Optional[str] = None,
                    check: bool = True, offline: bool = False) -> Copies:
    """Where a load of the tiered checkpoint ``checkpoint_dir`` (``manifest``: its tiers manifest) reads.
    ``local_dir``: this node's local tier (default: the one the checkpoint records); ``check``: whether this rank
    checks the manifest against what is committed beside it (``state.check_current``; one rank of a load whose
    ranks fail together); ``offline``: the persistent tier cannot be reached (:func:`tiers_manifest`). Raises
    ``FastPersistError`` where no index of it can be found."""
    home, since = persistent_dir(checkpoint_dir), time.time()
    if check and not offline:
        check_current(home, manifest, who)
    local = local_copy_dir(local_dir or manifest.local_dir, checkpoint_dir)
    copies = Copies(checkpoint_dir, manifest, local, local, home=None if home.local_path is not None or offline
                    else home, local_ok=_same_checkpoint(local, manifest), offline=offline)
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
    # once per node: its other ranks find the copy restored since this load started (the manifest put in place last)
    os.makedirs(local, exist_ok=True)
    made = made_once(os.path.join(local, TIERS_FILE), lambda: _restore_index(source, manifest, local, who), since)
    if not made and not _same_checkpoint(local, manifest):  # another save's, restored by a load of it meanwhile
        _restore_index(source, manifest, local, who)
        made = True
    if made:
        logger.info("fastpersist: %s: the index of %s fetched into this node's copy %s", who, checkpoint_dir, local,
                    extra=event(FETCHED, file=INDEX_FILE))
    else:
        logger.debug("fastpersist: %s: the index of %s was fetched into %s by another rank of this node", who,
                     checkpoint_dir, local)
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
