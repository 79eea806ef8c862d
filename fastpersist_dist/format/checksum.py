"""Block checksums: XXH3-64 over fixed-size blocks of each shard's bytes.

Blocks (default 4 MiB) let a resharding load that reads part of a shard verify
exactly the blocks it reads. XXH3 hashes several times faster per core than a
storage device writes, so computing it while bytes stream costs little.
"""

from __future__ import annotations

from typing import Sequence, Union

import numpy as np
import xxhash

ALGORITHM = "xxh3_64"

Buffer = Union[bytes, bytearray, memoryview, np.ndarray]


def digest_bytes(data: Buffer) -> str:
    """16-digit lowercase hex XXH3-64 (seed 0) of ``data``."""
    return f"{xxhash.xxh3_64_intdigest(data):016x}"


class BlockHasher:
    """Block checksums of a byte stream fed in pieces of any size (a record's framing, then its elements).

    The digests are those of consecutive ``block_bytes`` blocks of the
    concatenation (the last may be short), what :func:`first_bad_block` checks;
    whole blocks inside one piece are hashed in one call, only blocks that span
    pieces incrementally.
    """

    def __init__(self, block_bytes: int):
        self.block = block_bytes
        self.digests: list[str] = []
        self._partial = xxhash.xxh3_64()
        self._filled = 0

    def update(self, data: Buffer) -> None:
        """Feed the next bytes of the stream."""
        mv = memoryview(data).cast("B")
        pos = 0
        while pos < len(mv):
            take = min(self.block - self._filled, len(mv) - pos)
            if self._filled == 0 and take == self.block:
                self.digests.append(digest_bytes(mv[pos : pos + take]))
            else:
                self._partial.update(mv[pos : pos + take])
                self._filled += take
                if self._filled == self.block:
                    self._flush()
            pos += take

    def finish(self) -> list[str]:
        """Digests of every block, the last one short if the stream ended mid-block."""
        if self._filled:
            self._flush()
        return self.digests

    def _flush(self) -> None:
        self.digests.append(f"{self._partial.intdigest():016x}")
        self._partial.reset()
        self._filled = 0


def first_bad_block(pieces: Sequence[Buffer], expected: Sequence[str], block_bytes: int) -> int:
    """Index (within ``expected``) of the first block whose checksum differs, or -1.

    ``pieces``: the blocks' bytes back to back, in pieces of any size (a
    record's framing and its elements, read into different buffers); they
    start on a block boundary and hold ``len(expected)`` blocks.
    """
    hasher = BlockHasher(block_bytes)
    for piece in pieces:
        hasher.update(piece)
    got = hasher.finish()
    for i, want in enumerate(expected):
        if i >= len(got) or got[i] != want:
            return i
    return -1
