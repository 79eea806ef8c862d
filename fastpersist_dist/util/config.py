"""Tuning knobs of the save and load paths, with their defaults in one place. Pure: imports nothing heavy.

``WriteConfig`` and ``ReadConfig`` share their aio knobs (``AioKnobs``): with
the defaults, a process's loads and synchronous saves use one aio handle and
one page-locked buffer (``storage/deepspeed_ops.aio_resources`` keys them by
these settings).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Literal, Optional

MiB = 1 << 20
DirectIO = Literal["auto", "on", "off"]
AUTO_ON_OFF = ("auto", "on", "off")


def _check_choice(name: str, value: str) -> None:
    if value not in AUTO_ON_OFF:
        raise ValueError(f"{name} must be 'auto', 'on' or 'off', got {value!r}")


def _check_positive(config: object, *names: str) -> None:
    for name in names:
        if int(getattr(config, name)) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(config, name)!r}")


@dataclass(frozen=True)
class AioSettings:
    """Parameters of one aio handle and its bounce buffer."""

    block_size: int
    queue_depth: int
    intra_op_parallelism: int
    buffer_bytes: int


@dataclass(frozen=True)
class AioKnobs:
    """The aio handle and page-locked buffer a rank writes or reads through.

    io_buffer_mb: page-locked bounce buffer (a write splits it in two when
        ``double_buffer``: one half fills while the other drains; a load reads
        into its two halves in turn).
    aio_block_mb / aio_queue_depth / aio_intra_op_parallelism: aio handle settings.
    """

    io_buffer_mb: int = 256
    aio_block_mb: int = 32
    aio_queue_depth: int = 8
    aio_intra_op_parallelism: int = 1

    def __post_init__(self) -> None:
        _check_positive(self, "io_buffer_mb", "aio_block_mb", "aio_queue_depth", "aio_intra_op_parallelism")

    @property
    def aio(self) -> AioSettings:
        """Settings of the aio handle and bounce buffer."""
        return AioSettings(
            block_size=self.aio_block_mb * MiB,
            queue_depth=self.aio_queue_depth,
            intra_op_parallelism=self.aio_intra_op_parallelism,
            buffer_bytes=self.io_buffer_mb * MiB,
        )


@dataclass(frozen=True)
class WriteConfig(AioKnobs):
    """How a rank streams its shards to its data file.

    direct_io: "auto" uses DeepNVMe (O_DIRECT + libaio) and falls back, with one
        warning, to a buffered writer of the same format where the filesystem
        refuses O_DIRECT or the aio op is unavailable; "on" raises instead;
        "off" always writes buffered (+ fsync).
    io_buffer_mb, aio_block_mb, aio_queue_depth, aio_intra_op_parallelism:
        the writer's aio handle and bounce buffer (``AioKnobs``).
    double_buffer: split the bounce buffer in two halves, one filling while the other drains.
    checksum_block_mb: granularity of the per-shard XXH3 checksums.
    balance: spread the bytes of replicated shards over every rank holding a
        replica (data-parallel writes, see plan/writes.py); off: each shard is written
        by its main replica alone.
    readback_stride: after fsync, re-read from the device and compare the first
        and last checksum block of each file (0), also every N-th block (N > 0;
        1: all), or nothing (None). DeepSpeed reports no failed aio write.
    require_shared_dir: refuse a save, before anything is written, where a rank
        evidently does not see rank 0's checkpoint directory (node-local storage,
        another mount namespace; see storage/shared_dir.py); False: write such node-local
        parts anyway (to be gathered into one directory by the caller).
    separation_hint: a key prefix (megatron's, e.g. "optimizer"): a rank writes the
        keys beginning with it after all its other keys, so that
        ``dist_checkpointing.remove_sharded_tensors(dir, prefix)`` frees their bytes as
        one range per data file (any removal frees them where the filesystem punches holes).
    """

    direct_io: DirectIO = "auto"
    double_buffer: bool = True
    checksum_block_mb: int = 4
    balance: bool = True
    readback_stride: Optional[int] = 0
    require_shared_dir: bool = True
    separation_hint: Optional[str] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_choice("direct_io", self.direct_io)
        _check_positive(self, "checksum_block_mb")
        if self.readback_stride is not None and self.readback_stride < 0:
            raise ValueError(f"readback_stride must be None or >= 0, got {self.readback_stride!r}")

    @property
    def checksum_block_bytes(self) -> int:
        """Checksum block size in bytes."""
        return self.checksum_block_mb * MiB


@dataclass(frozen=True)
class ReadConfig(AioKnobs):
    """How a rank reads its shards back.

    verify_checksums: check the XXH3 checksum of every block read (default on).
    trust_objects: unpickle ShardedObjects without torch's ``weights_only``
        restriction. Only for checkpoints from a trusted source.
    read_threads: preads in flight per rank where the load does not stream
        (I/O of one overlaps the checksum and copy of another).
    direct_io: "auto" reads verified loads with large O_DIRECT aio reads
        through the aio handle and locked buffer of ``AioKnobs`` (with the
        defaults, the one this process's synchronous saves use), except on
        in-memory filesystems (tmpfs), and falls back to pread where aio or
        O_DIRECT is unavailable; "on" raises there instead; "off" always uses pread.
    share_reads: "auto" (default) and "on": bytes that several ranks need
        (resharded loads, replicated tensors) are read by one of them and sent
        to the others over the load's process group, which makes the load
        collective over that group, as megatron's own loaders are; "auto" reads
        unshared where the checkpoint is on an in-memory filesystem (tmpfs: a
        read is a memory copy, cheaper than a transfer); "off": every rank reads
        all it needs itself, independently of the others (bytes of a tiered
        checkpoint that only other nodes hold included: docs/tiers.md).
    io_buffer_mb, aio_block_mb, aio_queue_depth, aio_intra_op_parallelism:
        the reads' aio handle and locked buffer (``AioKnobs``).
    local_dir: the local tier this node's copies of tiered checkpoints are read
        from (docs/tiers.md); default: the one each checkpoint records.
    """

    verify_checksums: bool = True
    trust_objects: bool = False
    read_threads: int = 2
    direct_io: DirectIO = "auto"
    share_reads: DirectIO = "auto"
    local_dir: Optional[str] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive(self, "read_threads")
        _check_choice("direct_io", self.direct_io)
        _check_choice("share_reads", self.share_reads)


@dataclass(frozen=True)
class TierConfig:
    """Where a tiered save keeps its copies (docs/tiers.md).

    local_dir: the local tier: a directory of the same path on every node, each
        node's own storage (an NVMe mount, or /dev/shm). Each rank writes its
        share there; the index is committed into every node's copy; the
        checkpoint is then copied to the persistent tier (the directory or
        ``msc://`` URL given to ``save()``) in the background, its index
        committed there last.
    replicas: how many other nodes also keep each node's files in their local
        tiers (copied over torch.distributed in the background, checked on
        arrival; nodes of other failure domains first, ``FASTPERSIST_FAILURE_DOMAIN``).
        With 1 or more, any one lost node is recoverable from the local tiers.
    keep_local: how many checkpoints each node keeps in its local tier; older
        local copies go once their checkpoint is durable (the newest durable
        one's stays), never while a copy there is the only one or a load reads it.
    persistent: copy each checkpoint to the persistent tier (default); False:
        local checkpoints only (Megatron-LM's non-persistent ones), never
        copied, kept as ``keep_local`` says even though not durable.
    retry_s: how long a copy to the persistent tier that fails (the store
        unreachable, the filesystem full) is tried again before the checkpoint
        is left in the local tiers, reported; also how long (at least 10 s) a
        drain waits for a rank that shows no sign of life (its process died).
    local_only_under: checkpoints saved under this directory (or URL) are
        local only, as with ``persistent=False``; the others are copied to the
        persistent tier. Megatron-LM's non-persistent checkpoints go there
        (``fastpersist_dist.megatron_lm``).
    """

    local_dir: str
    replicas: int = 0
    keep_local: int = 2
    persistent: bool = True
    retry_s: float = 900.0
    local_only_under: Optional[str] = None

    def for_checkpoint(self, checkpoint_dir: str) -> "TierConfig":
        """The settings of one save into ``checkpoint_dir``: local only under ``local_only_under``."""
        if self.local_only_under is None or not _is_under(checkpoint_dir, self.local_only_under):
            return self
        return replace(self, persistent=False)

    def __post_init__(self) -> None:
        if not self.local_dir or not os.path.isabs(self.local_dir):
            raise ValueError(f"local_dir must be an absolute path, the same on every node, got {self.local_dir!r}")
        _check_positive(self, "keep_local")
        if self.replicas < 0 or self.retry_s < 0:
            raise ValueError(f"replicas and retry_s must be >= 0, got {self.replicas} and {self.retry_s}")


def _is_under(path: str, root: str) -> bool:
    """Whether ``path`` is ``root`` or inside it (paths made absolute; URLs compared as written)."""
    if "://" not in path and "://" not in root:
        path, root = os.path.abspath(path), os.path.abspath(root)
    path, root = path.rstrip("/"), root.rstrip("/")
    return path == root or path.startswith(root + "/")
