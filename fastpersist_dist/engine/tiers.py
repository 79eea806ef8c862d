"""Tiered checkpoints: each node's local tier first, then the persistent tier in the background.

A save with a ``TierConfig`` writes each rank's data file into its node's copy
of the checkpoint (``format.tiers.local_copy_dir``) through the usual engine;
the local commit (:meth:`TieredSave.commit`, at finalize) writes the index into
every node's copy, then the tiers manifest there, and, into the persistent
directory (the ``checkpoint_dir`` given to ``save()``), the manifest in state
``local`` and the small files megatron reads before any strategy (``common.pt``):
the checkpoint is loadable from the local tiers from then on.

Then each rank's :class:`Mover` thread copies the rank's data file to the
persistent directory, checking every block against the index
(``storage/copy.py``), and leaves a marker there; rank 0's, once every rank's
marker is there, copies the index files in commit order, the format's marker
last, and sets the manifest's state to ``durable``. Nothing of the persistent
directory's index exists before that, so it never shows durable early; a copy
that fails leaves it ``local`` and says why, and a newer save into the same
directory supersedes it.

"Node" is torchrun's (``GROUP_RANK``); without torchrun, the machine.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import shutil
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch.distributed as dist

from ..format.checksum import digest_bytes
from ..format.kinds import DCP_METADATA_FILE, CheckpointFormat
from ..format.records import INDEX_FILE, is_data_file
from ..format.tiers import DURABLE, LOCAL, TIERS_FILE, TierManifest, local_copy_dir
from ..storage.copy import copy_checked
from ..storage.files import atomic_write, fsync_path, unlink_quietly
from ..util.config import TierConfig
from ..util.errors import FastPersistError
from ..util.per_process import PerProcess
from .agreement import before_writing, failure
from .directory import invalidate
from .index_reader import read_index

logger = logging.getLogger(__name__)

DRAINED_PREFIX = ".fastpersist_drained."  # the persistent tier's marker of a data file copied and checked
POLL_S = 0.2


def _drained_marker(data_file: str) -> str:
    return f"{DRAINED_PREFIX}{data_file}.json"


def node_key() -> str:
    """This process's node: torchrun's node rank where torchrun started it, else the machine."""
    group = os.environ.get("GROUP_RANK")
    if group is not None:
        return f"node {group}"
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f"machine {f.read().strip()}"
    except OSError:
        return f"host {socket.gethostname()}"


def _topology() -> tuple[tuple[int, ...], ...]:
    """Collective: each node's ranks, nodes in the order of their first rank."""
    keys: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(keys, node_key())
    nodes: dict[str, list[int]] = {}
    for rank, key in enumerate(keys):
        nodes.setdefault(key, []).append(rank)
    return tuple(tuple(ranks) for ranks in nodes.values())


_topologies: PerProcess[dict[int, tuple[tuple[int, ...], ...]]] = PerProcess(dict)


def topology() -> tuple[tuple[int, ...], ...]:
    """Collective on first use in a process (per world size): each node's ranks."""
    known = _topologies.get()
    world = dist.get_world_size()
    if world not in known:
        known[world] = _topology()
    return known[world]


