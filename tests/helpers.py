"""Deterministic global tensors, their shards, and save/load calls used inside rank functions."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import zlib
from concurrent.futures import Future
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
from megatron.core.package_info import __version__ as MCORE_VERSION

from fastpersist_dist import FastPersistSaveStrategy, compat
from fastpersist_dist.engine.tiers.background import drainer
from fastpersist_dist.engine.tiers.drain import Drain
from fastpersist_dist.engine.tiers.topology import drain_store
from fastpersist_dist.format.tiers import TierManifest

Split = Union[None, int, str, tuple[int, ...]]

# These tests exercise the engine through the native format on either megatron-core;
# tests/test_torch_dist_format.py covers the torch_dist format and megatron's own loaders.
NATIVE = "fastpersist"
# megatron-core 0.19's save() passes the common state as one more ShardedObject; earlier ones
# (0.16-0.18) write common.pt themselves before the strategy runs.
COMMON_STATE_OBJECT = tuple(int(p) for p in MCORE_VERSION.split(".")[:2]) >= (0, 19)
ADDED_OBJECTS: set[str] = {"common_state"} if COMMON_STATE_OBJECT else set()
# megatron-core 0.17+'s async save defaults to the "nvrx" queue, which needs nvidia-resiliency-ext.
ASYNC_KW: dict = compat.ASYNC_SAVE_KWARGS
# scripts/setup.sh puts nvidia-resiliency-ext there (megatron-core 0.17+), beside the venv, not on its path.
NVRX_DIR = os.path.join(sys.prefix, "nvrx")


def run_one_rank_script(script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -c script *args`` as the one rank of a process group (torchrun's variables, a free loopback
    port): for a test that needs the process's exit (its atexit hooks), which forked ranks never reach."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    return subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def megatron_queue(async_strategy: str):
    """megatron-core 0.17+'s queue for ``async_strategy``: "mcore", or "nvrx" (needs ``NVRX_DIR`` on sys.path).

    nvrx's persistent worker binds a CUDA device (rank % device_count()): its forking caller on CPU.
    """
    from megatron.core.dist_checkpointing.strategies.torch import get_async_strategy

    return get_async_strategy(async_strategy, "AsyncCallsQueue")[1](
        **({"persistent": False} if async_strategy == "nvrx" else {}))


def native_strategy(**knobs: object) -> FastPersistSaveStrategy:
    """Our save strategy, writing the native format."""
    return FastPersistSaveStrategy(NATIVE, **knobs)


def load(sharded_state_dict: dict, path: str, **kwargs: object) -> dict:
    """A plain ``dist_checkpointing.load``: our loader, picked by metadata.json on 0.16, load()'s default on 0.17+."""
    return dist_checkpointing.load(sharded_state_dict, path, **kwargs)


def stock_loader() -> TorchDistLoadShardedStrategy:
    """megatron's own torch_dist loader, named explicitly: a plain load() uses ours on every stack (``registry``)."""
    return TorchDistLoadShardedStrategy()


def global_tensor(key: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32, salt: int = 0) -> torch.Tensor:
    """The same pseudo-random tensor on every rank for a given key/shape/dtype/salt."""
    g = torch.Generator().manual_seed(zlib.crc32(key.encode()) + salt)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 4).to(dtype)
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -(2**31)), min(info.max, 2**31 - 1)
    return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64).to(dtype)


def rows_and_replica(prefix: str, rank: int, world: int, empty: bool) -> dict:
    """A small state as a framework hands it over: ``w`` split by rows over the ranks, ``b`` replicated.

    ``empty``: the same shards with uninitialized data, to load into.
    """
    rows = global_tensor(f"{prefix}.w", (4 * world, 8))
    bias = global_tensor(f"{prefix}.b", (16,))
    mine = rows[4 * rank: 4 * rank + 4]
    return {
        "w": ShardedTensor.from_rank_offsets("w", torch.empty_like(mine) if empty else mine.clone(), (0, rank, world)),
        "b": ShardedTensor.from_rank_offsets("b", torch.empty_like(bias) if empty else bias.clone(), replica_id=rank),
    }


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes of a tensor, for exact comparison (NaN-safe, dtype-agnostic)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape), (what, a.dtype, b.dtype, a.shape, b.shape)
    assert torch.equal(bits(a), bits(b)), f"{what}: values differ"


