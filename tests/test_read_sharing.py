"""Sharing the reads of resharded loads: the pure plan, and real loads on gloo ranks."""

from __future__ import annotations

import logging
import os
import random

import pytest
import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor

from fastpersist_dist import FastPersistLoadStrategy
from fastpersist_dist.engine.read_exchange import sharing_group
from fastpersist_dist.format.records import data_file_name
from fastpersist_dist.plan.read_sharing import Need, Transfer, plan_recovery, plan_sharing
from fastpersist_dist.storage.mounts import on_memory_filesystem
from fastpersist_dist.tools.ranks import run_ranks
from fastpersist_dist.util.errors import CorruptCheckpointError, FastPersistError

from .helpers import flip_bit, global_tensor, save

pytestmark = pytest.mark.contract

MiB = 1 << 20


def need(lo: int, hi: int, record: int = 0, file: str = "f") -> Need:
    return Need(file, record, 0, (0,), (1,), lo, hi)


def bytes_read(needs: list[list[Need]], transfers: list[Transfer]) -> list[int]:
    """Bytes each rank reads under the plan: the union of its needs not received and those it reads for others."""
    received = {(t.dst, t.need) for t in transfers}
    ranges: list[list[Need]] = [[n for i, n in enumerate(ns) if (r, i) not in received] for r, ns in enumerate(needs)]
    for t in transfers:
        ranges[t.src].append(needs[t.dst][t.need])
    out = []
    for rank_ranges in ranges:
        covered: set[tuple[str, int, int]] = set()
        for n in rank_ranges:
            covered.update((n.file, n.record, b) for b in range(n.lo, n.hi, MiB))
        out.append(len(covered) * MiB)
    return out


def test_column_split_of_row_split_save_reads_each_piece_once_balanced():
    # Two saved pieces (records 0 and 1); each loading rank needs half of every row of both.
    needs = [[need(0, 8 * MiB, 0), need(8 * MiB, 16 * MiB, 1)] for _ in range(2)]
    transfers = plan_sharing(needs)
    assert len(transfers) == 2 and {t.src for t in transfers} == {0, 1}
    assert all(t.src != t.dst for t in transfers)
    assert bytes_read(needs, transfers) == [8 * MiB, 8 * MiB]  # was 16 MiB each


def test_replicated_bytes_are_read_once_and_sent_to_every_rank():
    needs = [[need(0, 4 * MiB)] for _ in range(4)]
    transfers = plan_sharing(needs)
    reader = transfers[0].src
    assert sorted(t.dst for t in transfers) == sorted(set(range(4)) - {reader})
    assert sum(bytes_read(needs, transfers)) == 4 * MiB


def test_a_shared_boundary_block_is_not_worth_a_transfer():
    # Row-split load of a row-split save, splits not on block boundaries: one block in common.
    needs = [[need(0, 5 * MiB)], [need(4 * MiB, 9 * MiB)]]
    assert plan_sharing(needs) == []


def test_different_records_and_files_never_share():
    needs = [[need(0, MiB, record=0)], [need(0, MiB, record=1)], [need(0, MiB, file="g")]]
    assert plan_sharing(needs) == []


def test_what_a_rank_cannot_read_is_read_for_it_by_one_that_can():
    """A tiered checkpoint before it is durable: each node reads only its own files (``readable``)."""
    needs = [[need(0, MiB, file="a"), need(0, 2 * MiB, file="b")], [need(0, 2 * MiB, file="b")]]
    readable = [frozenset({"a"}), frozenset({"b"})]
    for share in (True, False):  # replicated bytes of "b": read by rank 1, sent to rank 0, whether shared or not
        assert plan_sharing(needs, readable=readable, share=share) == [Transfer(1, 0, 1)], share


def test_without_sharing_only_the_unreadable_needs_are_transfers():
    needs = [[need(0, 4 * MiB)] for _ in range(3)]
    assert len(plan_sharing(needs, readable=[None, None, None], share=True)) == 2  # read once, sent twice
    assert plan_sharing(needs, readable=[None, None, None], share=False) == []  # each reads its own
    transfers = plan_sharing(needs, readable=[frozenset(), None, None], share=False)
    assert len(transfers) == 1 and transfers[0].dst == 0 and transfers[0].src in (1, 2)


