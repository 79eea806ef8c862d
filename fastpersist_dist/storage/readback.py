"""The read-back check of a written data file: sampled checksum blocks re-read from the device.

DeepSpeed's aio path reports no failed write, and the size check after fsync
cannot see a hole or misplaced bytes inside the file (a failed aio write can
leave a file of the right size with wrong bytes: a hole, a stale bounce-buffer
half), so a few blocks are read back and compared with what was streamed
before the rank reports success (``storage/writer.py``).
"""

from __future__ import annotations

import os

from ..format.checksum import digest_bytes
from ..format.records import ShardRecord
from ..util.errors import FastPersistError

_PAGE = os.sysconf("SC_PAGE_SIZE")


def _readback_blocks(records: list[ShardRecord], block: int, stride: int) -> list[tuple[ShardRecord, int]]:
    """(record, block index) of the blocks to re-read: the file's first and last, and every ``stride``-th."""
    blocks = [(r, i) for r in sorted(records, key=lambda r: r.offset) for i in range(len(r.checksums))]
    picked = {0, len(blocks) - 1} if blocks else set()
    if stride > 0:
        picked.update(range(0, len(blocks), stride))
    return [blocks[i] for i in sorted(picked)]


def confirm_on_disk(path: str, records: list[ShardRecord], block_bytes: int, rank: int, stride: int = 0) -> int:
    """Re-read sampled checksum blocks of ``path`` from the device and compare them; returns bytes read.

    DeepSpeed's aio path reports no failed write, and the size check after fsync
    cannot see a hole or misplaced bytes inside the file. The sampled pages are
    dropped from the page cache first (clean after fsync), so the buffered
    ``pread`` sees what the device holds, not what the writer left in memory.
    Raises naming the file, byte offset, key and rank of the first mismatch.
    """
    nbytes = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        for record, i in _readback_blocks(records, block_bytes, stride):
            start = record.offset + i * block_bytes
            length = min(block_bytes, record.length - i * block_bytes)
            lo = start // _PAGE * _PAGE
            os.posix_fadvise(fd, lo, -(-(start + length - lo) // _PAGE) * _PAGE, os.POSIX_FADV_DONTNEED)
            data = os.pread(fd, length, start)
            nbytes += len(data)
            if len(data) != length or digest_bytes(data) != record.checksums[i]:
                short = "" if len(data) == length else f" (short read: {len(data)} bytes)"
                raise FastPersistError(
                    f"rank {rank}: read-back of {path} at byte offset {start} (block {i} of {record.describe()}) "
                    f"does not match the bytes written{short}: "
                    "the storage did not persist what it acknowledged (silent aio or device failure)"
                )
    finally:
        os.close(fd)
    return nbytes
