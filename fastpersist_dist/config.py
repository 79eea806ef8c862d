"""Tuning knobs of the save and load paths, with their defaults in one place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

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
    """

    direct_io: DirectIO = "auto"
    io_buffer_mb: int = 64
    double_buffer: bool = True
    aio_block_mb: int = 8
    aio_queue_depth: int = 8
    aio_intra_op_parallelism: int = 1
    checksum_block_mb: int = DEFAULT_BLOCK_BYTES // MiB

    def __post_init__(self) -> None:
        if self.direct_io not in ("auto", "on", "off"):
            raise ValueError(f"direct_io must be 'auto', 'on' or 'off', got {self.direct_io!r}")
        for name in ("io_buffer_mb", "aio_block_mb", "aio_queue_depth", "aio_intra_op_parallelism", "checksum_block_mb"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")

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
