"""The contenders: how each one saves and loads, and the CPU shims megatron's torch_dist needs.

megatron-core 0.16's torch_dist save calls ``torch.cuda.synchronize()`` and
``torch.cuda.current_device()`` unconditionally, so on a CPU-only torch it
cannot run. For the torch_dist contenders alone, inside
:func:`torch_dist_cpu_shims`, both are stubbed (no-op, and "cpu"); FastPersist
never runs under these stubs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import is_main_replica
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelSaveStrategyWrapper,
)
from megatron.core.dist_checkpointing.strategies.torch import (
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
)

from ... import compat
from ...engine.async_queue import AsyncSaveQueue, collective_device
from ...format.checksum import BlockHasher
from ...storage.deepspeed_ops import AioResources, aio_resources
from ...storage.files import fsync_path
from ...strategies.fastpersist_load import FastPersistLoadStrategy
from ...strategies.fastpersist_save import FastPersistSaveStrategy
from ...util.config import TierConfig, WriteConfig
from . import dcp_contenders

SHIM_NOTE = "torch_dist ran with torch.cuda.synchronize/current_device stubbed (CPU-only torch)"
DEVICE_BOUND = "device_bound"
NVRX_ALGO = "atomic"  # what nvidia-resiliency-ext's local checkpoints can do on a host (see _nvrx_local_save)
CHECKSUMMED_BOUND = "device_bound_checksummed"
LOCAL_TIER_DIR = "local-tier"  # fastpersist_local_tier's, in the benchmark's directory


@contextmanager
def torch_dist_cpu_shims() -> Iterator[None]:
    """Stub the two CUDA calls torch_dist makes, only where CUDA is absent."""
    if torch.cuda.is_available():
        yield
        return
    saved = torch.cuda.synchronize, torch.cuda.current_device
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.synchronize, torch.cuda.current_device = saved


Save = Callable[[dict, str, WriteConfig], Optional[float]]  # returns seconds the call blocked, if async
Load = Callable[[dict, str, WriteConfig], dict]  # returns {key: loaded tensor} for the values it can check


@dataclass(frozen=True)
class Contender:
    """One way to save and load the benchmark state."""

    save: Save
    load: Load
    reshards: bool  # can load into another sharding
    what: str  # one line for the report
    start: Optional[Callable[[dict, WriteConfig], None]] = None  # what a trainer does once before its first save


def _torch_dist_save(sd: dict, ckpt: str, _: WriteConfig) -> None:
    with torch_dist_cpu_shims():
        dist_checkpointing.save(sd, ckpt, sharded_strategy=("torch_dist", 1))


def _fully_parallel_save(sd: dict, ckpt: str, _: WriteConfig) -> None:
    strategy = FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy("torch_dist", 1))
    with torch_dist_cpu_shims():
        dist_checkpointing.save(sd, ckpt, sharded_strategy=strategy)


def _fastpersist_save(sd: dict, ckpt: str, config: WriteConfig) -> None:
    dist_checkpointing.save(sd, ckpt, sharded_strategy=FastPersistSaveStrategy("fastpersist", config=config))


def _local_tier_save(sd: dict, ckpt: str, config: WriteConfig) -> None:
    """A local checkpoint only (``persistent=False``) into a local tier beside the benchmark's checkpoints that keeps
    one copy: from the second repetition on, each save retires the last one's copy, as a training run's saves do
    once ``keep_local`` copies exist."""
    tiers = TierConfig(os.path.join(os.path.dirname(os.path.abspath(ckpt)), LOCAL_TIER_DIR), keep_local=1,
                       persistent=False)
    dist_checkpointing.save(sd, ckpt, sharded_strategy=FastPersistSaveStrategy("fastpersist", config=config,
                                                                               tiers=tiers))


def _dcp_save(sd: dict, ckpt: str, config: WriteConfig) -> None:
    dist_checkpointing.save(sd, ckpt, sharded_strategy=FastPersistSaveStrategy("torch_dist", config=config))


def _dcp_fully_parallel_save(sd: dict, ckpt: str, config: WriteConfig) -> None:
    """megatron's DP distribution of main replicas, then ours without re-balancing (it would override it)."""
    ours = FastPersistSaveStrategy("torch_dist", config=dataclasses.replace(config, balance=False))
    dist_checkpointing.save(sd, ckpt, sharded_strategy=FullyParallelSaveStrategyWrapper(ours))


