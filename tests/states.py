"""States the tests save and load on several ranks, shared by the test modules that exercise them differently."""

from __future__ import annotations

import os
from typing import Callable, Optional

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig

from fastpersist_dist import FastPersistSaveStrategy
from fastpersist_dist.format.checksum import BlockHasher
from fastpersist_dist.format.records import (
    BACKEND,
    BACKEND_VERSION,
    INDEX_FILE,
    CheckpointIndex,
    ShardRecord,
    data_file_name,
)

from .helpers import (
    ASYNC_KW,
    assert_same,
    empty_like_request,
    global_tensor,
    load,
    make_dir,
    save,
    sharded,
    stock_loader,
)

# ----------------------------------------------------------------------------- a megatron-core GPTModel


def build_model(tp: int, seed: int) -> GPTModel:
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(seed)
    cfg = TransformerConfig(
        num_layers=2, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4,
        use_cpu_initialization=True, params_dtype=torch.float32, tensor_model_parallel_size=tp,
    )
    return GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=256, max_sequence_length=32)


def save_model(rank: int, world: int, path: str, strategy: Optional[object] = None) -> None:
    save(build_model(world, seed=1).sharded_state_dict(), path, strategy=strategy)


def load_model(rank: int, world: int, path: str, loader: Optional[Callable[[], object]] = None) -> int:
    """Load into a differently initialized model; ``loader``: makes the load strategy (default: none, a plain load)."""
    model = build_model(world, seed=2)
    reference = build_model(world, seed=1).state_dict()
    assert any(not torch.equal(v, reference[k]) for k, v in model.state_dict().items() if torch.is_tensor(v))
    loaded = load(model.sharded_state_dict(), path, **({"sharded_strategy": loader()} if loader else {}))
    model.load_state_dict(loaded)
    checked = 0
    for k, v in model.state_dict().items():
        if torch.is_tensor(v) and not k.endswith("_extra_state"):
            assert_same(v, reference[k], k)
            checked += 1
    return checked


# ----------------------------------------------------------------------------- flattened records, written by hand


FLAT_SHAPE = (6, 10)
# Two row-shards of the global tensor, each stored as flat pieces spread over two files.
PIECES = [  # (shard row offset, shard rows, flat start, flat stop, file rank)
    (0, 4, 0, 7, 0), (0, 4, 7, 33, 1), (0, 4, 33, 40, 0),
    (4, 2, 0, 20, 1),
]
BLOCK = 16  # tiny checksum blocks, so partial reads verify several blocks


def _checksums(data: bytes) -> list[str]:
    hasher = BlockHasher(BLOCK)
    hasher.update(data)
    return hasher.finish()


def write_flat_checkpoint(path: str) -> torch.Tensor:
    full = global_tensor("flat", FLAT_SHAPE, torch.float32)
    os.makedirs(path, exist_ok=True)
    blobs: dict[int, bytearray] = {0: bytearray(), 1: bytearray()}
    records = []
    for row, rows, start, stop, rank in PIECES:
        data = full[row : row + rows].reshape(-1)[start:stop].numpy().tobytes()
        blob = blobs[rank]
        records.append(ShardRecord(
            key="flat", kind="tensor", dtype="float32", local_shape=(rows, FLAT_SHAPE[1]), global_shape=FLAT_SHAPE,
            global_offset=(row, 0), axis_fragmentations=None, prepend_axis_num=0, flattened_range=(start, stop),
            replica_id=0, file=data_file_name(rank), offset=len(blob), length=len(data),
            checksums=tuple(_checksums(data)),
        ))
        blob.extend(data)
    for rank, blob in blobs.items():
        with open(os.path.join(path, data_file_name(rank)), "wb") as f:
            f.write(blob)
    index = CheckpointIndex(world_size=2, checksum_block_bytes=BLOCK,
                            files={data_file_name(r): len(b) for r, b in blobs.items()}, records=tuple(records))
    with open(os.path.join(path, INDEX_FILE), "wb") as f:
        f.write(index.to_json_bytes())
    torch.save({}, os.path.join(path, "common.pt"))
    save_config(CheckpointingConfig(BACKEND, BACKEND_VERSION), path)
    return full


