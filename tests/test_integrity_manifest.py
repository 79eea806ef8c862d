"""megatron-core 0.19's integrity manifest: ``save(..., verify_integrity=True)`` and ``load(..., verify_integrity=True)``
with our strategy, in both formats, synchronous and asynchronous, beside megatron's own backend.

megatron hashes every file of the checkpoint once it is committed (``integrity.json``)
and re-hashes them before a load; our block checksums stay on beside it.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.core import CheckpointingException

from fastpersist_dist import AsyncSaveQueue, FastPersistLoadStrategy, FastPersistSaveStrategy
from fastpersist_dist.engine.index_reader import read_index
from fastpersist_dist.format.records import INDEX_FILE
from fastpersist_dist.tools.bench.baselines import torch_dist_cpu_shims
from fastpersist_dist.tools.ranks import run_ranks
from fastpersist_dist.util.errors import CorruptCheckpointError

from .helpers import flip_bit, global_tensor, make_dir

pytestmark = [
    pytest.mark.contract,
    pytest.mark.skipif("verify_integrity" not in inspect.signature(dist_checkpointing.save).parameters,
                       reason="megatron-core 0.19 brought the integrity manifest"),
]

WORLD = 2


def _sd(rank: int, empty: bool = False) -> dict:
    t = torch.zeros(1, 1024) if empty else global_tensor("w", (WORLD, 1024))[rank : rank + 1].clone()
    return {"w": ShardedTensor.from_rank_offsets("w", t, (0, rank, WORLD))}


def _flip_a_bit_of_every_shard(path: str) -> None:
    """In each stored shard of "w" (ours: found through the index); in megatron's, somewhere in its first file."""
    if not os.path.exists(os.path.join(path, INDEX_FILE)):
        flip_bit(os.path.join(path, sorted(f for f in os.listdir(path) if f.endswith(".distcp"))[0]), 100)
        return
    for r in read_index(path, "test").records:
        if r.key == "w":
            flip_bit(os.path.join(path, r.file), r.offset + r.data_offset + 8)


def _outcome(fn: Any) -> Any:
    try:
        return ("loaded", fn()["w"].tolist())
    except CorruptCheckpointError:
        return ("ours", "CorruptCheckpointError")
    except CheckpointingException as e:
        return ("raised", "integrity" if "integrity" in str(e).lower() or "hash" in str(e).lower() else str(e))


def _manifest(rank: int, world: int, backend: str, mode: str, path: str) -> dict:
    make_dir(path)
    strategy = {"fastpersist": lambda: FastPersistSaveStrategy("fastpersist"),
                "fastpersist_dcp": lambda: FastPersistSaveStrategy("torch_dist"),
                "megatron": lambda: None}[backend]()
    with torch_dist_cpu_shims():
        if mode == "async":
            queue = AsyncSaveQueue()
            request = dist_checkpointing.save(_sd(rank), path, sharded_strategy=strategy, async_sharded_save=True,
                                              verify_integrity=True, async_strategy="mcore")
            queue.schedule(request)
            queue.close()
        else:
            dist_checkpointing.save(_sd(rank), path, sharded_strategy=strategy, verify_integrity=True)
    load = FastPersistLoadStrategy() if backend == "fastpersist" else None

    def loaded(verify: bool) -> Any:
        with torch_dist_cpu_shims():
            return dist_checkpointing.load(_sd(rank, empty=True), path, sharded_strategy=load, verify_integrity=verify)

    out = {"manifest": os.path.exists(os.path.join(path, "integrity.json")), "intact": _outcome(lambda: loaded(True))}
    dist.barrier()
    if rank == 0:
        _flip_a_bit_of_every_shard(path)
    dist.barrier()
    out["flipped"] = _outcome(lambda: loaded(True))
    out["flipped_without_manifest"] = _outcome(lambda: loaded(False))
    return out


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_integrity_manifest_as_with_megatrons_backend(tmp_path, mode):
    for backend in ("megatron", "fastpersist", "fastpersist_dcp"):
        for rank, got in enumerate(run_ranks(WORLD, _manifest, backend, mode, str(tmp_path / backend))):
            assert got["manifest"], backend
            assert got["intact"] == ("loaded", global_tensor("w", (WORLD, 1024))[rank : rank + 1].tolist()), backend
            assert got["flipped"] == ("raised", "integrity"), (backend, got["flipped"])
            if backend != "megatron":  # our checksums catch it without the manifest too
                assert got["flipped_without_manifest"] == ("ours", "CorruptCheckpointError"), (backend, got)