@dataclass(frozen=True)
class TieredSave:
    """One tiered save: where this rank writes, and who prepares which copy."""

    config: TierConfig
    checkpoint_dir: str  # the persistent tier's directory
    local: str  # this node's copy of the checkpoint
    nodes: tuple[tuple[int, ...], ...]
    rank: int

    @classmethod
    def start(cls, config: TierConfig, checkpoint_dir: str) -> "TieredSave":
        """Collective: this save's copies; this node's copy directory made (every rank, before any check)."""
        nodes = topology()
        local = local_copy_dir(config.local_dir, checkpoint_dir)
        os.makedirs(local, exist_ok=True)
        return cls(config, checkpoint_dir, local, nodes, dist.get_rank())

    @property
    def node(self) -> int:
        return next(n for n, ranks in enumerate(self.nodes) if self.rank in ranks)

    @property
    def node_leader(self) -> bool:
        """Whether this rank prepares and commits its node's copy (the node's first rank)."""
        return self.nodes[self.node][0] == self.rank

    def invalidate(self, rewritten: frozenset[str]) -> None:
        """Before anything is written: each node's copy (its leader), and the persistent directory's commit
        markers (rank 0): an overwritten checkpoint is recognisably incomplete in every tier from here on."""
        if self.node_leader:
            unlink_quietly(os.path.join(self.local, TIERS_FILE))
            invalidate(self.local, rewritten)
        if self.rank == 0:
            for name in (TIERS_FILE, INDEX_FILE, DCP_METADATA_FILE):
                unlink_quietly(os.path.join(self.checkpoint_dir, name))
            fsync_path(self.checkpoint_dir)

    def commit(self, finalize: Callable[[], Optional[list[tuple[str, bytes]]]], fmt: CheckpointFormat,
               aux_files: dict[str, bytes]) -> TierManifest:
        """Collective: the local commit (see the module), then this rank's copy to the persistent tier queued."""
        files = finalize()  # raises SaveFailedError on every rank where any rank failed
        assert files is not None
        index = dict(files)[INDEX_FILE]
        holder: list[Any] = [uuid.uuid4().hex if self.rank == 0 else None]
        dist.broadcast_object_list(holder, src=0)
        manifest = TierManifest(
            checkpoint_id=holder[0], checkpoint_dir=self.checkpoint_dir, local_dir=self.config.local_dir,
            nodes=self.nodes, files={fmt.data_file(r): r for r in range(dist.get_world_size())},
            index_files=tuple(name for name, _ in files), index_xxh3_64=digest_bytes(index), state=LOCAL,
            created=time.time(), persistent=self.config.persistent)
        what = f"cannot commit checkpoint {self.checkpoint_dir} to the local tiers"
        error = None
        try:
            if self.node_leader:
                for name, data in files:
                    atomic_write(os.path.join(self.local, name), data)
                atomic_write(os.path.join(self.local, TIERS_FILE), manifest.to_json_bytes())
            if self.rank == 0:
                for name, data in aux_files.items():  # megatron reads common.pt before asking any strategy
                    atomic_write(os.path.join(self.checkpoint_dir, name), data)
                atomic_write(os.path.join(self.checkpoint_dir, TIERS_FILE), manifest.to_json_bytes())
        except OSError as e:
            error = f"rank {self.rank} ({node_key()}): {type(e).__name__}: {e}"
        before_writing(what).agree(failure(error))
        if self.rank == 0:
            logger.info("fastpersist: %s committed to the local tiers of %d nodes (%s)%s", self.checkpoint_dir,
                        len(self.nodes), self.local, "; copying it to the persistent tier in the background"
                        if manifest.persistent else " (a local checkpoint: never copied to the persistent tier)")
        if manifest.persistent:
            mover().submit(_Drain(manifest, self.local, self.rank, fmt.data_file(self.rank)))
        if self.node_leader:
            _retain(self.config, manifest)
        return manifest


@dataclass(frozen=True)
class _Drain:
    manifest: TierManifest
    local: str
    rank: int
    data_file: str


class Mover:
    """This process's copies to the persistent tier, one after another, on a thread of their own."""

    def __init__(self) -> None:
        self._jobs: queue.Queue[_Drain] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="fastpersist-tier-mover", daemon=True)
        self._thread.start()

    def submit(self, job: _Drain) -> None:
        self._jobs.put(job)

    def idle(self, timeout: Optional[float] = None) -> bool:
        """Wait until every job queued so far is done (at most ``timeout`` seconds); whether they are."""
        end = None if timeout is None else time.monotonic() + timeout
        while self._jobs.unfinished_tasks:
            if end is not None and time.monotonic() > end:
                return False
            time.sleep(POLL_S)
        return True

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                _drain(job)
            except Exception as e:  # noqa: BLE001 - the checkpoint stays local; the next ones still move
                logger.error("fastpersist: rank %d: %s stays in the local tiers, its copy to the persistent tier "
                             "failed: %s", job.rank, job.manifest.checkpoint_dir, e)
            finally:
                self._jobs.task_done()


mover = PerProcess(Mover).get


def _superseded(manifest: TierManifest) -> bool:
    """Whether a newer save took over ``manifest``'s persistent directory (its manifest names another id)."""
    current = read_manifest(manifest.checkpoint_dir)
    return current is None or current.checkpoint_id != manifest.checkpoint_id


