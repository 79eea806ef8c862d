"""Bad input, damaged checkpoints and hostile environments: clear errors, nothing half-written."""

from __future__ import annotations

import errno
import json
import logging
import os
import resource
import signal

import pytest
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.core import CheckpointingException

from fastpersist_dist import (
    CorruptCheckpointError,
    FastPersistError,
    FastPersistLoadStrategy,
    FastPersistSaveStrategy,
    IncompleteCheckpointError,
    SaveFailedError,
    compat,
)
from fastpersist_dist.engine.directory import invalidate
from fastpersist_dist.engine.index_reader import read_index
from fastpersist_dist.format.index_pages import part_file_name
from fastpersist_dist.format.kinds import DCP_METADATA_FILE
from fastpersist_dist.format.records import (
    COMMON_FILE,
    CONTAINER_TORCH_SAVE,
    INDEX_FILE,
    aux_copy_name,
    data_file_name,
    status_file_name,
)
from fastpersist_dist.storage.files import TMP_SUFFIX
from fastpersist_dist.tools.inspect import format_report, inspect_checkpoint
from fastpersist_dist.tools.ranks import run_ranks
from fastpersist_dist.tools.verify import verify_checkpoint

from .helpers import (
    COMMON_STATE_OBJECT,
    assert_same,
    flip_bit,
    global_tensor,
    load,
    logged,
    save,
    sharded,
    stock_loader,
)

pytestmark = pytest.mark.contract


def _files(path: str) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.startswith(("fastpersist", ".fastpersist")))


def _expect_save_error(rank: int, world: int, path: str, sd_kind: str) -> str:
    sd = {"good": sharded("good", global_tensor("good", (4, 4)), rank, world, 0)}
    if sd_kind == "not_a_tensor" and rank == 1:
        sd["bad"] = ShardedTensor.from_rank_offsets("bad", torch.zeros(2), replica_id=0)
        sd["bad"].data = [1.0, 2.0]
    elif sd_kind == "dtype":
        sd["bad"] = ShardedTensor.from_rank_offsets("cplx", torch.zeros(2, dtype=torch.complex32), replica_id=rank)
    elif sd_kind == "overlap":
        rows = (0, 3) if rank == 0 else (2, 4)  # rows 2 is saved twice, uneven grid
        full = global_tensor("ov", (6, 2))
        local = full[rows[0] : rows[0] + rows[1]].clone()
        sd["bad"] = ShardedTensor("ov", local, local.dtype, tuple(local.shape), (6, 2), (rows[0], 0), None, 0)
    elif sd_kind == "missing":
        sd["bad"] = sharded("gap", global_tensor("gap", (4, 2)), rank, world, 0)
        sd["bad"].replica_id = rank  # rank 1's half has no main replica
    elif sd_kind == "object_twice":
        sd["bad"] = ShardedObject("obj", {"r": rank}, (1,), (0,), replica_id=0)
    with pytest.raises(CheckpointingException) as info:
        # megatron 0.16 validates grids on rank 0 only and lets the other ranks run on into
        # the strategy; our own coverage check must stop every rank by itself.
        save(sd, path, validate=False)
    return str(info.value)


@pytest.mark.parametrize(
    "kind,needle",
    [
        ("not_a_tensor", "rank 1: ShardedTensor 'bad' holds list, expected a torch.Tensor"),
        ("dtype", "ShardedTensor 'cplx': dtype torch.complex32 is not supported"),
        ("overlap", "tensor 'ov': shards at (0, 0) and (2, 0) overlap"),
        ("missing", "tensor 'gap': main replicas cover 4 of 8 elements (shards missing)"),
        ("object_twice", "object 'obj' at global offset (0,) is a main replica (replica_id 0) on rank 0 and on rank 1"),
    ],
)
def test_bad_input_fails_on_every_rank_and_writes_nothing(tmp_path, kind, needle):
    path = str(tmp_path / "ckpt")
    messages = run_ranks(2, _expect_save_error, path, kind)
    for m in messages:
        assert needle in m, m
    assert _files(path) == [], "no FastPersist file may be written for invalid input"
    assert not os.path.exists(os.path.join(path, "metadata.json"))


def _save_layout(rank: int, world: int, path: str, salt: int, rows: int) -> None:
    save({"w": sharded("w", global_tensor("w", (rows, 8), salt=salt), rank, world, 0)}, path)