def test_a_need_nobody_can_read_stays_its_ranks_own_read():
    """Its read then fails naming the file and why no copy is reachable (storage/reader.py)."""
    assert plan_sharing([[need(0, MiB)], [need(2 * MiB, 3 * MiB)]], readable=[frozenset(), frozenset()]) == []


def test_recovery_sends_each_rank_what_it_cannot_read_naming_its_own_indices():
    """A replaced node's ranks (0 and 1) need their files "a" and "b", which only the replicas of ranks 2 and 3
    hold; they send only those needs, by their index among all of theirs, and the readers split the work."""
    stranded = [{3: need(0, 8 * MiB, file="a")}, {0: need(0, 8 * MiB, file="b"), 5: need(8 * MiB, 9 * MiB, 1, "b")},
                {}, {}]
    readable = [frozenset(), frozenset(), frozenset({"a", "b", "c"}), frozenset({"a", "b", "d"})]
    transfers = plan_recovery(stranded, readable)
    assert sorted((t.dst, t.need) for t in transfers) == [(0, 3), (1, 0), (1, 5)]
    assert {t.src for t in transfers} == {2, 3}  # each holder reads some
    assert [(t.src, t.dst) for t in transfers] == sorted((t.src, t.dst) for t in transfers)  # sending order


def test_recovery_of_bytes_no_rank_holds_plans_nothing():
    """The rank's own read then fails naming the file and the nodes that held it (engine/tiers/copies.py)."""
    assert plan_recovery([{2: need(0, MiB, file="a")}, {}], [frozenset(), frozenset({"b"})]) == []
    assert plan_recovery([{}, {}], [frozenset({"a"}), frozenset({"b"})]) == []


def test_readers_balance_the_bytes_and_sends_follow_file_order():
    # Rank 0 alone needs a large record; the shared ones should go to rank 1 mostly.
    needs = [[need(0, 32 * MiB, record=0), need(40 * MiB, 44 * MiB, 1), need(50 * MiB, 54 * MiB, 2)],
             [need(40 * MiB, 44 * MiB, 1), need(50 * MiB, 54 * MiB, 2)]]
    transfers = plan_sharing(needs)
    assert [(t.src, t.dst) for t in transfers] == [(1, 0), (1, 0)]
    assert [needs[t.dst][t.need].lo for t in transfers] == [40 * MiB, 50 * MiB]
    assert plan_sharing(needs) == transfers  # the same on every rank