# ----------------------------------------------------------------------------- TP=2 x DP=2 with replicas and objects


TP = 2
DP = 2


UNEVEN_ROWS = (3000, 1096)  # a tensor-parallel split that is not even (rows per TP rank)
SHAPES = {"qkv": (96, 64), "proj": (64, 96), "ln": (64,), "emb": (8192, 512), "huge": (3 * 2**20 + 7,),
          "uneven": (sum(UNEVEN_ROWS), 1024)}


def full(key: str, step: int = 0) -> torch.Tensor:
    dtype = torch.bfloat16 if key == "proj" else torch.float32
    return global_tensor(key, SHAPES[key], dtype, salt=step)


def tp_dp_state(rank: int, step: int = 0) -> dict:
    """Rank ``rank`` of TP=2 x DP=2: TP over consecutive ranks; every DP rank holds a replica."""
    t, d = rank % TP, rank // TP

    def tp_split(key: str, axis: int) -> ShardedTensor:
        return ShardedTensor.from_rank_offsets(key, full(key, step).chunk(TP, axis)[t].clone(), (axis, t, TP), replica_id=d)

    start = sum(UNEVEN_ROWS[:t])
    uneven = full("uneven", step)[start : start + UNEVEN_ROWS[t]].clone()
    return {
        "qkv": tp_split("qkv", 0), "proj": tp_split("proj", 1), "emb": tp_split("emb", 0),
        "ln": ShardedTensor.from_rank_offsets("ln", full("ln", step), replica_id=(t, d)),
        "huge": ShardedTensor.from_rank_offsets("huge", full("huge", step), replica_id=(t, d)),
        "uneven": ShardedTensor("uneven", uneven, uneven.dtype, tuple(uneven.shape), SHAPES["uneven"],
                                (start, 0), None, d),
        "tp_obj": ShardedObject("tp_obj", {"tp": t, "step": step}, (TP,), (t,), replica_id=d),
        "rank_obj": ShardedObject("rank_obj", [rank, step], (TP * DP,), (rank,)),
    }


def check_loaded(loaded: dict, rank: int, step: int) -> None:
    for key, sh in tp_dp_state(rank, step).items():
        if isinstance(sh, ShardedTensor):
            assert_same(loaded[key], sh.data, f"rank {rank} '{key}'")
        else:
            assert loaded[key] == sh.data, (rank, key, loaded[key], sh.data)


def template(sd: dict) -> dict:
    """Requests for every item of ``sd``: its tensors full of garbage (a missed byte shows), its objects empty."""
    return {k: empty_like_request(v) if isinstance(v, ShardedTensor)
            else ShardedObject(v.key, None, v.global_shape, v.global_offset, v.replica_id) for k, v in sd.items()}


def dp_group(rank: int) -> dist.ProcessGroup:
    """This rank's data-parallel group; every rank creates every group, in the same order."""
    groups = [dist.new_group([t + TP * d for d in range(DP)]) for t in range(TP)]
    return groups[rank % TP]


# ----------------------------------------------------------------------------- async saves: a state that changes


def async_state(rank: int, world: int) -> dict:
    big = global_tensor("base", (16 * world, 64))
    return {
        "w": sharded("w", global_tensor("w", (8 * world, 300)), rank, world, 0),
        "b": sharded("b", global_tensor("b", (4, 6 * world), torch.bfloat16), rank, world, 1),
        "view": ShardedTensor.from_rank_offsets("view", big[16 * rank : 16 * rank + 16, ::2], (0, rank, world)),
        "rep": ShardedTensor.from_rank_offsets("rep", global_tensor("rep", (5,), torch.int64), replica_id=rank),
    }


def mutate(sd: dict, step: int) -> None:
    for sh in sd.values():
        sh.data.add_(step + 1) if sh.data.dtype != torch.bool else sh.data.logical_not_()


