"""``dist_checkpointing.remove_sharded_tensors`` and ``separation_hint``, beside megatron's own backend.

Each backend saves model and optimizer keys with ``separation_hint="optimizer"``
on 2 gloo ranks, removes the optimizer keys with megatron's public call, then
reads back: the keys left, the model's values, the error a load of a removed
key raises, and the disk space given back. "megatron": megatron's own
torch_dist save, whose removal our registered loader hands to megatron's.
A removal cut short after each of its steps leaves a checkpoint that loads
right or refuses to, and running it again finishes it.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy, TorchDistSaveShardedStrategy
from torch.distributed.checkpoint.api import CheckpointException

from fastpersist_dist import FastPersistLoadStrategy, FastPersistSaveStrategy, verify_checkpoint
from fastpersist_dist.engine.remove import Committed, free_removed_bytes, remove_keys, write_dcp_metadata
from fastpersist_dist.format.records import is_data_file
from fastpersist_dist.tools.bench.baselines import torch_dist_cpu_shims
from fastpersist_dist.tools.ranks import run_ranks

from .helpers import MCORE_VERSION, global_tensor, make_dir

pytestmark = pytest.mark.contract

WORLD = 2
ROW = 16384  # float32 elements of a rank's shard: 64 KiB, many filesystem blocks
KEYS = ("optimizer.m", "optimizer.v", "wte.weight")  # the hinted keys first: the hint moves them
FAMILIES = (CheckpointingException, CheckpointException)
# megatron-core 0.17.1 and 0.18.2's remove_sharded_tensors calls a method its TorchDistSaveShardedStrategy does not
# have, for every checkpoint; FastPersistLoadStrategy().remove_sharded_tensors(dir, prefix) is the call there
MEGATRON_CALL_BROKEN = "type object 'TorchDistSaveShardedStrategy' has no attribute 'remove_sharded_tensors'"


def _sd(rank: int, keys: tuple[str, ...] = KEYS, empty: bool = False) -> dict:
    sd: dict[str, Any] = {
        k: ShardedTensor.from_rank_offsets(
            k, torch.zeros(1, ROW) if empty else global_tensor(k, (WORLD, ROW))[rank : rank + 1].clone(),
            (0, rank, WORLD)) for k in keys}
    if "optimizer.m" in keys:
        sd["optimizer.step"] = ShardedObject("optimizer.step", None if empty else {"step": 7}, (1,), (0,),
                                             replica_id=rank)
    return sd


def _save(backend: str, path: str) -> None:
    make_dir(path)
    strategy = {"fastpersist": lambda: FastPersistSaveStrategy("fastpersist", separation_hint="optimizer"),
                "fastpersist_dcp": lambda: FastPersistSaveStrategy("torch_dist", separation_hint="optimizer"),
                "megatron": lambda: TorchDistSaveShardedStrategy("torch_dist", 1, separation_hint="optimizer")}[backend]()
    with torch_dist_cpu_shims():
        dist_checkpointing.save(_sd(dist.get_rank()), path, sharded_strategy=strategy)


def _load(backend: str, sd: dict, path: str) -> Any:
    """Our native format through our loader, the others through a plain load() (megatron's own: handed over)."""
    strategy = FastPersistLoadStrategy() if backend == "fastpersist" else None
    with torch_dist_cpu_shims():
        return dist_checkpointing.load(sd, path, sharded_strategy=strategy)


def _allocated(path: str) -> int:
    """Bytes the filesystem holds for the data files."""
    return sum(os.stat(os.path.join(path, f)).st_blocks * 512 for f in os.listdir(path)
               if is_data_file(f) or f.endswith(".distcp"))


def _outcome(fn: Any) -> Any:
    """What a load returned (the model's values), or the class of the error it raised and its families."""
    try:
        return ("loaded", fn()["wte.weight"].tolist())
    except BaseException as e:  # noqa: BLE001 - CheckpointException is a BaseException
        return ("raised", type(e).__name__, sorted(f.__name__ for f in FAMILIES if isinstance(e, f)))


OURS = ["CheckpointException", "CheckpointingException"]  # our errors are both megatron's and torch DCP's
# megatron's own removal, handed over by our loader: from megatron-core 0.19 on it runs; 0.16.1's calls
# FileSystemWriter.metadata_path, which torch 2.13 no longer has, and 0.17.1 and 0.18.2's public call fails
# before any strategy (MEGATRON_CALL_BROKEN)
MEGATRONS_REMOVAL_RUNS = tuple(int(p) for p in MCORE_VERSION.split(".")[:2]) >= (0, 19)


def _removal(rank: int, world: int, backend: str, path: str) -> dict:
    _save(backend, path)
    before = _allocated(path) if rank == 0 else 0
    if rank == 0 and backend != "megatron":  # separation_hint: the optimizer's records after the model's in each file
        records = Committed.read(path, "test").index.records
        for name in {r.file for r in records}:
            ends = [r.offset + r.length for r in records if r.file == name and not r.key.startswith("optimizer")]
            starts = [r.offset for r in records if r.file == name and r.key.startswith("optimizer")]
            assert starts and max(ends, default=0) <= min(starts), (name, ends, starts)
    removal = "ok"
    if rank == 0:
        try:
            dist_checkpointing.remove_sharded_tensors(path, "optimizer")
        except AttributeError as e:  # megatron's own call, broken on some stacks (see the test)
            removal = f"{type(e).__name__}: {e}"
            if backend != "megatron" and MEGATRON_CALL_BROKEN in str(e):  # ours, called as the docs say there
                FastPersistLoadStrategy().remove_sharded_tensors(path, "optimizer")
                removal = "ok"
    dist.barrier()
    strategy = FastPersistLoadStrategy() if backend == "fastpersist" else None
    keys = sorted(k for k in dist_checkpointing.serialization.load_sharded_metadata(path, strategy) if not k.startswith("common"))
    out = {
        "removal": removal,
        "keys": keys,
        "model": _outcome(lambda: _load(backend, _sd(rank, ("wte.weight",), empty=True), path)),
        "removed": _outcome(lambda: _load(backend, _sd(rank, ("wte.weight", "optimizer.m"), empty=True), path)),
    }
    if rank == 0:
        out["freed"] = before - _allocated(path)
        out["verified"] = verify_checkpoint(path).problems if backend != "megatron" else []
    return out


def test_removed_keys_are_gone_and_their_bytes_freed_as_by_megatrons_own_removal_from_megatron_core_0_19(tmp_path):
    """Ours removes the optimizer's keys from both formats as megatron's own removal does from its torch_dist
    checkpoint; megatron's runs from megatron-core 0.19 on (compared there), and on the stacks before it fails as
    it does without us (ours compared alone there)."""
    results = {b: run_ranks(WORLD, _removal, b, str(tmp_path / b)) for b in ("megatron", "fastpersist", "fastpersist_dcp")}
    megatrons = results["megatron"][0]["removal"]
    if MEGATRONS_REMOVAL_RUNS:
        assert megatrons == "ok", megatrons
    else:
        assert megatrons.startswith("AttributeError: 'FileSystemWriter'") or MEGATRON_CALL_BROKEN in megatrons, \
            f"megatron-core {MCORE_VERSION}: {megatrons}"
        del results["megatron"]
    removed_bytes = 2 * WORLD * ROW * 4  # optimizer.m and optimizer.v
    for backend, per_rank in results.items():
        assert per_rank[0]["removal"] == "ok", (backend, per_rank[0]["removal"])
        for rank, got in enumerate(per_rank):
            assert got["keys"] == ["wte.weight"], (backend, got["keys"])
            assert got["model"] == ("loaded", global_tensor("wte.weight", (WORLD, ROW))[rank : rank + 1].tolist())
            # torch DCP's error for a key the checkpoint does not have (megatron's backend), or ours, which is one
            assert got["removed"] == (("raised", "CheckpointException", ["CheckpointException"]) if backend == "megatron"
                                      else ("raised", "FastPersistError", OURS)), (backend, got)
        assert per_rank[0]["verified"] == [], (backend, per_rank[0]["verified"])
        # the optimizer's bytes given back (a filesystem block at each end of a hole may stay)
        assert per_rank[0]["freed"] >= removed_bytes - 2 * WORLD * 4096, (backend, per_rank[0]["freed"])


def _cut_short(rank: int, world: int, backend: str, path: str) -> dict:
    """The removal's steps one at a time, with the loads a crash after each would meet; then the whole removal."""
    _save(backend, path)
    model = _sd(rank, ("wte.weight",), empty=True)
    stages: dict[str, Any] = {}
    if rank == 0:
        checkpoint = Committed.read(path, "test")
        kept, removed = checkpoint.split("optimizer")
        assert free_removed_bytes(checkpoint, removed, "test")
    dist.barrier()
    stages["freed"] = [_outcome(lambda: _load(backend, model, path)),
                       _outcome(lambda: _load(backend, _sd(rank, ("optimizer.m",), empty=True) | model, path))]
    if rank == 0:
        write_dcp_metadata(checkpoint, kept)
    dist.barrier()
    with torch_dist_cpu_shims():  # what megatron's own loader reads now
        megatrons = _outcome(lambda: dist_checkpointing.load(model, path, TorchDistLoadShardedStrategy())) \
            if backend == "fastpersist_dcp" else None
    stages["metadata"] = [_outcome(lambda: _load(backend, model, path)), megatrons]
    if rank == 0:
        remove_keys(path, "optimizer")  # run again: finishes
        stages["verified"] = verify_checkpoint(path).problems
    dist.barrier()
    stages["finished"] = _outcome(lambda: _load(backend, model, path))
    return stages


@pytest.mark.parametrize("backend", ["fastpersist", "fastpersist_dcp"])
def test_a_removal_cut_short_loads_right_or_refuses_and_finishes_when_run_again(tmp_path, backend):
    for rank, got in enumerate(run_ranks(WORLD, _cut_short, backend, str(tmp_path))):
        right = ("loaded", global_tensor("wte.weight", (WORLD, ROW))[rank : rank + 1].tolist())
        assert got["freed"][0] == right  # the kept keys' bytes and checksums are untouched
        damaged = ("raised", "CorruptCheckpointError", OURS)
        assert got["freed"][1] == damaged  # a removed key still listed reads as zeros: its checksums fail
        assert got["metadata"][0] in (right, damaged)
        assert got["metadata"][1] in (right, None)  # megatron's loader reads the new .metadata
        assert got["finished"] == right
        if rank == 0:
            assert got["verified"] == []
