"""Tuning knobs of the save and load paths, with their defaults in one place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from .checksum import DEFAULT_BLOCK_BYTES
from .storage.deepspeed_ops import AioSettings

MiB = 1 << 20
DirectIO = Literal["auto", "on", "off"]


@dataclass(frozen=True)
class WriteConfig:
    """How a rank streams its shards to its data file.

    direct_io: "auto" uses DeepNVMe (O_DIRECT + libaio) and falls back, with one
        warning, to a buffered writer of the same format where the filesystem
        refuses O_DIRECT or the aio op is unavailable; "on" raises instead;
        "off" always writes buffered (+ fsync).
    io_buffer_mb: page-locked bounce buffer per writer (split in two when
        ``double_buffer``: one half fills while the other drains).
    aio_block_mb / aio_queue_depth / aio_intra_op_parallelism: aio handle settings.
    checksum_block_mb: granularity of the per-shard XXH3 checksums.
    balance: spread the bytes of replicated shards over every rank holding a
        replica (data-parallel writes, see plan.py); off: each shard is written
        by its main replica alone.
    readback_stride: after fsync, re-read from the device and compare the first
        and last checksum block of each file (0), also every N-th block (N > 0;
        1: all), or nothing (None). DeepSpeed reports no failed aio write.
    require_shared_dir: refuse a save, before anything is written, where a rank
        evidently does not see rank 0's checkpoint directory (node-local storage,
        another mount namespace; see shared_dir.py); False: write such node-local
        parts anyway (to be gathered into one directory by the caller).
    """

    direct_io: DirectIO = "auto"
    io_buffer_mb: int = 256
    double_buffer: bool = True
    aio_block_mb: int = 32
    aio_queue_depth: int = 8
    aio_intra_op_parallelism: int = 1
    checksum_block_mb: int = DEFAULT_BLOCK_BYTES // MiB
    balance: bool = True
    readback_stride: Optional[int] = 0
    require_shared_dir: bool = True

    def __post_init__(self) -> None:
        if self.direct_io not in ("auto", "on", "off"):
            raise ValueError(f"direct_io must be 'auto', 'on' or 'off', got {self.direct_io!r}")
        for name in ("io_buffer_mb", "aio_block_mb", "aio_queue_depth", "aio_intra_op_parallelism", "checksum_block_mb"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.readback_stride is not None and self.readback_stride < 0:
            raise ValueError(f"readback_stride must be None or >= 0, got {self.readback_stride!r}")

    @property
    def checksum_block_bytes(self) -> int:
        """Checksum block size in bytes."""
        return self.checksum_block_mb * MiB

    @property
    def aio(self) -> AioSettings:
        """Settings of the aio handle and bounce buffer."""
        return AioSettings(
            block_size=self.aio_block_mb * MiB,
            queue_depth=self.aio_queue_depth,
            intra_op_parallelism=self.aio_intra_op_parallelism,
            buffer_bytes=self.io_buffer_mb * MiB,
        )