def snapshot(sd: dict) -> dict:
    return {k: sh.data.clone() for k, sh in sd.items()}


def load_and_compare(sd: dict, want: dict, path: str, loader: Callable[[dict, str], dict] = load) -> dict:
    """Load ``path`` into zeros shaped (and placed) like ``sd``'s tensors; every value equals ``want``'s."""
    template = {
        k: ShardedTensor(sh.key, torch.zeros_like(sh.data.contiguous()), sh.dtype, sh.local_shape, sh.global_shape,
                         sh.global_offset, sh.axis_fragmentations, sh.replica_id, sh.prepend_axis_num)
        for k, sh in sd.items()
    }
    loaded = loader(template, path)
    for k in want:
        assert_same(loaded[k], want[k].contiguous(), f"{path}:{k}")
    return loaded


def async_save(sd: dict, path: str, strategy: FastPersistSaveStrategy):
    make_dir(path)
    return dist_checkpointing.save(sd, path, sharded_strategy=strategy, async_sharded_save=True, **ASYNC_KW)


# ----------------------------------------------------------------------------- every dtype and sharding (torch_dist)


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool]
SPLITS = {"rows": 0, "cols": 1, "grid": "grid", "replicated": None}


def _dtype_tensor(key: str, shape: tuple[int, ...], dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    if dtype.is_floating_point and dtype.itemsize == 1:  # float8: from float32, finite values
        return global_tensor(key, shape, torch.float32, salt).clamp(-200, 200).to(dtype)
    return global_tensor(key, shape, dtype, salt)


def dtype_state(rank: int, world: int, salt: int = 0) -> dict:
    """Tensors of every dtype and sharding, objects, and plain common values; the same for any world."""
    sd: dict = {}
    for dtype in DTYPES:
        name = str(dtype).split(".")[1]
        for split_name, split in SPLITS.items():
            if split == "grid" and world % 2:
                split = 0
            key = f"{name}.{split_name}"
            sd[key] = sharded(key, _dtype_tensor(key, (8, 12, 3), dtype, salt), rank, world, split)
    sd["obj"] = ShardedObject("obj", {"salt": salt, "ids": [1, 2]}, (1,), (0,), replica_id=rank)
    sd["common"] = {"step": 100 + salt, "lr": 0.5}
    return sd


def dtype_template(rank: int, world: int) -> dict:
    """A request for :func:`dtype_state` whose tensors hold garbage and whose objects hold nothing."""
    out = {}
    for k, v in dtype_state(rank, world).items():
        if isinstance(v, ShardedTensor):
            out[k] = empty_like_request(v)
        elif isinstance(v, ShardedObject):
            out[k] = ShardedObject(v.key, None, v.global_shape, v.global_offset, v.replica_id)
    return out


def check_dtype_state(loaded: dict, rank: int, world: int, salt: int = 0, common: bool = True) -> int:
    want = dtype_state(rank, world, salt)
    for k, v in want.items():
        if isinstance(v, ShardedTensor):
            assert_same(loaded[k], v.data, k)
    assert loaded["obj"] == {"salt": salt, "ids": [1, 2]}, loaded["obj"]
    if common:
        assert loaded["common"] == {"step": 100 + salt, "lr": 0.5}, loaded.get("common")
    return len(want)


def dcp_strategy(**kw) -> FastPersistSaveStrategy:
    return FastPersistSaveStrategy("torch_dist", **kw)


def load_dtype_state_stock(rank: int, world: int, path: str, salt: int = 0) -> int:
    loaded = dist_checkpointing.load(dtype_template(rank, world), path, sharded_strategy=stock_loader())
    return check_dtype_state(loaded, rank, world, salt)


def load_dtype_state_plain(rank: int, world: int, path: str, salt: int = 0) -> int:
    """``load()`` with no strategy: ours on every stack (``registry``)."""
    return check_dtype_state(dist_checkpointing.load(dtype_template(rank, world), path), rank, world, salt)
