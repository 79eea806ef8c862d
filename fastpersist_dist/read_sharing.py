"""Which rank reads which stored bytes when several ranks need the same ones. Pure logic, no I/O.

A resharded load makes ranks want overlapping bytes: a tensor saved split by
rows and loaded split by columns makes every rank need half of every row of
every saved piece, and with whole checksum blocks (and O_DIRECT's alignment)
that is all of each piece's bytes, on every rank. Reading them once and
sending each rank its sub-box over the process group reads each byte once.

Each rank describes its box reads as :class:`Need` s; every rank of the group
runs :func:`plan_sharing` on all of them and gets the same plan. Needs of one
stored extent whose byte ranges overlap by more than half of the smaller one
form a cluster; a cluster wanted by one rank stays that rank's own read, one
wanted by several is read by one of them, which sends the others their
sub-boxes. Readers are chosen in file order: a rank keeps reading the next
shared clusters while it stays within an even share of all bytes read; then
the next one goes to a rank that wants it and stays within its share,
preferring the rank that reads most of that file alone (its reads fill the
gaps between those), then the least loaded. So each rank reads long runs of a
file in large sequential reads and the bytes read per rank stay even
(choosing the least loaded rank per cluster interleaved the ranks' records:
3x as many, smaller reads, 1.3 s instead of 1.05 s, measured). Needs that share only a boundary block (row-split
loads of a row-split save) are not worth a transfer and stay local.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Sequence

from .layout import Shape


@dataclass(frozen=True)
class Need:
    """One box read of one rank: the sub-box of a stored extent and the file bytes it must read."""

    file: str
    record: int  # the record's byte offset in ``file``: identifies it
    extent: int  # the extent's ``byte_start`` in the record: identifies it
    sub_off: Shape  # in extent coordinates
    sub_shape: Shape
    lo: int  # file bytes [lo, hi) read for it (whole checksum blocks)
    hi: int


@dataclass(frozen=True)
class Transfer:
    """Rank ``src`` reads need ``need`` (an index into ``dst``'s needs) and sends it to rank ``dst``."""

    src: int
    dst: int
    need: int


@dataclass
class _Cluster:
    lo: int
    hi: int
    members: list[tuple[int, int]] = field(default_factory=list)  # (rank, need index)


def _worth_sharing(a_lo: int, a_hi: int, b_lo: int, b_hi: int) -> bool:
    """Whether two byte ranges overlap by more than half of the shorter one."""
    overlap = min(a_hi, b_hi) - max(a_lo, b_lo)
    return 2 * overlap > min(a_hi - a_lo, b_hi - b_lo)


def plan_sharing(needs: Sequence[Sequence[Need]]) -> list[Transfer]:
    """The transfers of one load (``needs[r]``: rank r's needs), sorted for sending.

    Every rank reads its needs that appear in no transfer as ``dst`` and the
    needs of the transfers it is ``src`` of. The order (by sender, then file
    and byte offset, then receiver) is the order a sender reads them in; both
    ends post each pair's messages in this order.
    """
    by_extent: dict[tuple[str, int, int], list[tuple[int, int, int, int]]] = defaultdict(list)
    for rank, rank_needs in enumerate(needs):
        for i, n in enumerate(rank_needs):
            by_extent[(n.file, n.record, n.extent)].append((n.lo, n.hi, rank, i))
    load = [0] * len(needs)  # bytes each rank reads
    near: dict[tuple[int, str], int] = defaultdict(int)  # bytes a rank reads alone, per file
    shared: list[tuple[tuple[str, int, int], _Cluster]] = []
    for key in sorted(by_extent):
        clusters: list[_Cluster] = []
        for lo, hi, rank, i in sorted(by_extent[key]):
            cur = clusters[-1] if clusters else None
            if cur is not None and _worth_sharing(cur.lo, cur.hi, lo, hi):
                cur.hi = max(cur.hi, hi)
            else:
                cur = _Cluster(lo, hi)
                clusters.append(cur)
            cur.members.append((rank, i))
        for c in clusters:
            if len({rank for rank, _ in c.members}) > 1:
                shared.append((key, c))
            else:
                alone = sum(needs[r][i].hi - needs[r][i].lo for r, i in c.members)
                load[c.members[0][0]] += alone
                near[(c.members[0][0], key[0])] += alone
    target = (sum(load) + sum(c.hi - c.lo for _, c in shared)) / max(len(needs), 1)
    transfers: list[tuple[tuple[str, int], Transfer]] = []
    reader = -1
    for key, c in shared:  # in file order: a reader keeps going while under its even share
        mine: dict[int, int] = defaultdict(int)
        for r, i in c.members:
            mine[r] += needs[r][i].hi - needs[r][i].lo
        size = c.hi - c.lo
        if reader not in mine or load[reader] + size > target:
            reader = min(mine, key=lambda r: (load[r] + size > target, -near[(r, key[0])], load[r], -mine[r], r))
        load[reader] += size
        for r, i in c.members:
            if r != reader:
                transfers.append(((key[0], needs[r][i].lo), Transfer(reader, r, i)))
    transfers.sort(key=lambda wt: (wt[1].src, wt[0], wt[1].dst, wt[1].need))
    return [t for _, t in transfers]
