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
(choosing the least loaded rank per cluster interleaved the ranks' records into
many more, smaller reads, and the load took longer). Needs that share only a boundary block (row-split
loads of a row-split save) are not worth a transfer and stay local.

Last, a rank's read of a few MiB lying alone between another rank's reads of
the same extent (the top rows of a column-split piece, loaded split by rows)
is taken over by that rank, whose reads then run on through it instead of
stopping short of it, and the device is spared a small read it serves at a
queue depth of one. At most ``absorb_max`` bytes each, and a rank takes them
while it stays within an even share plus ``ABSORB_ALLOWANCE``: a few more bytes
sent between ranks for far fewer reads (docs/performance.md).

Where a rank can read only some files (a tiered checkpoint not yet durable:
each node holds its own ranks' files), ``readable`` says which: a cluster is
read by a rank that can read its file, a wanting one if any, and a need no
wanting rank can read becomes a transfer from one that can. With
``share=False`` only those are transfers; every other need is its rank's own read.
:func:`plan_recovery` plans only those transfers, from just the needs that
ranks cannot read themselves (a replaced node's): what a load gathers where its
group is not the whole job.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence

from ..format.layout import Shape


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


# A rank taking over isolated reads of others may read this much more than an even share.
ABSORB_ALLOWANCE = 1 / 8


@dataclass
class _Cluster:
    lo: int
    hi: int
    members: list[tuple[int, int]] = field(default_factory=list)  # (rank, need index)
    reader: int = -1

    def ranks(self) -> set[int]:
        return {rank for rank, _ in self.members}


def _worth_sharing(a_lo: int, a_hi: int, b_lo: int, b_hi: int) -> bool:
    """Whether two byte ranges overlap by more than half of the shorter one."""
    overlap = min(a_hi, b_hi) - max(a_lo, b_lo)
    return 2 * overlap > min(a_hi - a_lo, b_hi - b_lo)


def plan_sharing(needs: Sequence[Sequence[Need]], gap: int = 0, absorb_max: int = 0,
                 readable: Optional[Sequence[Optional[frozenset[str]]]] = None, share: bool = True) -> list[Transfer]:
    """The transfers of one load (``needs[r]``: rank r's needs), sorted for sending.

    Every rank reads its needs that appear in no transfer as ``dst`` and the
    needs of the transfers it is ``src`` of. The order (by sender, then file
    and byte offset, then receiver) is the order a sender reads them in; both
    ends post each pair's messages in this order. ``gap``: reads at most this
    far apart are one read (the reader's MAX_READ_GAP); ``absorb_max``: the
    largest isolated read another rank takes over (0: none). ``readable[r]``:
    the files rank r can read (None: every file); ``share``: False shares only
    what a rank cannot read itself.
    """

    def can(rank: int, name: str) -> bool:
        return readable is None or readable[rank] is None or name in readable[rank]

    by_extent: dict[tuple[str, int, int], list[tuple[int, int, int, int]]] = defaultdict(list)
    for rank, rank_needs in enumerate(needs):
        for i, n in enumerate(rank_needs):
            by_extent[(n.file, n.record, n.extent)].append((n.lo, n.hi, rank, i))
    load = [0] * len(needs)  # bytes each rank reads
    near: dict[tuple[int, str], int] = defaultdict(int)  # bytes a rank reads alone, per file
    clusters: list[tuple[tuple[str, int, int], _Cluster]] = []
    for key in sorted(by_extent):
        mine: list[_Cluster] = []
        for lo, hi, rank, i in sorted(by_extent[key]):
            cur = mine[-1] if mine else None
            if cur is not None and _worth_sharing(cur.lo, cur.hi, lo, hi) and (share or not can(rank, key[0])):
                cur.hi = max(cur.hi, hi)
            else:
                cur = _Cluster(lo, hi)
                mine.append(cur)
            cur.members.append((rank, i))
        clusters += [(key, c) for c in mine]
    for key, c in clusters:
        if len(c.ranks()) == 1 and can(c.members[0][0], key[0]):
            c.reader = c.members[0][0]
            load[c.reader] += c.hi - c.lo
            near[(c.reader, key[0])] += c.hi - c.lo
    shared = [(key, c) for key, c in clusters if c.reader < 0]
    target = (sum(load) + sum(c.hi - c.lo for _, c in shared)) / max(len(needs), 1)
    reader = -1
    for key, c in shared:  # in file order: a reader keeps going while under its even share
        wants: dict[int, int] = defaultdict(int)
        for r, i in c.members:
            wants[r] += needs[r][i].hi - needs[r][i].lo
        size = c.hi - c.lo
        able = [r for r in wants if can(r, key[0])] or [r for r in range(len(needs)) if can(r, key[0])]
        if not able:  # no rank can read it: its own rank's read says so
            able = sorted(wants)
        if reader not in able or load[reader] + size > target:
            reader = min(able, key=lambda r: (load[r] + size > target, -near[(r, key[0])], load[r], -wants[r], r))
        c.reader = reader
        load[reader] += size
    if absorb_max > 0 and share:
        _absorb_isolated(clusters, load, target * (1 + ABSORB_ALLOWANCE), gap, absorb_max, can)
    transfers = [((key[0], needs[r][i].lo), Transfer(c.reader, r, i))
                 for key, c in clusters for r, i in c.members if r != c.reader]
    transfers.sort(key=lambda wt: (wt[1].src, wt[0], wt[1].dst, wt[1].need))
    return [t for _, t in transfers]


def plan_recovery(stranded: Sequence[Mapping[int, Need]], readable: Sequence[frozenset[str]]) -> list[Transfer]:
    """The transfers that bring each rank the needs it cannot read itself, sorted for sending.

    ``stranded[r]``: rank r's needs in files it cannot read, by their index in
    its list of needs (the index each :class:`Transfer` names); ``readable[r]``:
    the files rank r can read. The readers are chosen as by :func:`plan_sharing`
    with ``share=False``, among the ranks that can read each file; a need that
    no rank can read stays its own rank's read (which then says why it fails).
    """
    order = [sorted(needs) for needs in stranded]
    compact = [[needs[i] for i in keys] for needs, keys in zip(stranded, order)]
    return [Transfer(t.src, t.dst, order[t.dst][t.need]) for t in plan_sharing(compact, readable=readable, share=False)]


def _absorb_isolated(clusters: list[tuple[tuple[str, int, int], _Cluster]], load: list[int], limit: float,
                     gap: int, absorb_max: int, can: Callable[[int, str], bool]) -> None:
    """Give single-rank clusters that sit alone between other ranks' reads to one of those ranks.

    A cluster is isolated when neither cluster next to it in its file (by byte
    offset) is read by its rank; it goes to the rank reading a neighbour at most
    ``gap`` bytes away that also needs part of the same extent (so it has the
    extent's record, and its reads run on through), least loaded first, while
    that rank reads at most ``limit`` bytes. In byte order across files, so two
    ranks taking from each other's files stay even.
    """
    wanted: dict[tuple[str, int, int], set[int]] = defaultdict(set)
    by_file: dict[str, list[_Cluster]] = defaultdict(list)
    for key, c in clusters:
        wanted[key] |= c.ranks()
        by_file[key[0]].append(c)
    place: dict[int, tuple[list[_Cluster], int]] = {}
    for row in by_file.values():
        row.sort(key=lambda c: (c.lo, c.hi))
        place.update((id(c), (row, j)) for j, c in enumerate(row))
    for key, c in sorted(clusters, key=lambda kc: (kc[1].lo, kc[0])):
        size = c.hi - c.lo
        if len(c.ranks()) > 1 or size > absorb_max:
            continue
        row, j = place[id(c)]
        beside = [n for n in (row[j - 1] if j else None, row[j + 1] if j + 1 < len(row) else None)
                  if n is not None and n.lo <= c.hi + gap and c.lo <= n.hi + gap]
        if any(n.reader == c.reader for n in beside):
            continue
        takers = [n.reader for n in beside
                  if n.reader in wanted[key] and can(n.reader, key[0]) and load[n.reader] + size <= limit]
        if takers:
            taker = min(takers, key=lambda r: (load[r], r))
            load[c.reader] -= size
            load[taker] += size
            c.reader = taker
