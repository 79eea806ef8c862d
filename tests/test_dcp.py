"""torch.distributed.checkpoint through FastPersistWriter and FastPersistReader, with an FSDP2 model as its users
train one: ``fully_shard`` on a CPU device mesh over gloo, its optimizer, ``get_state_dict``/``set_state_dict``.

Saved at one world size and loaded at another (DCP's planners reshard), synchronously and with ``dcp.async_save``
(both of its kinds) while training goes on; loaded back by DCP's own ``FileSystemReader`` too, and a checkpoint of
DCP's ``FileSystemWriter`` by ours; ``verify`` checks ours and finds a flipped byte.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, get_state_dict, set_state_dict)

from fastpersist_dist.dcp import FastPersistReader, FastPersistWriter
from fastpersist_dist.tools.inspect import inspect_checkpoint
from fastpersist_dist.tools.ranks import run_ranks
from fastpersist_dist.tools.verify import verify_checkpoint
from fastpersist_dist.util.errors import CorruptCheckpointError

from .helpers import flip_bit, fsdp2_mlp, nested_equal, without_adam_steps

pytestmark = pytest.mark.stack  # torch DCP: each venv's torch and Python

FULL = StateDictOptions(full_state_dict=True)  # every rank gets it (with cpu_offload only rank 0 does)
STEPS = 3


def _model_and_optimizer(world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A small MLP, each layer and the whole sharded by FSDP2 over every rank, and its Adam."""
    model = fsdp2_mlp(world)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _step(model: nn.Module, optim: torch.optim.Optimizer, seed: int) -> None:
    torch.manual_seed(seed)
    model(torch.randn(4, 24)).pow(2).mean().backward()
    optim.step()
    optim.zero_grad()


def _full(model: nn.Module, optim: torch.optim.Optimizer) -> dict:
    """Collective: the whole model and optimizer state, on every rank."""
    return {"model": get_model_state_dict(model, options=FULL), "optim": get_optimizer_state_dict(model, optim,
                                                                                                  options=FULL)}




def _train_and_save(rank: int, world: int, root: str, how: str) -> None:
    """A few steps, then the save (``how``: ``sync``, DCP's ``thread`` or ``process`` async kind, with steps
    between the call and the wait, or ``stock``: DCP's own writer); rank 0 keeps the whole state at the save."""
    model, optim = _model_and_optimizer(world)
    for i in range(STEPS):
        _step(model, optim, 100 * rank + i)
    expected = _full(model, optim)
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd, "step": STEPS}
    path = os.path.join(root, "ckpt")
    if how in ("sync", "stock"):
        dcp.save(state, storage_writer=FileSystemWriter(path) if how == "stock" else FastPersistWriter(path))
    else:
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        kind = AsyncCheckpointerType.THREAD if how == "thread" else AsyncCheckpointerType.PROCESS
        saving = dcp.async_save(state, storage_writer=FastPersistWriter(path), process_group=dist.new_group(
            backend="gloo"), async_checkpointer_type=kind)
        for i in range(2):  # training goes on while the checkpoint is written
            _step(model, optim, 1000 + i)
        saving.result()
    if rank == 0:
        torch.save(expected, os.path.join(root, "expected.pt"))
    dist.barrier()




def _load(rank: int, world: int, root: str, reader: str, steps: bool = True) -> bool:
    """A fresh model and optimizer at this world size, loaded through ``reader``; whether it equals the state
    saved (but for the optimizer's step counts, where not ``steps``)."""
    model, optim = _model_and_optimizer(world)
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd, "step": 0}
    path = os.path.join(root, "ckpt")
    dcp.load(state, storage_reader=FileSystemReader(path) if reader == "stock" else FastPersistReader(path))
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    expected, loaded = torch.load(os.path.join(root, "expected.pt"), weights_only=False), _full(model, optim)
    if not steps:
        expected, loaded = without_adam_steps(expected), without_adam_steps(loaded)
    return state["step"] == STEPS and nested_equal(loaded, expected)


@pytest.mark.parametrize("saved, loaded", [(4, 2), (2, 4)])
def test_an_fsdp2_model_and_optimizer_saved_at_one_world_size_load_at_another(tmp_path, saved, loaded):
    run_ranks(saved, _train_and_save, str(tmp_path), "sync")
    assert os.path.exists(tmp_path / "ckpt" / "fastpersist_index.json")
    assert run_ranks(loaded, _load, str(tmp_path), "ours") == [True] * loaded
    report = verify_checkpoint(str(tmp_path / "ckpt"))
    assert report.ok and report.bytes_checked > 0, report.problems


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_async_save_of_either_kind_saves_the_state_at_the_call_while_training_goes_on(tmp_path, kind):
    run_ranks(2, _train_and_save, str(tmp_path), kind)
    assert run_ranks(2, _load, str(tmp_path), "ours", False) == [True, True]


def test_ours_loads_with_dcps_reader_and_dcps_with_ours(tmp_path):
    """Interchangeable with DCP's own files: ours read by FileSystemReader; FileSystemWriter's read by ours
    (without checksums: it has no index of ours)."""
    ours, stock = tmp_path / "ours", tmp_path / "stock"
    run_ranks(2, _train_and_save, str(ours), "sync")
    run_ranks(2, _train_and_save, str(stock), "stock")
    assert not os.path.exists(stock / "ckpt" / "fastpersist_index.json")
    assert run_ranks(2, _load, str(ours), "stock") == [True, True]
    assert run_ranks(2, _load, str(stock), "ours") == [True, True]


def test_verify_and_inspect_say_what_they_can_of_dcps_own_files(tmp_path):
    """A FileSystemWriter checkpoint has no checksums: verify checks that each file holds the bytes .metadata places
    there (a cut file is a problem naming it), inspect lists its entries."""
    run_ranks(2, _train_and_save, str(tmp_path), "stock")
    path = str(tmp_path / "ckpt")
    report = verify_checkpoint(path)
    assert report.ok and not report.checksummed and report.tensors > 0 and report.bytes_checked == 0, report
    shown = inspect_checkpoint(path)
    assert shown.ok and shown.format == "torch DCP" and {"model.0.weight", "step"} <= {e.key for e in shown.entries}
    victim = tmp_path / "ckpt" / "__1_0.distcp"
    os.truncate(victim, victim.stat().st_size // 2)
    assert any(str(victim) in p for p in verify_checkpoint(path).problems)


def _load_one(rank: int, world: int, root: str) -> str:
    try:
        _load(rank, world, root, "ours")
    except BaseException as e:  # noqa: BLE001 - what DCP raised (its CheckpointException is a BaseException)
        return f"{type(e).__name__}: {e}"
    return "loaded"


def test_a_flipped_byte_is_found_by_the_load_and_by_verify(tmp_path):
    run_ranks(2, _train_and_save, str(tmp_path), "sync")
    victim = tmp_path / "ckpt" / "__1_0.distcp"
    flip_bit(str(victim), victim.stat().st_size // 2, 0x10)
    outcomes = run_ranks(2, _load_one, str(tmp_path))
    assert all(CorruptCheckpointError.__name__ in o and "checksum mismatch" in o and str(victim) in o
               for o in outcomes), outcomes
    report = verify_checkpoint(str(tmp_path / "ckpt"))
    assert any("checksum mismatch" in p and str(victim) in p for p in report.problems), report.problems
