"""A tiered save: each node's local tier first, then replicas and the persistent tier in the background
(docs/design.md, "The local commit"; "The drain").

A save never waits for the persistent tier nor fails on it: rank 0's steps there that cannot be made during the
save are kept for its drain. The drain's backlog is bounded: a checkpoint committed while ``DRAIN_BACKLOG``
older ones still drain stays local.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Optional

import torch.distributed as dist

from ...format.checksum import digest_bytes
from ...format.kinds import CheckpointFormat
from ...format.records import INDEX_FILE, status_file_name
from ...format.tiers import LOCAL, TIERED_MARKERS, TIERS_FILE, TierManifest, local_copy_dir
from ...plan.replicas import replica_nodes
from ...storage.files import atomic_write, fsync_path
from ...storage.persistent import PersistentDir, persistent_dir, write_at_once
from ...storage.mounts import SHMEM_ENABLED, small_pages_in_memory
from ...util.config import TierConfig
from ...util.errors import FastPersistError, SaveFailedError
from ...util.events import COMMITTED_LOCALLY, NOT_DRAINED, UNREACHABLE, event
from ..agreement import Agreement, failure
from ..directory import invalidate
from .background import begin_save, commit_beside, drainer, replicator, retainer, start_threads
from .drain import Drain
from .local_commit import LocalCommit, commit_group
from .replicate import Replication
from .retention import Retention
from .state import pending_dir
from .topology import Topology, check_node_local, describe_node, drain_store, replication_group, topology

logger = logging.getLogger(__name__)

# Checkpoints whose copies to the persistent tier may be under way when a save is committed locally; a save that
# finds this many on rank 0 stays local (docs/design.md, "The drain": the model behind two).
DRAIN_BACKLOG = 2


@dataclass(frozen=True)
class TieredSave:
    """One tiered save: where this rank writes, and who prepares which copy."""

    config: TierConfig
    checkpoint_dir: str  # the persistent tier's directory (or msc:// URL)
    local: str  # this node's copy of the checkpoint
    topology: Topology
    replicas: tuple[tuple[int, ...], ...]  # node -> the nodes that keep copies of its files
    group: Optional[dist.ProcessGroup]  # the replication group, where there are replicas
    rank: int
    # megatron's own files (metadata.json), which its save() writes only at finalize: rank 0 writes them with the
    # local commit, so that a checkpoint its manifest calls local is one megatron's load() takes.
    megatron_files: dict[str, bytes]
    # Rank 0: the steps on the persistent tier not made during the save, in order, for its drain to make.
    unpublished: list[Callable[[], None]] = field(default_factory=list)

    @classmethod
    def start(cls, config: TierConfig, checkpoint_dir: str, megatron_files: dict[str, bytes]) -> "TieredSave":
        """Collective: this save's copies; this node's copy directory made. Raises ``ValueError`` on every rank
        alike where there are fewer other nodes than ``replicas``, or two nodes see one ``local_dir``."""
        start_threads(config.replicas > 0)
        topo = topology()
        local = local_copy_dir(config.local_dir, checkpoint_dir)
        try:
            os.makedirs(local, exist_ok=True)
        except OSError as e:  # the directory checks before the write say so on every rank alike
            logger.debug("fastpersist: rank %d cannot create %s: %s", dist.get_rank(), local, e)
        check_node_local(config.local_dir, topo)
        replicas = replica_nodes(topo.domains, config.replicas) if config.replicas else ()
        group = replication_group() if config.replicas else None
        save = cls(config, checkpoint_dir, local, topo, replicas, group, dist.get_rank(), megatron_files)
        if save.node_leader:
            _advise_huge_pages(config.local_dir)
        return save

    @property
    def node(self) -> int:
        return self.topology.node_of(self.rank)

    @property
    def node_leader(self) -> bool:
        """Whether this rank prepares and commits its node's copy (the node's first rank)."""
        return self.topology.nodes[self.node][0] == self.rank

    def begin(self) -> None:
        """Before this save's first collective: ``background.begin_save``."""
        begin_save(self.checkpoint_dir, self.local, f"rank {self.rank} ({describe_node()})")

    def invalidate(self, rewritten: frozenset[str]) -> None:
        """Before anything is written: each node's copy (its leader), and the persistent directory's commit
        markers (rank 0): an overwritten checkpoint is recognisably incomplete in every tier from here on."""
        if self.node_leader:
            invalidate(self.local, rewritten)
        if self.rank == 0:
            self._on_persistent_tier(partial(_remove_markers, persistent_dir(self.checkpoint_dir)))

    def _on_persistent_tier(self, step: Callable[[], None]) -> None:
        """Rank 0: ``step`` made on the persistent tier now, or, where the tier cannot be reached or an earlier
        step waits, kept for the drain to make once the tier answers."""
        if not self.unpublished:
            try:
                step()
                return
            except (OSError, FastPersistError) as e:
                logger.warning("fastpersist: rank 0: the persistent tier of %s cannot be reached (%s); the save goes "
                               "on to the local tiers, and its drain writes there once it answers (for retry_s=%.0f s)",
                               self.checkpoint_dir, e, self.config.retry_s,
                               extra=event(UNREACHABLE, checkpoint=self.checkpoint_dir))
        self.unpublished.append(step)

    def drain_beside(self, data_file: str) -> "Future[TierManifest]":
        """Before the write: this rank's drain queued (also with ``persistent=False``: rank 0's makes the steps
        kept for it); the future that :meth:`commit` resolves."""
        committed: Future[TierManifest] = Future()
        drainer().submit(Drain(committed, self.checkpoint_dir, self.local, self.rank, describe_node(), data_file,
                               self.config.retry_s, drain_store(), dist.get_world_size(), self.unpublished))
        return committed

    def commit(self, finalize: Callable[..., Optional[list[tuple[str, bytes]]]], fmt: CheckpointFormat,
               aux_files: dict[str, bytes], committed: "Future[TierManifest]",
               beside: Optional[dist.ProcessGroup] = None) -> TierManifest:
        """Collective: the local commit, then the background work handed this checkpoint. ``finalize``: the
        commit of the writes (``engine/commit.py``'s ``finalize_save``); ``committed`` (:meth:`drain_beside`'s)
        gets the manifest or the error; ``beside``: the group of a commit made beside training, None: the
        trainer's."""
        try:
            manifest = self._commit(partial(finalize, beside=beside), fmt, aux_files, beside)
        except BaseException as e:
            committed.set_exception(e)
            raise
        committed.set_result(manifest)
        return manifest

    def commit_when_written(self, finalize: Callable[..., Optional[list[tuple[str, bytes]]]], fmt: CheckpointFormat,
                            aux_files: dict[str, bytes], committed: "Future[TierManifest]") -> Callable[[], None]:
        """Collective (on a process's first async tiered save: the commit group): an async save's :meth:`commit`,
        queued to run beside training once every rank's writer is done (``local_commit.py``); the save's finalize
        step, which waits for it and raises its error."""
        group = commit_group()
        status = os.path.join(self.local, status_file_name(self.rank))
        return commit_beside(LocalCommit(self.rank, self.checkpoint_dir, status, group,
                                         partial(self.commit, finalize, fmt, aux_files, committed, group), committed))

    def _commit(self, finalize: Callable[[], Optional[list[tuple[str, bytes]]]], fmt: CheckpointFormat,
                aux_files: dict[str, bytes], beside: Optional[dist.ProcessGroup]) -> TierManifest:
        try:
            files = finalize()  # raises SaveFailedError on every rank where any rank failed
        except SaveFailedError as e:  # its ranks' errors name their paths: say which node each rank is on
            raise SaveFailedError(f"{e} [local tier {self.config.local_dir} on each node; "
                                  f"{self.topology.describe()}]") from e
        assert files is not None
        behind = drainer().pending if self.rank == 0 and self.config.persistent else 0
        holder: list[Any] = [(uuid.uuid4().hex, behind) if self.rank == 0 else None]
        dist.broadcast_object_list(holder, src=0, group=beside)
        checkpoint_id, behind = holder[0]
        drained = self.config.persistent and behind < DRAIN_BACKLOG
        manifest = TierManifest(
            checkpoint_id=checkpoint_id, checkpoint_dir=self.checkpoint_dir, local_dir=self.config.local_dir,
            nodes=self.topology.nodes, files={fmt.data_file(r): r for r in range(dist.get_world_size())},
            index_files=tuple(name for name, _ in files), index_xxh3_64=digest_bytes(dict(files)[INDEX_FILE]),
            state=LOCAL, created=time.time(), persistent=drained, replica_nodes=self.replicas)
        if self.rank == 0 and self.config.persistent and not drained:
            logger.warning("fastpersist: the persistent tier is behind: the copies of the %d checkpoints saved before "
                           "are still under way, so %s stays in the local tiers, not drained (a local checkpoint, "
                           "as with persistent=False); the next save once fewer than %d wait is drained", behind,
                           self.checkpoint_dir, DRAIN_BACKLOG, extra=event(NOT_DRAINED, checkpoint=self.checkpoint_dir))
        error = None
        try:
            if self.node_leader:
                for name, data in files:
                    atomic_write(os.path.join(self.local, name), data)
                atomic_write(os.path.join(self.local, TIERS_FILE), manifest.to_json_bytes())
            if self.rank == 0:
                self._on_persistent_tier(partial(_publish, persistent_dir(self.checkpoint_dir), files,
                                                 {**aux_files, **self.megatron_files}, manifest.to_json_bytes()))
        except (OSError, FastPersistError) as e:
            error = f"rank {self.rank} ({describe_node()}): {type(e).__name__}: {e}"
        what = f"cannot commit checkpoint {self.checkpoint_dir} to the local tiers"
        Agreement(SaveFailedError, f"{what}; it is not committed",
                  f"{what}; rank {self.rank}: a rank died or timed out").agree(failure(error), beside)
        if self.rank == 0:
            logger.info("fastpersist: %s committed to the local tiers of %d nodes (%s)%s", self.checkpoint_dir,
                        len(self.topology.nodes), self.local, self._next_steps(drained),
                        extra=event(COMMITTED_LOCALLY, checkpoint=self.checkpoint_dir))
        if self.group is not None:
            replicator().submit(Replication(manifest, self.local, self.rank, describe_node(), self.group))
        if self.node_leader:
            retainer().submit(Retention(self.config, manifest))
        return manifest

    def _next_steps(self, drained: bool) -> str:
        steps = [f"replicating it to {self.config.replicas} other nodes"] if self.group is not None else []
        steps += ["copying it to the persistent tier"] if drained else []
        return f"; {' and '.join(steps)} in the background" if steps else " (a local checkpoint only)"


