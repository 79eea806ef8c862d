"""Planning: which rank writes which bytes, and where in its file. Pure: no I/O, no collectives.

Every rank describes every shard it holds, main replica or not (objects:
main replicas only, they are serialized just to be written). From all ranks'
descriptions :func:`plan_writes` decides who writes what so that bytes per
rank are balanced, the way FastPersist spreads one checkpoint over all
data-parallel writers: a shard may be written by any rank holding a replica;
small shards go whole to the least-loaded holder, large ones are cut into
``flattened_range`` pieces over their holders. Pieces are cut at whole rows of
the shard's first axis longer than 1, so each piece is also a box of the global
tensor: one chunk in torch DCP's metadata. The plan depends only on its inputs,
so every rank computes the same one. Zero-element shards hold no bytes: one
record per (key, offset) is kept, by a holder of its main replica, or by any
holder when the whole world is planned at once, so the tensor stays known.

Replicas of a shard live within one data-parallel group, so each such group
can be planned apart (``PlanCache.plan(ranks=...)``): then ``held`` lists the
group's ranks only, shards whose main replica lies in another group are left
to that group, and the plan balances bytes over the group's ranks.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Optional, Sequence

from megatron.core.dist_checkpointing.mapping import is_main_replica

from ..format.coverage import coverage_errors, shard_box
from ..format.records import KIND_TENSOR, ShardRecord, itemsize
from ..util.errors import FastPersistError

SPLIT_UNIT = 1 << 20  # piece boundaries fall on multiples of this many bytes (rounded up to whole rows)
SHARE_SLACK = 64  # shards up to 1/64 of a rank's fair share are never split
# A plan of whole shards is kept when its busiest rank writes at most this much more than
# the mean: fewer, larger records are cheaper to write and to read (one DCP chunk each;
# measured with `bench --contenders fastpersist_dcp,fastpersist_dcp_fully_parallel`).
WHOLE_SHARD_SLACK = 1.02


class PlanError(FastPersistError):
    """The ranks' shards cannot be planned: inconsistent replicas, duplicates or gaps."""


@dataclass
class _Shard:
    """One stored unit (a tensor shard or an object) and the ranks holding a copy."""

    main_rank: Optional[int]
    holders: dict[int, ShardRecord]  # rank -> that rank's record of the shard, ranks ascending
    length: int
    shape: tuple  # what every replica must agree on, see _shape


def _shape(r: ShardRecord) -> tuple:
    """What replicas of one shard must agree on."""
    return r.dtype, r.local_shape, r.global_shape, r.prepend_axis_num, r.length


# replica ids repeat over a rank's shards: megatron's check, memoized (group planning at 16k ranks)
_is_main = lru_cache(maxsize=4096)(is_main_replica)


def _group(held: Sequence[Sequence[ShardRecord]], ranks: Sequence[int], adopt_empty: bool) -> list[_Shard]:
    """Every distinct shard with its holders (indices into ``held``), in a deterministic order.

    ``ranks[i]`` names ``held[i]`` in errors. ``adopt_empty``: an empty shard
    without a main replica here is written by its first holder (whole world
    planned), else left to the group holding its main replica. Raises on
    inconsistent replicas.
    """
    shards: dict[tuple, _Shard] = {}
    empty_main: set[tuple] = set()
    for i, records in enumerate(held):
        rank = ranks[i]
        for r in records:
            where = (r.kind, r.key, r.global_offset)
            s = shards.get(where)
            if s is not None and _shape(r) != s.shape and r.kind == KIND_TENSOR and 0 in (r.length, s.length):
                # The empty part of an uneven split starts where the next part does and holds nothing.
                if r.length == 0:
                    continue
                s = None
                empty_main.discard(where)
            if s is None:
                s = shards[where] = _Shard(None, {}, r.length, _shape(r))
            elif _shape(r) != s.shape:
                first = next(iter(s.holders.items()))
                raise PlanError(
                    f"{r.kind} '{r.key}' at global offset {r.global_offset}: rank {ranks[first[0]]} and "
                    f"rank {rank} hold replicas that disagree (dtype/shape/bytes: {first[1].dtype} "
                    f"{first[1].local_shape} {first[1].length} vs {r.dtype} {r.local_shape} {r.length})"
                )
            if _is_main(r.replica_id) and r.kind == KIND_TENSOR and r.length == 0:
                empty_main.add(where)
            elif _is_main(r.replica_id):
                if s.main_rank is not None:
                    raise PlanError(
                        f"{r.kind} '{r.key}' at global offset {r.global_offset} is a main replica (replica_id 0) on "
                        f"rank {ranks[s.main_rank]} and on rank {rank}: each shard needs exactly one main replica"
                    )
                s.main_rank = i
            s.holders.setdefault(i, r)
    for where, s in shards.items():  # an empty shard has no bytes to write: any holder stands for it
        if s.main_rank is None and s.length == 0 and (adopt_empty or where in empty_main):
            s.main_rank = min(s.holders)
    return [shards[k] for k in sorted(shards)]


