"""A tiered save: each node's local tier first, then replicas and the persistent tier in the background.

A save with a ``TierConfig`` writes each rank's data file into its node's copy
of the checkpoint (``format.tiers.local_copy_dir``) through the usual engine.
The local commit (:meth:`TieredSave.commit`: a synchronous save's right after
its write; an async save's beside training as soon as every rank's writer is
done, ``local_commit.py``, which its finalize waits for) writes the index into
every node's copy and then its tiers manifest; rank 0 writes the index,
not committed, into the persistent directory's ``PENDING_DIR`` (a node whose
local tier is empty finds it there), the small files megatron reads before
any strategy (``common.pt``), and the manifest in state ``local``: the
checkpoint is loadable from the local tiers from then on. Then each rank
hands its part to the background threads (``background.py``): the replicas
(``replicate.py``, with ``replicas`` > 0) and the drain to the persistent tier
(``drain.py``, unless ``persistent=False``: queued before the write, where it
may already copy the data file, it waits for this commit to put the copy in
place); and each node's first rank queues the retention (``retention.py``).
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Optional

import torch.distributed as dist

from ...format.checksum import digest_bytes
from ...format.kinds import CheckpointFormat
from ...format.records import INDEX_FILE, ShardRecord, status_file_name
from ...format.tiers import LOCAL, TIERED_MARKERS, TIERS_FILE, TierManifest, local_copy_dir
from ...plan.replicas import replica_nodes
from ...storage.files import atomic_write, fsync_path, unlink_quietly
from ...storage.persistent import persistent_dir, write_at_once
from ...storage.mounts import SHMEM_ENABLED, small_pages_in_memory
from ...util.config import TierConfig, WriteConfig
from ...util.errors import FastPersistError, SaveFailedError
from ...util.events import COMMITTED_LOCALLY, event
from ..agreement import Agreement, failure
from ..directory import invalidate
from .background import begin_save, commit_beside, drainer, replicator, retainer, start_threads
from .drain import Drain, Planned
from .local_commit import LocalCommit, commit_group
from .replicate import Replication
from .retention import Retention
from .state import pending_dir
from .topology import Topology, check_node_local, describe_node, replication_group, topology

logger = logging.getLogger(__name__)


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
    # megatron's own files of the checkpoint (metadata.json: compat.megatron_config), which its save() writes
    # after the strategy's, at finalize for an async save: rank 0 writes them to the persistent directory with
    # the local commit, so that a checkpoint its manifest calls local (or durable) is one megatron's load() takes.
    megatron_files: dict[str, bytes]

    @classmethod
    def start(cls, config: TierConfig, checkpoint_dir: str, megatron_files: dict[str, bytes]) -> "TieredSave":
        """Collective: this save's copies; this node's copy directory made (every rank, before any check).

        Raises ``ValueError`` on every rank alike where there are fewer other
        nodes than ``replicas``, or where two nodes see one ``local_dir``.
        """
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
        """Before this save's first collective: this rank's copies of the checkpoint saved here before ended, and
        the save recorded as begun (``background.begin_save``)."""
        begin_save(self.checkpoint_dir, self.local, f"rank {self.rank} ({describe_node()})")

    def invalidate(self, rewritten: frozenset[str]) -> None:
        """Before anything is written: each node's copy (its leader), and the persistent directory's commit
        markers (rank 0): an overwritten checkpoint is recognisably incomplete in every tier from here on."""
        if self.node_leader:
            invalidate(self.local, rewritten)
        if self.rank == 0:  # one listing (a request to an object store): a new directory has none of them
            home = persistent_dir(self.checkpoint_dir)
            present = set(home.names()).intersection(TIERED_MARKERS)
            for name in sorted(present):
                home.remove(name)
            if present and home.local_path is not None:
                fsync_path(home.local_path)

    def drain_beside(self, data_file: str, records: list[ShardRecord], config: WriteConfig, beside_writer: bool
                     ) -> Optional["Future[TierManifest]"]:
        """Once every rank agreed to write, before the write: this rank's drain queued (``drain.py``); the future
        that :meth:`commit` resolves. None for a save the persistent tier never gets (``persistent=False``).

        Where the write runs in the rank's writer process (``beside_writer``:
        an async save; a synchronous save's caller waits for its write and
        commits right after), the drain copies the data file (planned as
        ``records``) to a persistent directory once it is written, without
        waiting for the local commit; else after the commit.
        """
        if not self.config.persistent:
            return None
        # The writer's own first step, taken before the drain looks: it follows only the file of this save.
        unlink_quietly(os.path.join(self.local, data_file))
        committed: Future[TierManifest] = Future()
        planned = Planned(tuple(records), config.checksum_block_bytes) if records and beside_writer else None
        drainer().submit(Drain(committed, self.checkpoint_dir, self.local, self.rank, describe_node(), data_file,
                               self.config.retry_s, planned))
        return committed

    def commit(self, finalize: Callable[..., Optional[list[tuple[str, bytes]]]], fmt: CheckpointFormat,
               aux_files: dict[str, bytes], committed: Optional["Future[TierManifest]"],
               beside: Optional[dist.ProcessGroup] = None) -> TierManifest:
        """Collective: the local commit (see the module), then the background work handed this checkpoint.

        ``finalize``: the commit of the writes (``engine/commit.py``'s
        ``finalize_save``, its ``beside`` given). ``committed``
        (:meth:`drain_beside`'s) gets the manifest, or the error where the
        commit failed: the drain then discards what it copied. ``beside``: the
        group every collective runs over where the commit is made beside
        training (:meth:`commit_when_written`); None: the trainer's.
        """
        try:
            manifest = self._commit(partial(finalize, beside=beside), fmt, aux_files, beside)
        except BaseException as e:
            if committed is not None:
                committed.set_exception(e)
            raise
        if committed is not None:
            committed.set_result(manifest)
        return manifest

    def commit_when_written(self, finalize: Callable[..., Optional[list[tuple[str, bytes]]]], fmt: CheckpointFormat,
                            aux_files: dict[str, bytes], committed: Optional["Future[TierManifest]"]
                            ) -> Callable[[], None]:
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
        holder: list[Any] = [uuid.uuid4().hex if self.rank == 0 else None]
        dist.broadcast_object_list(holder, src=0, group=beside)
        manifest = TierManifest(
            checkpoint_id=holder[0], checkpoint_dir=self.checkpoint_dir, local_dir=self.config.local_dir,
            nodes=self.topology.nodes, files={fmt.data_file(r): r for r in range(dist.get_world_size())},
            index_files=tuple(name for name, _ in files), index_xxh3_64=digest_bytes(dict(files)[INDEX_FILE]),
            state=LOCAL, created=time.time(), persistent=self.config.persistent, replica_nodes=self.replicas)
        error = None
        try:
            if self.node_leader:
                for name, data in files:
                    atomic_write(os.path.join(self.local, name), data)
                atomic_write(os.path.join(self.local, TIERS_FILE), manifest.to_json_bytes())
            if self.rank == 0:  # megatron reads common.pt before asking any strategy; the manifest last
                home = persistent_dir(self.checkpoint_dir)
                pending = pending_dir(home)
                write_at_once([(pending, name, data) for name, data in files]
                              + [(home, name, data) for name, data in {**aux_files, **self.megatron_files}.items()])
                home.write(TIERS_FILE, manifest.to_json_bytes())
        except (OSError, FastPersistError) as e:
            error = f"rank {self.rank} ({describe_node()}): {type(e).__name__}: {e}"
        what = f"cannot commit checkpoint {self.checkpoint_dir} to the local tiers"
        Agreement(SaveFailedError, f"{what}; it is not committed",
                  f"{what}; rank {self.rank}: a rank died or timed out").agree(failure(error), beside)
        if self.rank == 0:
            logger.info("fastpersist: %s committed to the local tiers of %d nodes (%s)%s", self.checkpoint_dir,
                        len(self.topology.nodes), self.local, self._next_steps(),
                        extra=event(COMMITTED_LOCALLY, checkpoint=self.checkpoint_dir))
        if self.group is not None:
            replicator().submit(Replication(manifest, self.local, self.rank, describe_node(), self.group))
        if self.node_leader:
            retainer().submit(Retention(self.config, manifest))
        return manifest

    def _next_steps(self) -> str:
        steps = [f"replicating it to {self.config.replicas} other nodes"] if self.group is not None else []
        steps += ["copying it to the persistent tier"] if self.config.persistent else []
        return f"; {' and '.join(steps)} in the background" if steps else " (a local checkpoint only)"


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
