"""fastpersist_dist.nemo: NeMo 2's own checkpoint IO (``MegatronCheckpointIO``) saving and loading through FastPersist.

NeMo's ``nemo.lightning.io.pl`` is the real one (NeMo 2.7.3: ``pip install --target DIR
'nemo_toolkit[lightning]==2.7.3'`` and ``FASTPERSIST_NEMO=DIR``, which these tests append to
``sys.path`` after site-packages, as ``.ci/run`` does on the megatron-core 0.16.1 stack); skipped,
saying so, where it is not importable. Two ranks on gloo, NeMo's defaults otherwise: its
``FullyParallelSaveStrategyWrapper`` around our strategy, the ``weights/`` subdirectory, loads with
``parallel_load`` off (megatron-core picks the loader from ``metadata.json``) and on (NeMo asks for
a strategy, megatron's ``FullyParallelLoadStrategyWrapper`` around ours), and ``async_save=True``
with the request run by megatron's ``AsyncCallsQueue`` as NeMo's ``AsyncFinalizableCheckpointIO``
does (that wrapper itself does not import on megatron-core 0.16: it imports the tensorstore
strategy 0.16 removed).

Megatron's fully-parallel load exchanges shards on the GPU (``.cuda()``, ``device="cuda"``
buffers): on a CPU-only machine ``tests/cpu_cuda.py`` keeps them on the CPU, as for Megatron-LM's
training code, and NeMo's ``_fix_tensors_device`` (which asserts an initialized CUDA context, then
moves CUDA tensors to the current device) is the identity there: the platform, not the code under
test.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys
import types

import pytest
import torch
from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

from fastpersist_dist import FastPersistSaveStrategy, checkpoint_state, compat, wait_copies, wait_durable
from fastpersist_dist.format.records import INDEX_FILE
from fastpersist_dist.integrations import nemo as fastpersist_nemo
from fastpersist_dist.tools.ranks import run_ranks
from fastpersist_dist.tools.verify import verify_checkpoint

from .cpu_cuda import stand_in_for_cuda
from .helpers import NVRX_DIR, logged, megatron_queue, rows_and_replica

pytestmark = pytest.mark.contract

STEP = 7


def _state(rank: int, world: int, empty: bool) -> dict:
    return {
        **rows_and_replica("nemo", rank, world, empty),
        # Lightning's loop progress, as in a NeMo checkpoint: NeMo's finalize logs the step from it
        "loops": {"fit_loop": {"epoch_loop.batch_progress": {"total": {"completed": 0 if empty else STEP}}}},
    }


def _save_and_load_through_nemo(rank: int, world: int, path: str, checkpoint_format: str, async_save: bool,
                                parallel_load: bool) -> dict:
    from megatron.core import parallel_state
    from nemo.lightning.io import pl
    from nemo.lightning.io.pl import MegatronCheckpointIO

    if not torch.cuda.is_available():
        stand_in_for_cuda()
        pl._fix_tensors_device = lambda checkpoint: checkpoint
    parallel_state.initialize_model_parallel()  # NeMo's strategy does this before any checkpoint
    if async_save and not compat.REGISTRY:
        sys.path.insert(0, NVRX_DIR)  # the save builds an nvrx request (_queue_for_nemo_requests)
    strategy = fastpersist_nemo.enable(checkpoint_format, async_save=async_save)
    try:
        io = MegatronCheckpointIO(async_save=async_save, parallel_load=parallel_load)
        built = io.save_sharded_strategy
        assert isinstance(built, FullyParallelSaveStrategyWrapper) and built.base_strategy is strategy
        state = _state(rank, world, empty=False)
        request = io.save_checkpoint(state, path)
        if async_save:
            queue = _queue_for_nemo_requests()
            queue.schedule_async_request(request)
            state["w"].data.add_(100)  # the checkpoint keeps the values of the moment of the call
            queue.maybe_finalize_async_calls(blocking=True)
            queue.close()
        loaded = io.load_checkpoint(path, sharded_state_dict=_state(rank, world, empty=True))
        expected = _state(rank, world, empty=False)
        assert all(torch.equal(loaded[key], expected[key].data) for key in ("w", "b"))
        assert loaded["loops"] == expected["loops"]  # common state, also through our loader
    finally:
        fastpersist_nemo.disable()
    weights = os.path.join(path, "weights")
    return {"files": sorted(os.listdir(weights)), "weights": weights}


def _queue_for_nemo_requests():
    """The megatron queue that runs the request NeMo's save returns.

    NeMo passes no ``async_strategy``: on megatron-core 0.17+ the request is then
    nvidia-resiliency-ext's ("nvrx", the default there), run by that package's
    queue.
    """
    return compat.megatron_async_queue_class()() if compat.REGISTRY else megatron_queue("nvrx")


CASES = [  # (checkpoint format, async save, parallel load)
    ("torch_dist", False, False), ("torch_dist", False, True), ("torch_dist", True, True),
    ("fastpersist", False, True), ("fastpersist", True, True),
]
if compat.REGISTRY:  # megatron-core 0.16 picks our loader for the native format from metadata.json
    CASES.append(("fastpersist", False, False))


@pytest.mark.parametrize("checkpoint_format,async_save,parallel_load", CASES)
def test_nemo_checkpoint_io_saves_and_loads_through_fastpersist(nemo, tmp_path, checkpoint_format, async_save,
                                                                 parallel_load):
    path = str(tmp_path / "step=1")
    result = run_ranks(2, _save_and_load_through_nemo, path, checkpoint_format, async_save, parallel_load)[0]
    assert INDEX_FILE in result["files"], result["files"]
    data_files = {"torch_dist": {".metadata", "__0_0.distcp", "__1_0.distcp"},
                  "fastpersist": {"fastpersist_r00000.bin", "fastpersist_r00001.bin"}}[checkpoint_format]
    assert data_files <= set(result["files"]), result["files"]
    with open(os.path.join(result["weights"], "metadata.json")) as f:
        backend = json.load(f)["sharded_backend"]
    # megatron-core writes it from the strategy save() was given: NeMo's fully-parallel wrapper, whose name enable()
    # replaced (megatron-core 0.17+'s own wrapper reports "torch_dist" whatever it wraps)
    assert backend == checkpoint_format
    report = verify_checkpoint(result["weights"])
    assert report.ok, report.problems


def _tiered_through_nemo(rank: int, world: int, root: str) -> dict:
    """Two tiered saves through NeMo's checkpoint IO, then its strategy giving the first up (``save_top_k``) and
    removing a link to the second on every rank, as Lightning calls it; the second loaded back through NeMo."""
    from lightning.pytorch.plugins.environments import TorchElasticEnvironment
    from megatron.core import parallel_state
    from nemo.lightning.io import pl
    from nemo.lightning.io.pl import MegatronCheckpointIO
    from nemo.lightning.pytorch.strategies.megatron_strategy import MegatronStrategy

    if not torch.cuda.is_available():
        stand_in_for_cuda()
        pl._fix_tensors_device = lambda checkpoint: checkpoint
    parallel_state.initialize_model_parallel()
    messages = logged("fastpersist_dist", logging.INFO)
    first, second = (os.path.join(root, "checkpoints", f"step={step}") for step in (1, 2))
    fastpersist_nemo.enable(local_dir=os.path.join(root, "local"))
    try:
        io = MegatronCheckpointIO(parallel_load=True)
        io.save_checkpoint(_state(rank, world, empty=False), first)
        assert wait_durable(os.path.join(first, "weights"), timeout=120)
        io.save_checkpoint(_state(rank, world, empty=False), second)
        last = second + "-last"  # NeMo's save_last="link": a link to the newest checkpoint
        if rank == 0:
            os.symlink(second, last)
        torch.distributed.barrier()
        strategy = MegatronStrategy(cluster_environment=TorchElasticEnvironment())
        strategy.remove_checkpoint(first)
        strategy.remove_checkpoint(last)  # the link goes at once, its target stays
        torch.distributed.barrier()
        link_left = os.path.lexists(last)
        assert wait_copies(timeout=120)
        torch.distributed.barrier()
        loaded = io.load_checkpoint(second, sharded_state_dict=_state(rank, world, empty=True))
        expected = _state(rank, world, empty=False)
        equal = all(torch.equal(loaded[key], expected[key].data) for key in ("w", "b"))
    finally:
        fastpersist_nemo.disable()
    return {"first_left": os.path.exists(first), "link_left": link_left, "second": checkpoint_state(os.path.join(second, "weights")),
            "equal": equal, "removed": [m.getMessage() for m in messages if m.getMessage().startswith(
                f"fastpersist: removed {first}, once ")],
            "nemo_removes_again": MegatronStrategy.remove_checkpoint.__module__ == MegatronStrategy.__module__}


def test_tiered_saves_through_nemo_and_its_removal_of_an_older_checkpoint(nemo, tmp_path):
    """enable(local_dir=...): NeMo's checkpoints are tiered, and the removal of an older one by NeMo's strategy goes
    through ours on global rank 0 (after the newer one is durable); disable() gives NeMo its own removal back."""
    first, second = run_ranks(2, _tiered_through_nemo, str(tmp_path))
    for result in (first, second):
        assert not result["first_left"] and result["second"] == "durable" and result["equal"], result
        assert not result["link_left"] and result["nemo_removes_again"], result
    assert len(first["removed"]) == 1 and not second["removed"], (first, second)


def test_disable_gives_nemo_its_own_strategies_back(nemo):
    modules = [importlib.import_module(name) for name in fastpersist_nemo.CHECKPOINT_IO_MODULES]
    names = (*fastpersist_nemo.SAVE_NAMES, *fastpersist_nemo.LOAD_NAMES, compat.WRAPPER_SEAM)
    before = [{name: getattr(module, name, None) for name in names} for module in modules]
    strategy = fastpersist_nemo.enable()
    try:
        pl = modules[0]
        assert pl.get_default_save_sharded_strategy("torch_dist", 1) is strategy
        assert isinstance(strategy, FastPersistSaveStrategy) and strategy.checkpoint_format == "torch_dist"
    finally:
        fastpersist_nemo.disable()
    assert [{name: getattr(module, name, None) for name in names} for module in modules] == before


def test_enable_refuses_a_nemo_whose_checkpoint_io_builds_strategies_otherwise(monkeypatch):
    stand_in = types.ModuleType("nemo_without_the_names")  # e.g. NeMo 3 or a NeMo 2 on megatron-core 0.19
    monkeypatch.setattr(fastpersist_nemo, "_checkpoint_io_module", lambda name: stand_in)
    with pytest.raises(Exception, match="has no get_default_save_sharded_strategy: this NeMo does not build"):
        fastpersist_nemo.enable()
    assert not hasattr(stand_in, "get_default_save_sharded_strategy")