def _drain(job: _Drain) -> None:
    """One rank's part of moving a checkpoint to the persistent tier (see the module)."""
    m, who = job.manifest, f"rank {job.rank}"
    if job.rank == 0:
        _remove_stale(m)
    local_index = read_index(job.local, who)
    if _superseded(m):
        return
    size = local_index.files.get(job.data_file)
    if size is not None:  # a rank with nothing to write has no data file
        src, dst = os.path.join(job.local, job.data_file), os.path.join(m.checkpoint_dir, job.data_file)
        records = [r for r in local_index.records if r.file == job.data_file]
        seconds = copy_checked(src, dst, records, local_index.checksum_block_bytes, size, who)
        logger.debug("fastpersist: %s: %s copied to %s in %.2f s (%.2f GiB/s), every block checked", who, src, dst,
                     seconds, size / 2**30 / max(seconds, 1e-9))
    atomic_write(os.path.join(m.checkpoint_dir, _drained_marker(job.data_file)),
                 json.dumps({"checkpoint_id": m.checkpoint_id}).encode())
    if job.rank != 0:
        return
    while not all(_drained(m, f) for f in m.files):  # the other ranks' copies
        if _superseded(m):
            return
        time.sleep(POLL_S)
    for name in m.index_files:  # the format's marker is last among them
        with open(os.path.join(job.local, name), "rb") as f:
            atomic_write(os.path.join(m.checkpoint_dir, name), f.read())
    if _superseded(m):
        return
    atomic_write(os.path.join(m.checkpoint_dir, TIERS_FILE), m.with_state(DURABLE).to_json_bytes())
    for f in m.files:
        unlink_quietly(os.path.join(m.checkpoint_dir, _drained_marker(f)))
    logger.info("fastpersist: %s is durable: every data file copied to the persistent tier and checked, its index "
                "committed there", m.checkpoint_dir)


def _drained(m: TierManifest, data_file: str) -> bool:
    try:
        with open(os.path.join(m.checkpoint_dir, _drained_marker(data_file)), "rb") as f:
            return json.loads(f.read()).get("checkpoint_id") == m.checkpoint_id
    except (OSError, ValueError):
        return False


def _remove_stale(m: TierManifest) -> None:
    """The persistent directory's files of an earlier checkpoint there that this one does not rewrite."""
    keep = set(m.files) | set(m.index_files) | {TIERS_FILE}
    for name in os.listdir(m.checkpoint_dir):
        if name not in keep and (is_data_file(name) or name.startswith(DRAINED_PREFIX)):
            unlink_quietly(os.path.join(m.checkpoint_dir, name))


def read_manifest(directory: str) -> Optional[TierManifest]:
    """The tiers manifest of ``directory`` (a persistent directory or a local copy), None where there is none."""
    path = os.path.join(directory, TIERS_FILE)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise FastPersistError(f"cannot read {path}: {e}") from e
    return TierManifest.from_json_bytes(data, path)


def checkpoint_state(checkpoint_dir: str) -> Optional[str]:
    """``"local"`` or ``"durable"`` for a tiered checkpoint; ``"durable"`` for one saved straight to
    ``checkpoint_dir`` and committed; None where nothing is committed there (yet)."""
    manifest = read_manifest(checkpoint_dir)
    if manifest is not None:
        return manifest.state
    return DURABLE if os.path.exists(os.path.join(checkpoint_dir, INDEX_FILE)) else None


def wait_durable(checkpoint_dir: str, timeout: Optional[float] = None) -> bool:
    """Wait until ``checkpoint_dir`` is durable (at most ``timeout`` seconds); whether it is."""
    end = None if timeout is None else time.monotonic() + timeout
    while checkpoint_state(checkpoint_dir) != DURABLE:
        if end is not None and time.monotonic() > end:
            return False
        time.sleep(POLL_S)
    return True


def _retain(config: TierConfig, current: TierManifest) -> None:
    """Keep this node's ``keep_local`` newest local copies; drop older ones whose checkpoint is durable elsewhere,
    except the newest durable one's."""
    copies = []
    for name in os.listdir(config.local_dir):
        path = os.path.join(config.local_dir, name)
        try:
            manifest = read_manifest(path)
        except FastPersistError:
            continue  # a damaged copy is no copy to count: left for a person to look at
        if manifest is not None:
            copies.append((manifest.created, path, manifest))
    copies.sort(reverse=True)
    newest_durable = next((p for _, p, m in copies if _durable_copy_of(m)), None)
    for _, path, manifest in copies[config.keep_local:]:
        if manifest.checkpoint_id == current.checkpoint_id or path == newest_durable or (
                manifest.persistent and not _durable_copy_of(manifest)):
            continue  # a persistent checkpoint's only copy until it is durable
        shutil.rmtree(path, ignore_errors=True)
        logger.info("fastpersist: removed the local copy %s of %s (%s; %d newer copies kept)", path,
                    manifest.checkpoint_dir, "durable" if manifest.persistent else "a local checkpoint",
                    config.keep_local)


