"""The index format and the planner: pure, no I/O."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from fastpersist_dist.format.checksum import digest_bytes
from fastpersist_dist.format.coverage import coverage_errors
from fastpersist_dist.format.records import (
    CONTAINER_TORCH_SAVE,
    INDEX_FILE,
    CheckpointIndex,
    ShardRecord,
    _canonical,
    data_file_name,
)
from fastpersist_dist.format.tiers import DURABLE, LOCAL, REPLICATED, TierManifest
from fastpersist_dist.plan.writes import place_in_rank_file
from fastpersist_dist.util.errors import CorruptCheckpointError, FastPersistError

pytestmark = pytest.mark.engine


def rec(key="w", offset=(0, 0), local=(2, 3), glob=(4, 3), file=None, off=0, dtype="float32", **kw):
    length = kw.pop("length", 2 * 3 * 4 if dtype == "float32" else 12)
    return ShardRecord(
        key=key, kind=kw.pop("kind", "tensor"), dtype=dtype, local_shape=local, global_shape=glob,
        global_offset=offset, axis_fragmentations=None, prepend_axis_num=0, flattened_range=kw.pop("fr", None),
        replica_id=0, file=file or data_file_name(0), offset=off, length=length, checksums=("0" * 16,) * (length > 0),
    )


def index(*records: ShardRecord) -> CheckpointIndex:
    files: dict[str, int] = {}
    for r in records:
        files[r.file] = max(files.get(r.file, 0), r.offset + r.length)
    return CheckpointIndex(world_size=1, checksum_block_bytes=4 << 20, files=files, records=records)


def test_index_round_trip():
    idx = index(rec(), rec(offset=(2, 0), off=24))
    assert CheckpointIndex.from_json_bytes(idx.to_json_bytes(), "t") == idx


def _mutated(mutate) -> bytes:
    doc = json.loads(index(rec()).to_json_bytes())
    mutate(doc["body"])
    doc["body_xxh3_64"] = digest_bytes(_canonical(doc["body"]))  # a consistent but hostile index
    return json.dumps(doc).encode()


def _set(path: str, value: object):
    def mutate(body: dict) -> None:
        target = body
        *parents, last = path.split(".")
        for p in parents:
            target = target[int(p)] if p.isdigit() else target[p]
        target[last] = value
    return mutate


@pytest.mark.parametrize(
    "mutate,needle",
    [
        (_set("format_version", 3), "format version 3 is not supported"),
        (_set("format", "other"), "not a fastpersist index"),
        (_set("records.0.file", "../../etc/passwd"), "illegal data file name"),
        (_set("records.0.file", "/abs/fastpersist_r00000.bin"), "illegal data file name"),
        (_set("records.0.file", "fastpersist_r00000.bin\x00"), "illegal data file name"),
        (_set("records.0.key", "a\x00b"), "without NUL"),
        (_set("records.0.offset", 10), "past the end of"),
        (_set("records.0.offset", -1), "offset must be an integer >= 0"),
        (_set("records.0.length", 2**70), "length must be an integer"),
        (_set("records.0.dtype", "float128"), "unknown dtype"),
        (_set("records.0.local_shape", [1, 3]), "need 12 bytes, index says 24"),
        (_set("records.0.global_offset", [3, 0]), "exceeds global shape"),
        (_set("records.0.checksums", []), "0 checksums for 24 bytes"),
        (_set("records.0.flattened_range", [2, 9]), "flattened_range (2, 9) outside 0..6"),
        (_set("records.0.kind", "pickle"), "unknown kind"),
        (_set("files", {"fastpersist_r00001.bin": 24}), "is not listed in the index"),
        (_set("checksum_block_bytes", 0), "checksum_block_bytes must be an integer >= 1"),
        # Reads widen to whole blocks and take elements from the block start: a 7-byte block shifted them.
        (_set("checksum_block_bytes", 7), "checksum_block_bytes must be a multiple of 16, got 7"),
    ],
)
def test_hostile_index_is_refused(mutate, needle):
    with pytest.raises(FastPersistError) as info:
        CheckpointIndex.from_json_bytes(_mutated(mutate), "idx")
    assert needle in str(info.value)


def test_elements_of_a_torch_save_record_must_start_on_an_element():
    file = data_file_name(0, CONTAINER_TORCH_SAVE)
    good = replace(rec(file=file, length=64, dtype="float64"), data_offset=8)

    def of(r: ShardRecord) -> bytes:
        return CheckpointIndex(world_size=1, checksum_block_bytes=4 << 20, files={file: 64}, records=(r,),
                               container=CONTAINER_TORCH_SAVE, metadata_xxh3_64="0" * 16).to_json_bytes()

    assert CheckpointIndex.from_json_bytes(of(good), "idx").records == (good,)
    with pytest.raises(CorruptCheckpointError, match="data_offset 4 does not start a 8-byte element"):
        CheckpointIndex.from_json_bytes(of(replace(good, data_offset=4)), "idx")  # reads would shift the values


def test_damaged_bytes_are_refused():
    good = index(rec()).to_json_bytes()
    with pytest.raises(CorruptCheckpointError, match="not valid JSON"):
        CheckpointIndex.from_json_bytes(good[:-5], "idx")
    flipped = good.replace(b'"offset": 0', b'"offset": 8')
    with pytest.raises(CorruptCheckpointError, match="index checksum mismatch"):
        CheckpointIndex.from_json_bytes(flipped, "idx")


def test_place_in_rank_file_is_back_to_back():
    placed = place_in_rank_file([rec(length=24), rec(key="b", length=0), rec(key="c", length=12, dtype="int32")], data_file_name(3))
    assert [(r.file, r.offset) for r in placed] == [(data_file_name(3), 0), (data_file_name(3), 24), (data_file_name(3), 24)]


def test_coverage_errors():
    assert coverage_errors([rec(), rec(offset=(2, 0))]) == []
    assert "cover 6 of 12" in coverage_errors([rec()])[0]
    assert "overlap" in coverage_errors([rec(), rec(offset=(1, 0)), rec(offset=(2, 0))])[0]
    assert "disagree on the global shape" in coverage_errors([rec(), rec(offset=(2, 0), glob=(4, 4), local=(2, 3))])[0]
    obj = rec(kind="object", dtype=None, local=(), glob=(2,), offset=(0,), length=5)
    assert "more than one rank" in coverage_errors([obj, obj])[0]


def test_overlap_sweep_finds_far_pairs_and_no_false_ones():
    rows = [rec(glob=(64, 3), local=(1, 3), offset=(i, 0)) for i in range(64)]  # every box spans all columns
    assert coverage_errors(rows) == []
    long = rec(glob=(64, 3), local=(9, 3), offset=(40, 0))  # meets rows 40..48, not its sorted neighbour only
    errors = coverage_errors(rows[:40] + rows[49:] + [long, rows[47]], complete=False)
    assert len(errors) == 1 and "(47, 0)" in errors[0] and "(40, 0)" in errors[0], errors
    assert coverage_errors(rows[:10], complete=False) == []  # one group's share of a tensor: no gap reported


def test_a_tiers_manifest_keeps_when_each_state_was_reached():
    """``reached`` survives the round trip; a manifest written before the times were kept reads with none; a
    time for a state the checkpoint has not reached is refused as damage."""
    local = TierManifest(checkpoint_id="c1", checkpoint_dir="/p/c", local_dir="/l", nodes=((0,), (1,)),
                         files={"__0_0.distcp": 0, "__1_0.distcp": 1}, index_files=(INDEX_FILE,),
                         index_xxh3_64="0" * 16, state=LOCAL, created=100.0)
    durable = local.with_state(REPLICATED, 101.5).with_state(DURABLE, 102.25)
    assert durable.reached == {REPLICATED: 101.5, DURABLE: 102.25} and local.reached == {}
    assert TierManifest.from_json_bytes(durable.to_json_bytes(), "m") == durable

    def rewritten(manifest: TierManifest, edit) -> bytes:
        body = json.loads(manifest.to_json_bytes())["body"]
        edit(body)
        return json.dumps({"body": body, "body_xxh3_64": digest_bytes(_canonical(body))}).encode()

    assert TierManifest.from_json_bytes(rewritten(durable, lambda b: b.pop("reached")), "m").reached == {}
    early = rewritten(durable, lambda b: b.update(state=REPLICATED))
    with pytest.raises(CorruptCheckpointError, match=r"m: times recorded for states \['durable', 'replicated'\] "
                                                     "of a checkpoint that is replicated"):
        TierManifest.from_json_bytes(early, "m")
    with pytest.raises(CorruptCheckpointError, match="tiers manifest field missing or malformed"):
        TierManifest.from_json_bytes(rewritten(durable, lambda b: b.update(reached={DURABLE: "soon"})), "m")