def _unbalanced_save(sd: dict, ckpt: str, config: WriteConfig) -> None:
    strategy = FastPersistSaveStrategy("fastpersist", config=dataclasses.replace(config, balance=False))
    dist_checkpointing.save(sd, ckpt, sharded_strategy=strategy)


@lru_cache(maxsize=None)
def _async_queue() -> AsyncSaveQueue:
    """One queue per process, as in training."""
    return AsyncSaveQueue()


def _fastpersist_async_start(sd: dict, config: WriteConfig) -> None:
    """``load_ops(sd)`` at start-up, as docs/async.md advises: plan, snapshot buffer, writer with its aio handle."""
    FastPersistSaveStrategy("fastpersist", config=config).load_ops(sd)


def _fastpersist_async_save(sd: dict, ckpt: str, config: WriteConfig) -> float:
    """Async save with a fresh strategy (its buffer, plan and writer are the process's) until durable.

    Returns how long the call blocked the caller.
    """
    queue, strategy = _async_queue(), FastPersistSaveStrategy("fastpersist", config=config)
    start = time.perf_counter()
    queue.schedule(dist_checkpointing.save(sd, ckpt, sharded_strategy=strategy, async_sharded_save=True,
                                           **compat.ASYNC_SAVE_KWARGS))
    blocked = time.perf_counter() - start
    queue.maybe_finalize(blocking=True)
    return blocked


def _megatron_load(template: dict, ckpt: str, _: WriteConfig) -> dict:
    """megatron's own torch_dist loader, named (a plain load() reads our checkpoints with ours)."""
    with torch_dist_cpu_shims():
        return dist_checkpointing.load(template, ckpt, sharded_strategy=TorchDistLoadShardedStrategy())


def _fastpersist_load(template: dict, ckpt: str, _: WriteConfig) -> dict:
    """Our loader, checksums verified: what a plain load() uses for our checkpoints of either format."""
    return dist_checkpointing.load(template, ckpt, sharded_strategy=FastPersistLoadStrategy())


def _unshared_load(template: dict, ckpt: str, _: WriteConfig) -> dict:
    """Our loader with ``share_reads="off"``: every rank reads all it needs itself."""
    return dist_checkpointing.load(template, ckpt, sharded_strategy=FastPersistLoadStrategy(share_reads="off"))


def _nvrx_local_save(sd: dict, ckpt: str, _: WriteConfig) -> None:
    """nvidia-resiliency-ext's local checkpoint manager (Megatron-LM's ``--non-persistent-ckpt-type local``),
    synchronous, each rank its own file under ``ckpt``. Its "atomic" algorithm: on a host its "fully_parallel"
    one loads through megatron's tensor exchange, which moves tensors to CUDA, and its async save synchronizes
    CUDA, so each rank writes all it holds, replicas included."""
    from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict
    from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import LocalCheckpointManager

    state, _ = MCoreTensorAwareStateDict.from_state_dict(sd, algo=NVRX_ALGO)
    LocalCheckpointManager(ckpt).save(state, 1)


def _nvrx_local_load(template: dict, ckpt: str, _: WriteConfig) -> dict:
    from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import LocalCheckpointManager

    manager = LocalCheckpointManager(ckpt)
    manager.find_latest()
    state, _ = manager.load()
    return state.to_state_dict(template, algo=NVRX_ALGO)


def _torch_save_file(ckpt: str) -> str:
    return os.path.join(ckpt, f"rank{dist.get_rank():05d}.pt")


def _torch_save(sd: dict, ckpt: str, _: WriteConfig) -> None:
    """Each rank pickles its main replicas into one file, then fsyncs it."""
    mine = {k: sh.data for k, sh in sd.items() if is_main_replica(sh.replica_id)}
    with open(_torch_save_file(ckpt), "wb") as f:
        torch.save(mine, f)
        f.flush()
        os.fsync(f.fileno())


def _torch_load(template: dict, ckpt: str, _: WriteConfig) -> dict:
    return torch.load(_torch_save_file(ckpt), weights_only=True)  # onto the devices it was saved from