def _load_whole(rank: int, world: int, path: str, salt: int, shape: tuple[int, int], **kw: object) -> None:
    want = global_tensor("w", shape, salt=salt)
    req = ShardedTensor.from_rank_offsets("w", torch.zeros_like(want), replica_id=rank)
    loaded = dist_checkpointing.load({"w": req}, path, sharded_strategy=FastPersistLoadStrategy(**kw))
    assert_same(loaded["w"], want, "w")


def test_overwrite_leaves_no_stale_bytes_or_files(tmp_path):
    path = str(tmp_path / "ckpt")
    # megatron-core <= 0.18 writes common.pt itself: we commit a copy of it beside
    ours = [INDEX_FILE, part_file_name(0)] + ([] if COMMON_STATE_OBJECT else [aux_copy_name(COMMON_FILE)])
    run_ranks(4, _save_layout, path, 1, 64)
    assert _files(path) == sorted(ours + [data_file_name(r) for r in range(4)])
    run_ranks(2, _save_layout, path, 2, 8)
    assert _files(path) == sorted(ours + [data_file_name(r) for r in range(2)])
    index = read_index(path, "test")
    for name, size in index.files.items():
        assert os.path.getsize(os.path.join(path, name)) == size
        assert sum(r.length for r in index.records if r.file == name and r.kind == "tensor") == 4 * 8 * 4
    run_ranks(1, _load_whole, path, 2, (8, 8))


def test_invalidation_leaves_the_data_files_this_save_rewrites_to_their_writers(tmp_path):
    """Unlinking a large data file takes time (0.06 s per 0.5 GiB on ext4 here): the writer that replaces it
    unlinks it, not rank 0 in the save call while every rank waits. Everything else stale goes first."""
    ours = [data_file_name(r) for r in range(4)]
    stale = [INDEX_FILE, DCP_METADATA_FILE, part_file_name(0), status_file_name(1),
             data_file_name(0, CONTAINER_TORCH_SAVE), "x" + TMP_SUFFIX]
    for name in ours + stale + [COMMON_FILE]:
        (tmp_path / name).write_bytes(b"old")
    invalidate(str(tmp_path), frozenset(ours[:2]))
    assert sorted(os.listdir(tmp_path)) == sorted(ours[:2] + [COMMON_FILE])


def _refuse_o_direct_then_save(rank: int, world: int, path: str) -> list[str]:
    real_open = os.open

    def no_direct(file, flags, *args, **kwargs):  # a filesystem without O_DIRECT, e.g. old tmpfs
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", file)
        return real_open(file, flags, *args, **kwargs)

    records = logged()
    os.open = no_direct
    try:
        for i in range(2):  # a second save must not warn again
            save({"w": sharded("w", global_tensor("w", (64, 1000)), rank, world, 0)}, f"{path}/fallback{i}")
    finally:
        os.open = real_open
    save({"w": sharded("w", global_tensor("w", (64, 1000)), rank, world, 0)}, f"{path}/direct")
    return [r.getMessage() for r in records if r.levelno >= logging.WARNING]


def test_o_direct_refused_falls_back_to_identical_bytes(tmp_path):
    path = str(tmp_path)
    warnings = run_ranks(2, _refuse_o_direct_then_save, path)
    for w in warnings:
        assert len([m for m in w if "falling back to buffered writes" in m and "refuses O_DIRECT" in m]) == 1, w
    for r in range(2):
        with open(f"{path}/fallback0/{data_file_name(r)}", "rb") as a, open(f"{path}/direct/{data_file_name(r)}", "rb") as b:
            assert a.read() == b.read()
    for name in ("fallback0", "direct"):
        index = read_index(f"{path}/{name}", name)
        assert [r.checksums for r in index.records]
    run_ranks(1, _load_whole, f"{path}/fallback1", 0, (64, 1000))


def _limit_file_size_on_rank1(rank: int, world: int, path: str) -> str:
    if rank == 1:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
    with pytest.raises(SaveFailedError) as info:
        save({"w": sharded("w", global_tensor("w", (1024, 1024)), rank, world, 0)}, path)
    return str(info.value)


def test_write_failure_on_one_rank_raises_on_all_and_commits_nothing(tmp_path):
    path = str(tmp_path / "ckpt")
    messages = run_ranks(2, _limit_file_size_on_rank1, path)
    for m in messages:
        assert "was NOT saved" in m and "rank 1:" in m and data_file_name(1) in m, m
    assert not os.path.exists(os.path.join(path, INDEX_FILE))
    assert not os.path.exists(os.path.join(path, "metadata.json"))
    assert not [n for n in os.listdir(path) if n.startswith(".fastpersist")]