def test_a_read_alone_between_another_ranks_reads_is_taken_over():
    # File f: rank 1 reads [0, 16) and [20, 32) MiB; rank 0 needs [16, 24) of the second extent
    # (its top rows), one read of its own in the middle of rank 1's. Rank 0 also reads file g.
    needs = [[need(0, 48 * MiB, file="g"), need(16 * MiB, 24 * MiB, record=1)],
             [need(0, 16 * MiB), need(20 * MiB, 32 * MiB, record=1), need(32 * MiB, 48 * MiB, record=2)]]
    assert plan_sharing(needs) == []  # by default nothing is taken over
    transfers = plan_sharing(needs, gap=MiB // 4, absorb_max=32 * MiB)
    assert transfers == [Transfer(1, 0, 1)]  # rank 1 reads [0, 48) of f in one run
    assert bytes_read(needs, transfers) == [48 * MiB, 48 * MiB]
    assert plan_sharing(needs, gap=MiB // 4, absorb_max=4 * MiB) == []  # larger than absorb_max


def test_isolated_reads_stay_where_the_neighbour_lacks_the_extent_or_room():
    lonely = [need(0, 48 * MiB, file="g"), need(16 * MiB, 24 * MiB, record=1)]
    # Rank 1 needs nothing of record 1: it has no way to read it (its index pages may lack it).
    needs = [lonely, [need(0, 16 * MiB), need(24 * MiB, 40 * MiB, record=2)]]
    assert plan_sharing(needs, gap=MiB // 4, absorb_max=32 * MiB) == []
    # Rank 1 would read more than an even share plus ABSORB_ALLOWANCE.
    needs = [[need(16 * MiB, 24 * MiB, record=1)],
             [need(0, 16 * MiB), need(20 * MiB, 32 * MiB, record=1), need(32 * MiB, 48 * MiB, record=2)]]
    assert plan_sharing(needs, gap=MiB // 4, absorb_max=32 * MiB) == []


@pytest.mark.parametrize("seed", range(20))
def test_random_plans_give_every_need_one_reader_that_has_its_extent(seed):
    # What ReadExchange relies on: a need another rank reads for its owner is read by exactly one
    # rank, which needs part of the same extent itself (it takes the record and extent from its
    # own read); each sender's transfers are in file order; every rank computes the same plan.
    rng = random.Random(seed)
    world = rng.randint(2, 5)
    needs: list[list[Need]] = [[] for _ in range(world)]
    for f in ("a", "b", "c")[: rng.randint(1, 3)]:
        pos = 0
        for record in range(rng.randint(1, 12)):
            size = rng.randint(1, 40) * MiB
            for rank in rng.sample(range(world), rng.randint(1, world)):
                lo = pos + rng.randint(0, size // MiB - 1) * MiB
                needs[rank].append(need(lo, rng.randint(lo // MiB + 1, (pos + size) // MiB) * MiB, record, f))
            pos += size + rng.choice((0, 0, MiB // 8, 4 * MiB))
    transfers = plan_sharing(needs, gap=MiB // 4, absorb_max=32 * MiB)
    assert transfers == plan_sharing([list(ns) for ns in needs], gap=MiB // 4, absorb_max=32 * MiB)
    received = [(t.dst, t.need) for t in transfers]
    assert len(received) == len(set(received)) and all(t.src != t.dst for t in transfers)
    for t in transfers:
        n = needs[t.dst][t.need]
        assert any((m.file, m.record, m.extent) == (n.file, n.record, n.extent) for m in needs[t.src]), t
    for src in range(world):
        mine = [(needs[t.dst][t.need].file, needs[t.dst][t.need].lo) for t in transfers if t.src == src]
        assert mine == sorted(mine)


# ---- on real ranks ----------------------------------------------------------

ROWS, COLS = 512, 6144  # 12 MiB of float32: two 4 MiB checksum blocks per saved half


def _save_rows(rank: int, world: int, path: str) -> None:
    full = global_tensor("w", (ROWS, COLS))
    half = ROWS // world
    save({"w": ShardedTensor.from_rank_offsets("w", full[rank * half:(rank + 1) * half].clone(), (0, rank, world))},
         path)


class _Plans(logging.Handler):
    """Collects the read exchange's "planned" debug lines of this process."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []
        logger = logging.getLogger("fastpersist_dist.engine.read_exchange")
        logger.setLevel(logging.DEBUG)
        logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "shared load" in message and "planned in" in message:
            self.lines.append(message)


def _load_columns(rank: int, world: int, path: str, share: str, direct_io: str) -> list[str]:
    plans = _Plans()
    cols = COLS // world
    want = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(ROWS, cols), (1, rank, world))}
    loaded = dist_checkpointing.load(want, path, sharded_strategy=FastPersistLoadStrategy(
        share_reads=share, direct_io=direct_io))
    assert torch.equal(loaded["w"], global_tensor("w", (ROWS, COLS))[:, rank * cols:(rank + 1) * cols]), rank
    return plans.lines


@pytest.mark.parametrize("direct_io", ["auto", "off"])
def test_resharded_load_reads_once_and_exchanges(tmp_path, direct_io):
    path = str(tmp_path / "ckpt")
    run_ranks(2, _save_rows, path)
    share = "on" if on_memory_filesystem(path) else "auto"  # where /tmp is tmpfs
    logs = run_ranks(2, _load_columns, path, share, direct_io)
    # Each rank reads its half of the saved rows and sends the other rank its columns of it.
    quarter = f"{ROWS * COLS * 4 / 4 / 2**30:.3f} GiB"
    assert all(len(lines) == 1 and f"1 for other ranks, {quarter}" in lines[0] and f"receives 1 ({quarter})" in lines[0]
               for lines in logs), logs
    assert run_ranks(2, _load_columns, path, "off", direct_io) == [[], []]


SMALL = (1024, 1024)  # 4 MiB of float32, saved split by columns: 2 MiB per file, after the 6 MiB of "w"


def _save_rows_and_columns(rank: int, world: int, path: str) -> None:
    half, cols = ROWS // world, SMALL[1] // world
    full, small = global_tensor("w", (ROWS, COLS)), global_tensor("z", SMALL)
    save({"w": ShardedTensor.from_rank_offsets("w", full[rank * half:(rank + 1) * half].clone(), (0, rank, world)),
          "z": ShardedTensor.from_rank_offsets("z", small[:, rank * cols:(rank + 1) * cols].clone(), (1, rank, world))},
         path, checksum_block_mb=1)


def _load_transposed(rank: int, world: int, path: str) -> list[str]:
    plans = _Plans()
    cols, rows = COLS // world, SMALL[0] // world
    want = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(ROWS, cols), (1, rank, world)),
            "z": ShardedTensor.from_rank_offsets("z", torch.zeros(rows, SMALL[1]), (0, rank, world))}
    loaded = dist_checkpointing.load(want, path, sharded_strategy=FastPersistLoadStrategy(share_reads="on"))
    assert torch.equal(loaded["w"], global_tensor("w", (ROWS, COLS))[:, rank * cols:(rank + 1) * cols]), rank
    assert torch.equal(loaded["z"], global_tensor("z", SMALL)[rank * rows:(rank + 1) * rows]), rank
    return plans.lines


def test_resharded_load_takes_over_reads_alone_between_the_other_ranks(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(2, _save_rows_and_columns, path)
    logs = run_ranks(2, _load_transposed, path)
    # Each rank reads one file whole: its "w" piece for both ranks, then the top and bottom
    # rows of its "z" piece (2 MiB), and sends the other rank its columns of "w" and its rows of "z".
    sent = f"{(ROWS * COLS // 4 + SMALL[0] * SMALL[1] // 4) * 4 / 2**30:.3f} GiB"
    assert all(len(lines) == 1 and f"2 for other ranks, {sent}" in lines[0] and f"receives 2 ({sent})" in lines[0]
               for lines in logs), logs


def test_in_memory_filesystems_read_unshared_unless_told(shm_dir):
    path = f"{shm_dir}/ckpt"
    run_ranks(2, _save_rows, path)
    assert run_ranks(2, _load_columns, path, "auto", "auto") == [[], []]
    assert all(len(lines) == 1 for lines in run_ranks(2, _load_columns, path, "on", "auto"))


def _load_expect_error(rank: int, world: int, path: str, bad_rank: int) -> str:
    want = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(ROWS, COLS // world), (1, rank, world))}
    exc = CorruptCheckpointError if rank == bad_rank else FastPersistError
    assert sharing_group(True, None) is not None
    with pytest.raises(exc) as info:
        dist_checkpointing.load(want, path, sharded_strategy=FastPersistLoadStrategy())
    # receives may still be posted on the group: later loads of this process must not share over it
    assert sharing_group(True, None) is None
    return str(info.value)


def test_a_corrupt_block_read_for_another_rank_fails_the_load_on_every_rank(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(2, _save_rows, path)
    victim = os.path.join(path, data_file_name(1))
    flip_bit(victim, 4096)
    # Rank 1 reads its own file's half for both ranks (the planner balances by bytes, ties to
    # the rank that needs most, then the lower rank: rank 0 takes record 0 of file 0).
    reader_msg, other_msg = run_ranks(2, _load_expect_error, path, 1)[::-1]
    assert "checksum mismatch" in reader_msg and victim in reader_msg and "rank 1" in reader_msg
    assert "a rank sharing its reads failed: group rank 1: CorruptCheckpointError" in other_msg
    assert victim in other_msg and other_msg.startswith("rank 0")