def shard_of(full: torch.Tensor, rank: int, world: int, split: Split) -> tuple[torch.Tensor, list, int]:
    """(local tensor, rank_offsets, replica_id) of ``rank`` for a split of ``full``.

    split: None replicated; int axis split evenly; "grid" a 2 x (world/2) grid over axes 0 and 1;
    a tuple of row counts: uneven split of axis 0 (handled by :func:`sharded`).
    """
    if split is None:
        return full.clone(), [], rank
    if split == "grid":
        rows, cols = 2, world // 2
        r, c = divmod(rank, cols)
        local = full.chunk(rows, 0)[r].chunk(cols, 1)[c]
        return local.clone(), [(0, r, rows), (1, c, cols)], 0
    assert isinstance(split, int)
    return full.chunk(world, split)[rank].clone(), [(split, rank, world)], 0


def sharded(key: str, full: torch.Tensor, rank: int, world: int, split: Split) -> ShardedTensor:
    """ShardedTensor of ``rank``'s part of ``full``."""
    if isinstance(split, tuple):
        start = sum(split[:rank])
        local = full[start : start + split[rank]].clone()
        return ShardedTensor(
            key, local, local.dtype, tuple(local.shape), tuple(full.shape),
            (start,) + (0,) * (full.dim() - 1), None, 0,
        )
    local, offsets, replica = shard_of(full, rank, world, split)
    return ShardedTensor.from_rank_offsets(key, local, *offsets, replica_id=replica)


def empty_like_request(sh: ShardedTensor) -> ShardedTensor:
    """The same request with fresh, garbage-filled data (so a missed byte shows)."""
    data = torch.full_like(sh.data, 7) if sh.data.dtype != torch.bool else torch.zeros_like(sh.data)
    return ShardedTensor(
        sh.key, data, sh.dtype, sh.local_shape, sh.global_shape, sh.global_offset,
        sh.axis_fragmentations, sh.replica_id, sh.prepend_axis_num,
    )


def flip_bit(path: str, offset: int, mask: int = 0x01) -> None:
    """Damage one byte of a file in place: XOR the byte at ``offset`` with ``mask``, then fsync.

    fsync: the device, not only the page cache, holds the damage (O_DIRECT reads see it).
    """
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ mask]))
        f.flush()
        os.fsync(f.fileno())


def proc_status_kib(field: str, pid: Union[int, str] = "self") -> int:
    """A ``kB`` field of ``/proc/<pid>/status`` (``VmRSS``, ``VmHWM``, ``VmLck``...), in KiB."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def logged(name: str = "fastpersist_dist", level: Optional[int] = None) -> list[logging.LogRecord]:
    """Every record logged to ``name`` (and below) in this process from now on; ``level`` also sets the logger's."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    if level is not None:
        logger.setLevel(level)
    return records


def make_dir(path: str) -> None:
    """megatron's save() needs the directory to exist on every rank."""
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()


def save(sd: dict, path: str, strategy: Optional[object] = None, validate: bool = True, **knobs: object) -> None:
    make_dir(path)
    dist_checkpointing.save(
        sd, path, sharded_strategy=strategy or native_strategy(**knobs), validate_access_integrity=validate
    )


def hold_drains(root: str, rank: int, world: int) -> "Future[TierManifest]":
    """A drain job of a checkpoint that is never saved, queued on this rank's drain thread: the drains queued after
    it wait until the future returned is resolved (an exception: the job ends at once)."""
    held: Future[TierManifest] = Future()
    drainer().submit(Drain(held, os.path.join(root, "other"), os.path.join(root, "other-local"), rank, "test", "none",
                           0.0, drain_store(), world, []))
    return held


def nested_equal(a: Any, b: Any) -> bool:
    """Whether two nested state dicts (dicts, lists, tuples, tensors, values) are equal, tensors in dtype and value."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(nested_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(nested_equal(x, y) for x, y in zip(a, b))
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def without_adam_steps(state: dict) -> dict:
    """A model and optimizer state (``optim``) but for the optimizer's step counts: DCP's stagers (its default, and
    its ``FileSystemWriter``'s) hand any writer those small CPU tensors as they are when written, not as at the
    ``async_save`` call (docs/dcp.md)."""
    return {**state, "optim": {**state["optim"], "state": {fqn: {k: v for k, v in s.items() if k != "step"}
                                                           for fqn, s in state["optim"]["state"].items()}}}


def fsdp2_mlp(world: int) -> "torch.nn.Module":
    """Collective: a small MLP (seeded), each linear layer and the whole sharded by FSDP2 over a CPU mesh of every
    rank."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 40), nn.ReLU(), nn.Linear(40, 16), nn.ReLU(), nn.Linear(16, 8))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model