def _remove_markers(home: PersistentDir) -> None:
    """The commit markers of a checkpoint saved into ``home`` before, removed (one listing: a request to an object
    store; a new directory has none)."""
    present = set(home.names()).intersection(TIERED_MARKERS)
    for name in sorted(present):
        home.remove(name)
    if present and home.local_path is not None:
        fsync_path(home.local_path)


def _publish(home: PersistentDir, index_files: list[tuple[str, bytes]], small_files: dict[str, bytes],
             manifest: bytes) -> None:
    """A local commit's files on the persistent tier: the index, not committed (``PENDING_DIR``: a node whose local
    tier is empty finds it there), the small files megatron reads before asking any strategy (``common.pt``,
    ``metadata.json``), then the manifest."""
    write_at_once([(pending_dir(home), name, data) for name, data in index_files]
                  + [(home, name, data) for name, data in small_files.items()])
    home.write(TIERS_FILE, manifest)


_advised: set[str] = set()  # the local tiers this process has said it of


def _advise_huge_pages(local_dir: str) -> None:
    """Say once, on a node's first rank, where its local tier in memory allocates its pages one base page at a
    time."""
    if local_dir in _advised:
        return
    _advised.add(local_dir)
    found = small_pages_in_memory(local_dir)
    if found is not None:
        mount, mode = found
        logger.info("fastpersist: %s: the local tier %s is on a tmpfs (mounted at %s) without huge pages (%s): "
                    "every %d KiB written there is a page allocated, and freed again with its copy, on the cores "
                    "training uses; mounted with huge=within_size, a tmpfs does that a huge page at a time (2 MiB on "
                    "x86; docs/tiers.md, huge pages for a local tier in memory)", describe_node(), local_dir,
                    mount.point, f"{SHMEM_ENABLED}: deny" if mode == "deny" else f"huge={mode}",
                    os.sysconf("SC_PAGE_SIZE") // 1024)