def row_bytes(r: ShardRecord) -> int:
    """Bytes of one row of the shard's first axis longer than 1: cuts at multiples keep a piece one box."""
    box = shard_box(r)
    axis = next((i for i, n in enumerate(box) if n > 1), len(box) - 1)
    return itemsize(r.dtype) * math.prod(box[axis + 1 :])


def _water_fill(load: list[int], ranks: list[int], size: int, unit: int) -> list[tuple[int, int, int]]:
    """Cut ``size`` bytes into (rank, start, stop) so the least-loaded ``ranks`` rise to one level.

    Boundaries are rounded to multiples of ``unit``; the pieces follow rank order.
    """
    order = sorted(ranks, key=lambda c: (load[c], c))
    base, level, takers = 0, 0.0, order
    for j, c in enumerate(order, 1):
        base += load[c]
        level = (size + base) / j
        if j == len(order) or level <= load[order[j]]:
            takers = order[:j]
            break
    pieces, start, wanted = [], 0, 0.0
    takers = sorted(takers)
    for i, c in enumerate(takers):
        wanted += level - load[c]
        stop = size if i == len(takers) - 1 else min(size, round(wanted / unit) * unit)
        if stop > start:
            pieces.append((c, start, stop))
            start = stop
    return pieces


def _piece(r: ShardRecord, start: int, stop: int) -> ShardRecord:
    """The record of bytes [start, stop) of a tensor shard (whole when they are all of it)."""
    if (start, stop) == (0, r.length):
        return r
    size = itemsize(r.dtype)
    return replace(r, flattened_range=(start // size, stop // size), length=stop - start)


def plan_writes(
    held: Sequence[Sequence[ShardRecord]], balance: bool = True, unit: int = SPLIT_UNIT,
    ranks: Optional[Sequence[int]] = None,
) -> list[list[ShardRecord]]:
    """Per rank, the records (whole shards or pieces, not yet placed in files) it writes.

    ``held[i]`` lists what rank ``ranks[i]`` holds: by default the whole
    world (``ranks[i] == i``), else one group of it. Without ``balance`` every shard is
    written whole by its main replica. With it, shards with fewer holders are
    placed first (the widely replicated ones then even out what they left),
    largest first among equals, onto the least-loaded holder. If that plan of
    whole shards is balanced (see ``WHOLE_SHARD_SLACK``) it is the plan;
    otherwise large shards are water-filled over their holders. Raises
    :class:`PlanError` when replicas disagree or a shard has two main replicas.
    """
    world = len(held)
    whole_world = ranks is None
    shards = _group(held, range(world) if whole_world else ranks, whole_world)
    planned = [s for s in shards if s.main_rank is not None]  # shards without one: reported by coverage
    if not balance:
        return _assign(planned, world, False, None, unit)
    planned.sort(key=lambda s: (len(s.holders), -s.length))  # stable: ties keep key order
    whole = _assign(planned, world, True, None, unit)
    per_rank = [sum(r.length for r in records) for records in whole]
    if max(per_rank, default=0) <= WHOLE_SHARD_SLACK * sum(per_rank) / max(world, 1):
        return whole
    fair_share = sum(s.length for s in planned) // max(world, 1)
    return _assign(planned, world, True, max(2 * unit, fair_share // SHARE_SLACK), unit)


def _assign(
    planned: list[_Shard], world: int, balance: bool, split_above: Optional[int], unit: int,
) -> list[list[ShardRecord]]:
    """Place ``planned`` in order: whole on the least-loaded holder, or water-filled when above ``split_above``."""
    load = [0] * world
    out: list[list[ShardRecord]] = [[] for _ in range(world)]
    for s in planned:
        main_record = s.holders[s.main_rank]
        holders = list(s.holders) if balance and main_record.kind == KIND_TENSOR else [s.main_rank]
        if len(holders) == 1 or split_above is None or s.length <= split_above:
            rank = min(holders, key=lambda c: (load[c], c))
            out[rank].append(s.holders[rank])
            load[rank] += s.length
            continue
        row = row_bytes(main_record)
        for rank, start, stop in _water_fill(load, holders, s.length, -(-unit // row) * row):
            out[rank].append(_piece(s.holders[rank], start, stop))
            load[rank] += stop - start
    for records in out:
        records.sort(key=lambda r: (r.key, r.global_offset, r.flattened_range or (0,)))
    return out


def place_in_rank_file(
    records: list[ShardRecord], file: str, frames: Optional[Sequence[tuple[int, int]]] = None
) -> list[ShardRecord]:
    """Lay ``records`` back to back, in order, in ``file``.

    ``frames[i]`` is (bytes before, bytes after) record i's elements (a
    container's framing, see ``checkpoint_formats``); none by default.
    """
    placed, offset = [], 0
    for i, r in enumerate(records):
        before, after = frames[i] if frames else (0, 0)
        length = before + r.length + after
        placed.append(replace(r, file=file, offset=offset, length=length, data_offset=before))
        offset += length
    return placed


Outgoing = tuple[str, Optional[list[ShardRecord]]]


class PlanCache:
    """The last plan and the shard structure it was made for (one per strategy).

    Each save exchanges, per rank, a digest of the records it holds and the
    records themselves only when they changed since the previous save: a
    checkpoint every N steps sends a few bytes per rank and reuses the plan.
    Every rank updates its cache from the same gathered data, so caches agree.
    With a group (``ranks``) the gathered data are the group's, and so is the plan.
    """

    def __init__(self) -> None:
        self._digests: tuple[str, ...] = ()
        self._held: list[list[ShardRecord]] = []
        self._balance: Optional[bool] = None
        self._plan: list[list[ShardRecord]] = []
        self.reused = False

    @staticmethod
    def digest(records: list[ShardRecord]) -> str:
        """Digest of a rank's shard structure (records are plain frozen dataclasses)."""
        return hashlib.blake2b(repr(records).encode(), digest_size=16).hexdigest()

    def _knows(self, rank: int, digest: str) -> bool:
        """Whether the cached plan was made with ``rank``'s structure of this digest."""
        return rank < len(self._digests) and self._digests[rank] == digest

    def outgoing(self, rank: int, held: list[ShardRecord]) -> Outgoing:
        """What ``rank`` sends: its digest, and its records unless the cache already has them."""
        d = self.digest(held)
        return d, None if self._knows(rank, d) else held

    def predicted(self, rank: int, digest: str, balance: bool) -> Optional[list[ShardRecord]]:
        """What ``rank`` (its structure's ``digest``, as in its :meth:`outgoing`) will write if no other rank's
        structure changed either: its records in the cached plan.

        None when the cache cannot tell (no plan yet, this rank's structure or
        ``balance`` changed). Only :meth:`plan` over the gathered data decides.
        """
        return self._plan[rank] if self._knows(rank, digest) and balance == self._balance else None

    def plan(self, gathered: Sequence[Outgoing], balance: bool,
             ranks: Optional[Sequence[int]] = None) -> list[list[ShardRecord]]:
        """The plan for every rank's gathered :meth:`outgoing`; raises :class:`PlanError` if there is none.

        ``gathered[i]`` comes from rank ``ranks[i]`` (default: the whole world,
        ``i``); a group's plan holds the shards whose main replica it holds, and
        is checked for overlaps but not for completeness (other groups hold the rest).
        """
        digests = tuple(d for d, _ in gathered)
        if digests == self._digests and balance == self._balance:
            self.reused = True
            return self._plan
        held = []
        for i, (d, records) in enumerate(gathered):
            if records is None:
                if not self._knows(i, d):
                    rank = i if ranks is None else ranks[i]
                    raise PlanError(f"rank {rank} sent no records and the plan cache does not know its digest {d}")
                records = self._held[i]
            held.append(records)
        plan = plan_writes(held, balance, ranks=ranks)
        errors = coverage_errors([r for records in plan for r in records], complete=ranks is None)
        if errors:
            raise PlanError("; ".join(errors))
        self._digests, self._held, self._balance, self._plan = digests, held, balance, plan
        self.reused = False
        return plan