def _save_small(rank: int, world: int, path: str) -> None:
    save({"w": sharded("w", global_tensor("w", (64, 8)), rank, world, 0),
          "o": ShardedObject("o", {"step": 3}, (1,), (0,), replica_id=rank)}, path)


def _load_expect(rank: int, world: int, path: str, exc: type, needle: str, verify: bool = True) -> str:
    req = ShardedTensor.from_rank_offsets("w", torch.zeros(64, 8), replica_id=rank)
    with pytest.raises(exc) as info:
        dist_checkpointing.load({"w": req}, path, sharded_strategy=FastPersistLoadStrategy(verify_checksums=verify))
    assert needle in str(info.value), str(info.value)
    return str(info.value)


def test_flipped_byte_is_caught_with_file_key_and_offset(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(2, _save_small, path)
    victim = os.path.join(path, data_file_name(1))
    flip_bit(victim, 100, 0x10)
    msg = run_ranks(1, _load_expect, path, CorruptCheckpointError, "checksum mismatch")[0]
    assert victim in msg and "'w'" in msg and "byte offset 0" in msg and "rank 0" in msg
    run_ranks(1, _load_expect_silent_with_verify_off, path)


def _load_expect_silent_with_verify_off(rank: int, world: int, path: str) -> None:
    req = ShardedTensor.from_rank_offsets("w", torch.zeros(64, 8), replica_id=rank)
    loaded = dist_checkpointing.load({"w": req}, path, sharded_strategy=FastPersistLoadStrategy(verify_checksums=False))
    assert not torch.equal(loaded["w"], global_tensor("w", (64, 8)))  # the switch really skips verification


def test_truncated_and_missing_files_and_index(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(2, _save_small, path)
    data = os.path.join(path, data_file_name(0))
    os.truncate(data, os.path.getsize(data) - 1)
    run_ranks(1, _load_expect, path, CorruptCheckpointError, "(truncated or replaced file)")
    os.unlink(data)
    run_ranks(1, _load_expect, path, CorruptCheckpointError, f"data file {data} listed in the index is missing")
    os.unlink(os.path.join(path, INDEX_FILE))
    run_ranks(1, _load_expect, path, IncompleteCheckpointError, "this checkpoint is incomplete")


def _committed_state(rank: int, world: int, salt: int) -> dict:
    return {"w": sharded("w", global_tensor("w", (4, 4), salt=salt), rank, world, 0), "common": {"step": salt}}


def _loaded_every_way(rank: int, path: str, fmt: str) -> list[dict]:
    """The checkpoint through our loader, a plain load and, for the torch_dist format, megatron's own loader."""
    def request() -> dict:
        return {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 4), replica_id=rank)}
    loaded = [dist_checkpointing.load(request(), path, sharded_strategy=FastPersistLoadStrategy()),
              dist_checkpointing.load(request(), path)]
    if fmt == "torch_dist":
        loaded.append(dist_checkpointing.load(request(), path, sharded_strategy=stock_loader()))
    return loaded


def _refused_over_committed(rank: int, world: int, path: str, fmt: str) -> None:
    save(_committed_state(rank, world, 1), path, FastPersistSaveStrategy(fmt))
    bad = _committed_state(rank, world, 2)
    bad["bad"] = ShardedTensor.from_rank_offsets("cplx", torch.zeros(2, dtype=torch.complex32), replica_id=rank)
    with pytest.raises(CheckpointingException, match="complex32 is not supported"):
        save(bad, path, FastPersistSaveStrategy(fmt), validate=False)  # megatron <= 0.18 wrote common.pt first
    for loaded in _loaded_every_way(rank, path, fmt):
        assert loaded["common"] == {"step": 1}, loaded["common"]
        assert_same(loaded["w"], global_tensor("w", (4, 4), salt=1), "w")


@pytest.mark.parametrize("fmt", ["fastpersist", "torch_dist"])
def test_a_refused_save_leaves_the_committed_checkpoint_whole_common_state_included(tmp_path, fmt):
    run_ranks(2, _refused_over_committed, str(tmp_path / "ckpt"), fmt)


def _common_pt_rewritten(rank: int, world: int, path: str) -> str:
    save(_committed_state(rank, world, 1), path, write_common_pt=True)
    dist.barrier()
    if rank == 0:  # what a save killed right after megatron's own common.pt write leaves
        torch.save({"common": {"step": 2}}, os.path.join(path, COMMON_FILE))
    dist.barrier()
    with pytest.raises(CorruptCheckpointError) as info:
        load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 4), replica_id=rank)}, path)
    return str(info.value)