def _durable_copy_of(m: TierManifest) -> bool:
    """Whether the persistent tier holds ``m``'s checkpoint, committed (so a local copy of it is not the only one)."""
    try:
        current = read_manifest(m.checkpoint_dir)
    except FastPersistError:
        return False
    return current is not None and current.checkpoint_id == m.checkpoint_id and current.state == DURABLE



@dataclass(frozen=True)
class Copies:
    """Where a load finds a tiered checkpoint: the index, and each data file's copies, nearest first."""

    checkpoint_dir: str
    index_dir: str
    dirs: dict[str, tuple[str, ...]]  # data file -> directories holding an intact copy (as far as the manifests say)
    missing: dict[str, str]  # data file -> why no copy is reachable from here

    def of(self, data_file: str) -> tuple[str, ...]:
        return self.dirs.get(data_file, ())


def copies_for_load(checkpoint_dir: str, who: str, local_dir: Optional[str] = None) -> Optional[Copies]:
    """The copies a load of ``checkpoint_dir`` reads from, None for a checkpoint that is not tiered.

    This node's local copy (of ``local_dir``, default the one the checkpoint
    records) serves where it holds the same checkpoint (same id) with its
    index committed; the persistent directory serves a data file once that
    file was copied and checked there (durable, or its marker there). Raises
    ``FastPersistError`` where neither holds the index, naming the newest
    checkpoint beside it that loads.
    """
    manifest = read_manifest(checkpoint_dir)
    if manifest is None:
        return None
    local = local_copy_dir(local_dir or manifest.local_dir, checkpoint_dir)
    try:
        mine = read_manifest(local)
    except FastPersistError as e:
        logger.warning("fastpersist: %s: this node's copy %s is unusable (%s); reading the persistent tier", who,
                       local, e)
        mine = None
    local_ok = (mine is not None and mine.checkpoint_id == manifest.checkpoint_id
                and os.path.exists(os.path.join(local, INDEX_FILE)))
    durable = manifest.state == DURABLE
    if not local_ok and not durable:
        state = "missing" if mine is None else "of another save"
        raise FastPersistError(
            f"{who}: checkpoint {checkpoint_dir} is in the local tiers only (not durable yet) and this node's copy "
            f"{local} is {state}: it cannot be loaded here{_newest_loadable(checkpoint_dir)}")
    dirs, missing = {}, {}
    for data_file, rank in manifest.files.items():
        found = tuple(d for d, ok in ((local, local_ok and os.path.exists(os.path.join(local, data_file))),
                                      (checkpoint_dir, durable or _drained(manifest, data_file))) if ok)
        if found:
            dirs[data_file] = found
        else:
            missing[data_file] = (f"{data_file} (rank {rank}) is in the local tier of node {manifest.node_of(rank)} "
                                  f"only, checkpoint {checkpoint_dir} is not durable yet: load it where that copy is, "
                                  "or wait until it is durable (fastpersist_dist.wait_durable)")
    return Copies(checkpoint_dir, local if local_ok else checkpoint_dir, dirs, missing)


def _newest_loadable(checkpoint_dir: str) -> str:
    """'; the newest ... beside it is DIR' for the newest durable checkpoint in ``checkpoint_dir``'s parent."""
    parent = os.path.dirname(os.path.abspath(checkpoint_dir))
    found = []
    for name in os.listdir(parent):
        path = os.path.join(parent, name)
        try:
            if path != os.path.abspath(checkpoint_dir) and checkpoint_state(path) == DURABLE:
                found.append((os.stat(os.path.join(path, INDEX_FILE)).st_mtime, path))
        except (OSError, FastPersistError):
            continue
    return f"; the newest durable checkpoint beside it is {max(found)[1]}" if found else \
        f"; no durable checkpoint lies beside it in {parent}"
