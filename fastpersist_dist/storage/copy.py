"""Copying a data file to another tier, every byte checked against its records' checksums on the way.

A tiered checkpoint moves from the node-local tier to the persistent one as
files (``engine/tiers.py``). The copy reads the source in chunks of whole
checksum blocks, checks each block against the index before it is written, and
makes the destination appear whole or not at all (a temporary name, fsync,
rename, fsync of the directory): a byte that rotted in the local tier, or a
short read, never reaches the persistent tier, and a reader there never sees a
half-copied file.
"""

from __future__ import annotations

import os
import time

from ..format.checksum import digest_bytes
from ..format.records import ShardRecord
from ..util.errors import CorruptCheckpointError, FastPersistError
from .files import TMP_SUFFIX, fsync_path, unlink_quietly

CHUNK_BYTES = 64 << 20  # read and written per call (a whole number of checksum blocks)


def copy_checked(src: str, dst: str, records: list[ShardRecord], block_bytes: int, size: int, who: str) -> float:
    """Copy data file ``src`` (``size`` bytes, holding ``records`` back to back) to ``dst``; the seconds it took.

    Raises ``CorruptCheckpointError`` naming the file, offset and record of
    the first block that does not match its checksum, ``FastPersistError`` on
    any other failure; ``dst`` is then left as it was.
    """
    start = time.perf_counter()
    records = sorted(records, key=lambda r: r.offset)
    covered = sum(r.length for r in records)
    if covered != size or any(a.offset + a.length != b.offset for a, b in zip(records, records[1:])):
        raise CorruptCheckpointError(f"{who}: the records of {src} do not cover its {size} bytes back to back")
    tmp = f"{dst}{TMP_SUFFIX}"
    step = max(1, CHUNK_BYTES // block_bytes) * block_bytes
    try:
        with open(src, "rb", buffering=0) as fin, open(tmp, "wb", buffering=0) as fout:
            if os.fstat(fin.fileno()).st_size != size:
                raise CorruptCheckpointError(f"{who}: {src} has {os.fstat(fin.fileno()).st_size} bytes, "
                                             f"the index says {size}")
            for record in records:
                for rel in range(0, record.length, step):
                    want = min(step, record.length - rel)
                    data = os.pread(fin.fileno(), want, record.offset + rel)
                    if len(data) != want:
                        raise CorruptCheckpointError(f"{who}: short read of {src} at byte {record.offset + rel}")
                    _check(data, record, rel, block_bytes, src, who)
                    view = memoryview(data)
                    while view:
                        view = view[fout.write(view):]
            os.fsync(fout.fileno())
        os.replace(tmp, dst)
    except CorruptCheckpointError:
        unlink_quietly(tmp)
        raise
    except OSError as e:
        unlink_quietly(tmp)
        raise FastPersistError(f"{who}: copying {src} to {dst} failed: {type(e).__name__}: {e}") from e
    fsync_path(os.path.dirname(dst) or ".")
    return time.perf_counter() - start


def _check(data: bytes, record: ShardRecord, rel: int, block_bytes: int, src: str, who: str) -> None:
    """Every block of ``data`` (bytes ``rel`` on of ``record``) against its checksum."""
    for start in range(0, len(data), block_bytes):
        block = (rel + start) // block_bytes
        if digest_bytes(data[start : start + block_bytes]) != record.checksums[block]:
            raise CorruptCheckpointError(
                f"{who}: checksum mismatch in {src} at byte offset {record.offset + rel + start} (block {block} of "
                f"{record.describe()}): this copy is damaged, it was not copied on")