def _bound_file(ckpt: str) -> str:
    return os.path.join(ckpt, f"bound{dist.get_rank():05d}.bin")


def even_share(sd: dict) -> int:
    """Collective: bytes of this rank's even share of the state (what a balanced writer writes, and what the
    bounds write and read back)."""
    main = sum(sh.data.numel() * sh.data.element_size() for sh in sd.values() if is_main_replica(sh.replica_id))
    total = torch.tensor([main], dtype=torch.int64, device=collective_device())
    dist.all_reduce(total)
    return int(total.item()) // dist.get_world_size()


def _chunks(nbytes: int, buffer: torch.Tensor, align: int) -> Iterator[tuple[int, torch.Tensor]]:
    size = buffer.numel()
    for offset in range(0, nbytes, size):
        n = min(size, nbytes - offset)
        yield offset, buffer[: -(-n // align) * align]


def _device_bound_write(sd: dict, ckpt: str, config: WriteConfig) -> None:
    """Sequential O_DIRECT aio writes of this rank's share from one locked buffer, then fsync: what fio measures."""
    res = aio_resources(config.aio)
    path, align = _bound_file(ckpt), res.handle.get_alignment()
    for offset, chunk in _chunks(even_share(sd), res.buffer, align):
        if res.handle.sync_pwrite(chunk, path, offset) < 0:
            raise OSError(f"aio write of {path} at {offset} failed")
    fsync_path(path)


def _device_bound_read(template: dict, ckpt: str, config: WriteConfig) -> dict:
    """The same bytes read back with O_DIRECT aio into the locked buffer."""
    res = aio_resources(config.aio)
    path, align = _bound_file(ckpt), res.handle.get_alignment()
    for offset, chunk in _chunks(os.path.getsize(path), res.buffer, align):
        if res.handle.sync_pread(chunk, path, offset) < 0:
            raise OSError(f"aio read of {path} at {offset} failed")
    return {}


def _wait_one(res: AioResources, submitted: int, what: str, path: str, offset: int) -> None:
    """Wait for the one aio request just submitted (``submitted``: what submitting it returned)."""
    if submitted != 0 or res.handle.wait() != 1:
        raise OSError(f"aio {what} of {path} at {offset} failed")


def _digests_file(ckpt: str) -> str:
    return _bound_file(ckpt) + ".xxh3.json"


def _checksummed_bound_write(sd: dict, ckpt: str, config: WriteConfig) -> None:
    """The device bound's writes, each chunk hashed (XXH3, our checksum blocks) while its aio write is in flight.

    The least a writer that checksums every byte must do: no copy, no framing,
    the hash overlapped with the device. Where the CPU outpaces the device the
    hash hides behind the aio; where the bound itself keeps the cores busy
    (tmpfs on few cores) it cannot, for any writer. The digests go beside the
    file for the read to verify.
    """
    res = aio_resources(config.aio)
    path, align = _bound_file(ckpt), res.handle.get_alignment()
    hasher = BlockHasher(config.checksum_block_bytes)
    for offset, chunk in _chunks(even_share(sd), res.buffer, align):
        submitted = res.handle.async_pwrite(chunk, path, offset)
        hasher.update(chunk.numpy())  # xxhash releases the GIL: the aio threads write meanwhile
        _wait_one(res, submitted, "write", path, offset)
    fsync_path(path)
    with open(_digests_file(ckpt), "w") as f:
        json.dump(hasher.finish(), f)


def _checksummed_bound_read(template: dict, ckpt: str, config: WriteConfig) -> dict:
    """The bound's reads into alternate halves of the locked buffer, each hashed while the next is read; verified."""
    res = aio_resources(config.aio)
    path, align = _bound_file(ckpt), res.handle.get_alignment()
    halves = res.buffer.chunk(2)
    hasher = BlockHasher(config.checksum_block_bytes)
    previous: Optional[torch.Tensor] = None
    for i, (offset, chunk) in enumerate(_chunks(os.path.getsize(path), halves[0], align)):
        dest = halves[i % 2][: chunk.numel()]
        submitted = res.handle.async_pread(dest, path, offset)
        if previous is not None:
            hasher.update(previous.numpy())
        _wait_one(res, submitted, "read", path, offset)
        previous = dest
    if previous is not None:
        hasher.update(previous.numpy())
    with open(_digests_file(ckpt)) as f:
        if hasher.finish() != json.load(f):
            raise OSError(f"{path} read back with other checksums than it was written with")
    return {}


CONTENDERS: dict[str, Contender] = {
    DEVICE_BOUND: Contender(_device_bound_write, _device_bound_read, False,
                            "sequential O_DIRECT aio write/read of each rank's even share, fsynced (fio-like)"),
    CHECKSUMMED_BOUND: Contender(_checksummed_bound_write, _checksummed_bound_read, False,
                                 "the device bound plus XXH3 of every byte (4 MiB blocks), hashed while the aio "
                                 "of the same bytes is in flight: the ceiling of a writer that checksums every byte"),
    "fastpersist": Contender(_fastpersist_save, _fastpersist_load, True,
                             "FastPersistSaveStrategy, native format, synchronous; our loader"),
    "fastpersist_async": Contender(_fastpersist_async_save, _fastpersist_load, True,
                                   "FastPersistSaveStrategy.async_save + AsyncSaveQueue, until durable",
                                   start=_fastpersist_async_start),
    "fastpersist_unbalanced": Contender(_unbalanced_save, _fastpersist_load, True,
                                        "FastPersist with balance=False: main replicas write everything"),
    "fastpersist_local_tier": Contender(_local_tier_save, _fastpersist_load, True,
                                        f"FastPersist tiered, a local checkpoint in {LOCAL_TIER_DIR}/ beside the "
                                        "others keeping one copy (a save retires the last one's): the local tier's "
                                        "write path in a training run's steady state"),
    "fastpersist_unshared": Contender(_fastpersist_save, _unshared_load, True,
                                      "FastPersist, loads with share_reads='off' (each rank reads all it needs)"),
    "fastpersist_dcp": Contender(_dcp_save, _megatron_load, True,
                                 "FastPersistSaveStrategy, torch_dist (DCP) format; megatron's stock loader"),
    "fastpersist_dcp_ours": Contender(_dcp_save, _fastpersist_load, True,
                                      "FastPersistSaveStrategy, torch_dist (DCP) format; our loader"),
    "fastpersist_dcp_fully_parallel": Contender(_dcp_fully_parallel_save, _megatron_load, True,
                                                "FullyParallelSaveStrategyWrapper(FastPersist torch_dist, balance off)"),
    "torch_dist": Contender(_torch_dist_save, _megatron_load, True, "megatron torch_dist"),
    "torch_dist_fully_parallel": Contender(_fully_parallel_save, _megatron_load, True,
                                           "megatron FullyParallelSaveStrategyWrapper(torch_dist)"),
    "torch_save": Contender(_torch_save, _torch_load, False, "torch.save of each rank's main replicas + fsync"),
    "dcp_filesystem": Contender(dcp_contenders.filesystem_save, dcp_contenders.filesystem_load, True,
                                "torch.distributed.checkpoint's FileSystemWriter (a thread per core of the rank) "
                                "and FileSystemReader, the state as DTensors"),
    "dcp_async": Contender(dcp_contenders.async_save, dcp_contenders.filesystem_load, True,
                           "dcp.async_save, process kind, shared-memory staging (pinned where there is a GPU), "
                           "FileSystemWriter, until written"),
    "fastpersist_dcp_writer": Contender(dcp_contenders.ours_save, dcp_contenders.ours_load, True,
                                        "FastPersist through torch.distributed.checkpoint: FastPersistWriter and "
                                        "FastPersistReader, the state as DTensors"),
    "nvrx_local": Contender(_nvrx_local_save, _nvrx_local_load, False,
                            f"nvidia-resiliency-ext's LocalCheckpointManager, {NVRX_ALGO!r} algorithm (needs "
                            "nvidia_resiliency_ext importable)"),
}
# The table's rows when none are named, in order (fastpersist_dist_cli checks arguments against its own copy of
# these names before importing this package; tests/test_cli_startup.py keeps the two equal).
DEFAULT_CONTENDERS = (DEVICE_BOUND, CHECKSUMMED_BOUND, "fastpersist", "fastpersist_async", "fastpersist_dcp",
                      "fastpersist_dcp_writer", "torch_dist", "torch_dist_fully_parallel", "dcp_filesystem",
                      "dcp_async", "torch_save")