def test_a_common_pt_that_is_not_the_committed_one_is_refused(tmp_path):
    path = str(tmp_path / "ckpt")
    copy = aux_copy_name(COMMON_FILE)
    for rank, m in enumerate(run_ranks(2, _common_pt_rewritten, path)):
        assert f"rank {rank}: {os.path.join(path, COMMON_FILE)} (XXH3 " in m and "rewritten after the commit" in m, m
        # megatron-core <= 0.18 writes common.pt itself, so we commit a copy too; 0.19 has the state in the files.
        assert (f"its committed copy {copy} is intact" in m) != COMMON_STATE_OBJECT, m
    report = verify_checkpoint(path)
    assert not report.ok and any(COMMON_FILE in p and "rewritten after the commit" in p for p in report.problems)
    # inspect still shows the committed checkpoint, and which file beside the index is not the committed one
    shown = inspect_checkpoint(path)
    assert (shown.committed, shown.ok) == (True, False) and "w" in {e.key for e in shown.entries}
    assert any(COMMON_FILE in p and "rewritten after the commit" in p for p in shown.problems), shown.problems
    intact = {a.name: a.intact for a in shown.aux_files}
    assert intact == ({COMMON_FILE: False} if COMMON_STATE_OBJECT else {COMMON_FILE: False, copy: True}), intact
    assert f"  {COMMON_FILE}  " in format_report(shown) and "NOT the committed file" in format_report(shown)


def test_damaged_index_is_refused(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(1, _save_small, path)
    index_path = os.path.join(path, INDEX_FILE)
    with open(index_path) as f:
        doc = json.load(f)
    doc["body"]["world_size"] += 1  # a silent edit: the body checksum no longer matches
    with open(index_path, "w") as f:
        json.dump(doc, f)
    run_ranks(1, _load_expect, path, CorruptCheckpointError, "index checksum mismatch")


def _load_with_version_2_in_metadata_json(rank: int, world: int, path: str) -> None:
    req = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(64, 8), replica_id=rank)}
    if compat.REGISTRY:  # megatron-core 0.16 asks the strategy whether it reads metadata.json's backend version
        with pytest.raises(FastPersistError, match="backend version 2 is not supported"):
            dist_checkpointing.load(req, path, sharded_strategy=FastPersistLoadStrategy())
        return
    # megatron-core 0.17+ asks no strategy: our loader reads by its checksummed index, which is version 1
    loaded = dist_checkpointing.load(req, path, sharded_strategy=FastPersistLoadStrategy())
    assert torch.equal(loaded["w"], global_tensor("w", (64, 8)))


def test_backend_check():
    with pytest.raises(FastPersistError, match="FastPersistLoadStrategy reads"):
        FastPersistLoadStrategy().check_backend_compatibility("zarr")
    FastPersistLoadStrategy().check_backend_compatibility("torch_dist")  # our torch_dist format


def test_a_backend_version_we_do_not_know_in_metadata_json(tmp_path):
    """Refused where megatron-core asks the strategy (0.16); elsewhere our index, not metadata.json, decides."""
    path = str(tmp_path / "ckpt")
    run_ranks(1, _save_small, path)
    meta = os.path.join(path, "metadata.json")
    with open(meta) as f:
        doc = json.load(f)
    doc["sharded_backend_version"] = 2
    with open(meta, "w") as f:
        json.dump(doc, f)
    run_ranks(1, _load_with_version_2_in_metadata_json, path)


def test_unsafe_objects_need_trust(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(1, _save_object, path)


def _save_object(rank: int, world: int, path: str) -> None:
    save({"o": ShardedObject("o", {"fn": os.getcwd, "n": 1}, (1,), (0,))}, path)
    template = {"o": ShardedObject("o", None, (1,), (0,))}
    with pytest.raises(FastPersistError, match="trust_objects=True"):
        load(template, path)
    loaded = dist_checkpointing.load(template, path, sharded_strategy=FastPersistLoadStrategy(trust_objects=True))
    assert loaded["o"] == {"fn": os.getcwd, "n": 1}
    req = ShardedTensor.from_rank_offsets("missing", torch.zeros(2))
    with pytest.raises(FastPersistError, match="rank 0: tensor 'missing' .* is not in checkpoint"):
        load({"x": req}, path, validate_access_integrity=False)
