"""The checksum blocks of a data file (``Span``), grouped into chunks and checked: what every move of a file
between tiers works in.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..format.checksum import digest_bytes
from ..format.records import ShardRecord
from ..util.errors import CorruptCheckpointError

CHUNK_BYTES = 64 << 20  # moved per step (a whole number of checksum blocks, at least one)


@dataclass(frozen=True)
class Span:
    """One checksum block of a data file: bytes [start, end) of the file, block ``block`` of ``record``."""

    start: int
    end: int
    record: ShardRecord
    block: int


def block_spans(records: list[ShardRecord], block_bytes: int, size: int, where: str) -> list[Span]:
    """Every checksum block of a data file of ``size`` bytes in file order (``where``: the file, for errors).

    Raises ``CorruptCheckpointError`` where the records do not cover the file
    back to back or lack a block's checksum.
    """
    records = sorted(records, key=lambda r: r.offset)
    if sum(r.length for r in records) != size or any(a.offset + a.length != b.offset
                                                     for a, b in zip(records, records[1:])) or (
            records and records[0].offset != 0):
        raise CorruptCheckpointError(f"{where}: the records of the index do not cover its {size} bytes back to back")
    for r in records:
        blocks = -(-r.length // block_bytes)
        if len(r.checksums) != blocks:
            raise CorruptCheckpointError(f"{where}: {r.describe()} has {len(r.checksums)} checksums for {blocks} "
                                         "blocks")
    return [Span(r.offset + b * block_bytes, r.offset + min(r.length, (b + 1) * block_bytes), r, b)
            for r in records for b in range(-(-r.length // block_bytes))]


def chunk_plan(spans: list[Span], chunk_bytes: int = CHUNK_BYTES) -> list[list[Span]]:
    """``spans`` grouped into runs of at most ``chunk_bytes`` (at least one span each): what moves per step.

    Both ends of a transfer derive the same plan from the same index.
    """
    chunks: list[list[Span]] = []
    for s in spans:
        if chunks and s.end - chunks[-1][0].start <= chunk_bytes:
            chunks[-1].append(s)
        else:
            chunks.append([s])
    return chunks


def check_chunk(data: bytes | memoryview, chunk: list[Span], where: str, who: str) -> None:
    """Every block of ``data`` (the bytes of ``chunk``) against its checksum; raises naming the first bad one."""
    view = memoryview(data)
    base = chunk[0].start
    if len(view) != chunk[-1].end - base:
        raise CorruptCheckpointError(f"{who}: {where}: {len(view)} bytes where bytes {base}..{chunk[-1].end} "
                                     "were expected (a short read)")
    for s in chunk:
        if digest_bytes(view[s.start - base : s.end - base]) != s.record.checksums[s.block]:
            raise CorruptCheckpointError(
                f"{who}: checksum mismatch in {where} at byte offset {s.start} (block {s.block} of "
                f"{s.record.describe()}): this copy is damaged, it was not copied on")
