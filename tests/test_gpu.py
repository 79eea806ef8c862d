"""Accelerator tensors (CUDA): saved and loaded bit-exactly, async snapshots copied device-to-host into locked memory.

Skipped without CUDA; ``scripts/gpu_check.sh`` runs these (``-m gpu``, where a
skip is a failure) and the benchmark on a GPU machine.
"""

from __future__ import annotations

import pytest
import torch
from megatron.core import dist_checkpointing

from fastpersist_dist import FastPersistSaveStrategy
from fastpersist_dist.engine.async_queue import AsyncSaveQueue
from fastpersist_dist.tools.ranks import run_ranks

from .helpers import load, make_dir, native_strategy, save
from .states import async_save, async_state, load_and_compare, mutate, snapshot

pytestmark = [pytest.mark.engine, pytest.mark.gpu]


@pytest.fixture(autouse=True)
def _on_cuda(cuda_devices: int) -> None:
    """Every test here needs a CUDA device (the ``gpu`` need: scripts/gpu_check.sh requires it)."""


def gpu_state(rank: int, world: int) -> dict:
    """The async tests' state (several dtypes, a strided view, a replica) on this rank's GPU."""
    torch.cuda.set_device(rank % torch.cuda.device_count())
    sd = async_state(rank, world)
    for sh in sd.values():
        sh.data = sh.data.cuda()
    return sd


def _sync_round_trip(rank: int, world: int, root: str) -> None:
    sd = gpu_state(rank, world)
    want = snapshot(sd)
    # native format through our loader, torch_dist format through megatron's own
    for fmt, path, loader in (("fastpersist", f"{root}/native", load), ("torch_dist", f"{root}/dcp", dist_checkpointing.load)):
        save(sd, path, FastPersistSaveStrategy(fmt))
        loaded = load_and_compare(sd, want, path, loader)
        assert all(loaded[k].is_cuda for k in want), path


def test_gpu_tensors_saved_and_loaded_bit_exactly_in_both_formats(tmp_path):
    run_ranks(2, _sync_round_trip, str(tmp_path))


def _async_snapshot_in_locked_memory(rank: int, world: int, root: str) -> None:
    sd = gpu_state(rank, world)
    before = snapshot(sd)
    strategy = native_strategy()
    strategy.load_ops(sd)  # as a trainer would: the save then agrees on a thread beside its copies, on this device
    queue = AsyncSaveQueue()
    path = f"{root}/async"
    make_dir(path)
    request = async_save(sd, path, strategy)
    buffer = request.finalize_fns[0].args[0][1]  # the snapshot buffer leased: the device-to-host copies' target
    queue.schedule(request)
    mutate(sd, 0)  # on the GPU, at once: the snapshot was taken
    queue.maybe_finalize(blocking=True)
    load_and_compare(sd, before, path)
    assert buffer.tensor.device.type == "cpu" and buffer.tensor.is_pinned()


def test_gpu_async_save_snapshots_into_locked_memory(tmp_path):
    run_ranks(2, _async_snapshot_in_locked_memory, str(tmp_path))
