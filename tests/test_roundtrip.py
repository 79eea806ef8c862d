"""Save and load through megatron-core's dist_checkpointing on real ranks, files and DeepSpeed."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor, serialization

from fastpersist_dist import FastPersistLoadStrategy, FastPersistSaveStrategy, compat
from fastpersist_dist.format.records import INDEX_FILE, data_file_name
from fastpersist_dist.tools.ranks import run_ranks

from .helpers import assert_same, empty_like_request, global_tensor, load, logged, save, sharded

pytestmark = pytest.mark.contract

DTYPES = [
    torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32,
    torch.int8, torch.uint8, torch.bool,
] + [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)]


def rich_state_dict(rank: int, world: int) -> dict:
    """Every kind of entry a megatron state dict holds (dtypes, a scalar, an empty shard, views, objects), nested."""
    sd: dict = {"dtypes": {}}
    for dt in DTYPES:
        name = str(dt).split(".")[1]
        sd["dtypes"][name] = sharded(f"dt.{name}", global_tensor(name, (4 * world, 6), dt), rank, world, 0)
    scalar = global_tensor("scalar", (), torch.float32)
    sd["scalar"] = ShardedTensor.from_rank_offsets("scalar", scalar.clone(), replica_id=rank)
    # megatron's regular-grid validation divides by the local shape: an empty tensor needs no grid.
    sd["empty"] = ShardedTensor("empty", torch.empty(0, 3), torch.float32, (0, 3), (0, 3), (0, 0), None, rank)
    # Non-contiguous: a transposed view and a strided slice of larger storage.
    big = global_tensor("big", (6 * world, 10))
    transposed = big.t()[:, 6 * rank : 6 * rank + 6]
    assert not transposed.is_contiguous()
    sd["nested"] = {
        "transposed": ShardedTensor.from_rank_offsets("transposed", transposed, (1, rank, world)),
        "strided": ShardedTensor.from_rank_offsets("strided", big[::2, 1:7], (0, 0, 1), replica_id=rank),
        "deeper": {"axis1": sharded("axis1", global_tensor("axis1", (5, 4 * world)), rank, world, 1)},
    }
    sd["objects"] = {
        "per_rank": ShardedObject("per_rank", {"rank": rank, "text": "x" * rank, "t": torch.arange(rank + 1)}, (world,), (rank,)),
        "replicated": ShardedObject("replicated", [1, 2.5, "three"], (1,), (0,), replica_id=rank),
    }
    return sd


def expected_value(key: str, world: int, rank: int) -> object:
    return {
        "per_rank": {"rank": rank, "text": "x" * rank, "t": torch.arange(rank + 1)},
        "replicated": [1, 2.5, "three"],
    }[key]


def template_of(sd: object) -> object:
    if isinstance(sd, dict):
        return {k: template_of(v) for k, v in sd.items()}
    if isinstance(sd, ShardedTensor):
        return empty_like_request(sd)
    if isinstance(sd, ShardedObject):
        return ShardedObject(sd.key, None, sd.global_shape, sd.global_offset, sd.replica_id)
    return sd


def compare(saved: object, loaded: object, path: str = "") -> None:
    if isinstance(saved, dict):
        assert set(saved) == set(loaded), (path, set(saved), set(loaded))
        for k in saved:
            compare(saved[k], loaded[k], f"{path}/{k}")
    elif isinstance(saved, ShardedTensor):
        assert_same(loaded, saved.data.contiguous(), path)
    elif isinstance(saved, ShardedObject):
        want = saved.data
        if isinstance(want, dict):
            assert set(want) == set(loaded) and all(
                torch.equal(want[k], loaded[k]) if isinstance(want[k], torch.Tensor) else want[k] == loaded[k]
                for k in want
            ), (path, want, loaded)
        else:
            assert loaded == want, (path, want, loaded)


def _roundtrip_rich(rank: int, world: int, path: str) -> list[str]:
    sd = rich_state_dict(rank, world)
    save(sd, path)
    loaded = load(template_of(sd), path)  # backend picked from metadata.json
    compare(rich_state_dict(rank, world), loaded)
    return sorted(os.listdir(path))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_rich_state_dict_round_trip(tmp_path, world):
    ckpt = str(tmp_path / "ckpt")
    listings = run_ranks(world, _roundtrip_rich, ckpt)
    names = listings[0]
    assert INDEX_FILE in names and "metadata.json" in names
    assert not any(n.startswith(".fastpersist") or n.endswith(".tmp") for n in names), names
    assert all(data_file_name(r) in names for r in range(world))


# ---- resharding -------------------------------------------------------------

# 8 rows and a multiple of 4 columns: every split below fits every tensor.
LAYOUT_KEYS = {"w.a": ((8, 12), torch.float32), "w.b": ((8, 16), torch.bfloat16), "w.c": ((8, 4), torch.int64)}


def layout_sd(rank: int, world: int, split: object) -> dict:
    return {k: sharded(k, global_tensor(k, shape, dt), rank, world, split) for k, (shape, dt) in LAYOUT_KEYS.items()}


def _save_layout(rank: int, world: int, path: str, split: object) -> None:
    save(layout_sd(rank, world, split), path)


def _load_layout(rank: int, world: int, path: str, split: object, verify: bool) -> int:
    want = layout_sd(rank, world, split)
    loaded = load(
        {k: empty_like_request(v) for k, v in want.items()}, path,
        sharded_strategy=FastPersistLoadStrategy(verify_checksums=verify),
    )
    for k, sh in want.items():
        assert_same(loaded[k], sh.data, f"{k} rank {rank}")
    return len(loaded)


@pytest.mark.parametrize(
    "save_world,save_split,load_world,load_split",
    [
        (2, 0, 1, None),        # split on axis 0 -> whole on one rank
        (2, 0, 4, 1),           # axis 0 on 2 -> axis 1 on 4
        (2, 1, 4, "grid"),      # axis 1 on 2 -> 2x2 grid
        (4, "grid", 2, 0),      # 2-D grid -> axis 0
        (4, "grid", 1, None),
        (2, (3, 5), 4, 1),      # uneven rows -> axis 1
        (2, (1, 7), 4, (2, 2, 3, 1)),  # uneven -> differently uneven
        (1, None, 2, (5, 3)),
        (2, (0, 8), 3, (4, 0, 4)),  # an empty part at the offset of the next part, saved and loaded
    ],
)
@pytest.mark.parametrize("verify", [True, False])
def test_resharding(tmp_path, save_world, save_split, load_world, load_split, verify):
    ckpt = str(tmp_path / "ckpt")
    run_ranks(save_world, _save_layout, ckpt, save_split)
    run_ranks(load_world, _load_layout, ckpt, load_split, verify)


def _metadata(rank: int, world: int, path: str) -> None:
    sd = rich_state_dict(rank, world)
    # The stack's default: on 0.16 the registered ('fastpersist', 1) by backend tuple; on 0.17+
    # our torch_dist format, which megatron's metadata functions read with their own loader.
    save(sd, path, strategy=("fastpersist", 1) if compat.REGISTRY else FastPersistSaveStrategy())
    meta = dist_checkpointing.load_tensors_metadata(path)
    assert meta["dt.bfloat16"].global_shape == (4 * world, 6) and meta["dt.bfloat16"].dtype == torch.bfloat16
    assert meta["scalar"].global_shape == () and meta["empty"].global_shape == (0, 3)
    assert all(m.data is None for m in meta.values())
    sharded_meta = serialization.load_sharded_metadata(path)
    assert f"per_rank/shard_{world - 1}_{world}" in sharded_meta
    assert "replicated/shard_0_1" in sharded_meta and "axis1" in sharded_meta
    plain = dist_checkpointing.load_plain_tensors(path)
    assert_same(plain["axis1"], global_tensor("axis1", (5, 4 * world)), "plain axis1")


def test_tensors_and_sharded_metadata(tmp_path):
    run_ranks(2, _metadata, str(tmp_path / "ckpt"))


def _direct_io_used(rank: int, world: int, path: str) -> list[str]:
    records = logged(level=logging.DEBUG)  # per-rank lines are DEBUG
    save(layout_sd(rank, world, 0), path)
    return [r.getMessage() for r in records]


def test_writes_go_through_deepnvme(tmp_path):
    messages = run_ranks(2, _direct_io_used, str(tmp_path / "ckpt"))
    for rank, msgs in enumerate(messages):
        assert any(f"rank {rank} wrote" in m and "GiB/s, direct)" in m for m in msgs), msgs
    assert any("committed" in m for m in messages[0])


def _one_element_strided(rank: int, world: int, path: str, fmt: str) -> None:
    full = global_tensor("one", (4,), torch.float64)
    spread = torch.zeros(8, dtype=torch.float64)
    spread[::2] = full
    views = spread[::2]  # stride 2; its one-element slices count as contiguous for torch, stride and all
    sd = {"a": ShardedTensor("one", views[:3], torch.float64, (3,), (4,), (0,), None, 0),
          "b": ShardedTensor("one", views[3:], torch.float64, (1,), (4,), (3,), None, 0)}
    save(sd, path, FastPersistSaveStrategy(fmt))
    for kw in ({"verify_checksums": False}, {"direct_io": "off"}, {}):  # pread unchecked, pread checked, aio
        dest = torch.zeros(8, dtype=torch.float64)[::2]
        template = {"one": ShardedTensor("one", dest, torch.float64, (4,), (4,), (0,), None, 0)}
        loaded = dist_checkpointing.load(template, path, sharded_strategy=FastPersistLoadStrategy(**kw))
        assert_same(loaded["one"], full, f"{fmt} {kw}")


@pytest.mark.parametrize("fmt", ["fastpersist", "torch_dist"])
def test_one_element_strided_views_save_and_load(tmp_path, fmt):
    run_ranks(1, _one_element_strided, str(tmp_path / "ckpt"), fmt)
