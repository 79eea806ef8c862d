"""fastpersist_dist.torchtitan: torchtitan's own checkpoint manager saving and resuming through FastPersist.

torchtitan 0.3.0 is the real one (``scripts/setup.sh`` puts it beside the venv; the ``torchtitan_dir`` fixture
appends it to ``sys.path``). Its trainer needs a CUDA device, so its training loop is run here as its
``Trainer.train`` runs it, on CPU ranks over gloo: the checkpoint manager built from its config
(``config.build``, as the trainer builds it), torchtitan's optimizer and LR-scheduler containers around an FSDP2
model, the trainer's ``train_state``, ``checkpointer.load(step)`` first, ``checkpointer.save(step, last_step)``
after every step. A run is resumed by a fresh one, as after a preemption: the state it loads equals the state
saved, and the steps it trains from there are those of the run that was not stopped.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

from fastpersist_dist.format.records import INDEX_FILE
from fastpersist_dist.tools.ranks import run_ranks
from fastpersist_dist.tools.verify import verify_checkpoint
from fastpersist_dist.util.errors import CorruptCheckpointError

from .helpers import flip_bit, fsdp2_mlp, nested_equal, without_adam_steps
from .test_examples import _shown_verbatim, _torchrun

pytestmark = pytest.mark.engine  # torchtitan beside the venv, the venv's torch: run once, on the current stack

STEPS, INTERVAL = 6, 2  # checkpoints at steps 2, 4 and 6 (the last: model only, torchtitan's default)
FULL = StateDictOptions(full_state_dict=True)


class _TrainState:
    """The trainer's own ``train_state`` (``Trainer.state_dict``): its step."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = state_dict["step"]


def _whole(model: nn.Module, optimizers: Any, lr_schedulers: Any, train: _TrainState) -> dict[str, Any]:
    """Collective: the whole training state, on every rank."""
    return {"model": get_model_state_dict(model, options=FULL),
            "optim": get_optimizer_state_dict(model, optimizers.optimizers[0], options=FULL),
            "lr_scheduler": lr_schedulers.state_dict(), "step": train.step}


def _keep(rank: int, root: str, name: str, state: dict[str, Any]) -> None:
    if rank == 0:
        torch.save(state, os.path.join(root, name))


def _run(rank: int, world: int, root: str, manager: str, load_step: int = -1, async_mode: str = "disabled",
         stop_after: int = STEPS) -> int:
    """One torchtitan run on this rank, as ``Trainer.train`` runs it, with ``manager``'s checkpoint manager
    (``ours`` or torchtitan's ``stock``): load, then train and save up to ``stop_after``. Rank 0 keeps the
    whole state right after the load (``loaded.pt``) and after each step (``step-N.pt``). The step it resumed at."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    from fastpersist_dist.torchtitan import FastPersistCheckpointManager

    model = fsdp2_mlp(world)
    optimizers = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})],
        implementation="for-loop").build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=STEPS)
    train = _TrainState()
    kind = FastPersistCheckpointManager if manager == "ours" else CheckpointManager
    checkpointer = kind.Config(enable=True, interval=INTERVAL, async_mode=async_mode).build(
        dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=lr_schedulers,
        states={"train_state": train}, sd_adapter=None, base_folder=root)
    try:
        checkpointer.load(step=load_step)
        resumed = train.step
        _keep(rank, root, "loaded.pt", _whole(model, optimizers, lr_schedulers, train))
        while train.step < stop_after:
            train.step += 1
            torch.manual_seed(1000 * train.step + rank)  # each step's batch, whichever run trains it
            model(torch.randn(4, 24)).pow(2).mean().backward()
            optimizers.step()
            lr_schedulers.step()
            optimizers.zero_grad()
            checkpointer.save(train.step, last_step=train.step == STEPS)
            _keep(rank, root, f"step-{train.step}.pt", _whole(model, optimizers, lr_schedulers, train))
        checkpointer.maybe_wait_for_saving()
    finally:
        checkpointer.close()
    dist.barrier()
    return resumed


def _kept(root: Any, name: str) -> dict[str, Any]:
    return torch.load(os.path.join(root, name), weights_only=False)






@pytest.fixture(scope="module")
def trained(torchtitan_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A torchtitan run of all its steps through our checkpoint manager: ``checkpoint/step-{2,4,6}``."""
    root = str(tmp_path_factory.mktemp("torchtitan"))
    assert run_ranks(2, _run, root, "ours") == [0, 0]
    return root


def test_its_checkpoints_are_ours_and_verify(trained):
    folder = os.path.join(trained, "checkpoint")
    assert sorted(os.listdir(folder)) == ["step-2", "step-4", "step-6"]
    for step in ("step-2", "step-4", "step-6"):
        assert os.path.exists(os.path.join(folder, step, INDEX_FILE)), step
        report = verify_checkpoint(os.path.join(folder, step))
        assert report.ok and report.checksummed and report.bytes_checked > 0, (step, report.problems)


def test_a_resumed_run_loads_the_state_saved_and_trains_on_as_the_run_that_was_not_stopped(trained, tmp_path):
    """A fresh run resumes at step 4 (``load_step``; step 6 is the last step's model-only checkpoint): model,
    optimizer, LR scheduler and train step equal those saved; the steps after equal the first run's."""
    shutil.copytree(os.path.join(trained, "checkpoint"), tmp_path / "checkpoint")
    assert run_ranks(2, _run, str(tmp_path), "ours", 4) == [4, 4]
    assert nested_equal(_kept(tmp_path, "loaded.pt"), _kept(trained, "step-4.pt"))
    assert nested_equal(_kept(tmp_path, "step-6.pt"), _kept(trained, "step-6.pt"))
    assert not nested_equal(_kept(tmp_path, "loaded.pt"), _kept(trained, "step-2.pt"))  # the comparison can fail


def test_a_run_saved_at_2_ranks_resumes_at_4(trained, tmp_path):
    """A restart on more ranks: DCP's planner reshards what torchtitan loads."""
    shutil.copytree(os.path.join(trained, "checkpoint"), tmp_path / "checkpoint")
    assert run_ranks(4, _run, str(tmp_path), "ours", 4, "disabled", 4) == [4] * 4
    assert nested_equal(_kept(tmp_path, "loaded.pt"), _kept(trained, "step-4.pt"))


def _resume_at_4(rank: int, world: int, root: str) -> str:
    try:
        _run(rank, world, root, "ours", 4)
    except BaseException as e:  # noqa: BLE001 - what DCP raised (its CheckpointException is a BaseException)
        return f"{type(e).__name__}: {e}"
    return "resumed"


def test_a_flipped_byte_fails_the_resume_on_every_rank_and_verify(trained, tmp_path):
    shutil.copytree(os.path.join(trained, "checkpoint"), tmp_path / "checkpoint")
    victim = tmp_path / "checkpoint" / "step-4" / "__1_0.distcp"
    flip_bit(str(victim), victim.stat().st_size // 2, 0x10)
    outcomes = run_ranks(2, _resume_at_4, str(tmp_path))
    assert all(CorruptCheckpointError.__name__ in o and "checksum mismatch" in o and str(victim) in o
               for o in outcomes), outcomes
    report = verify_checkpoint(str(tmp_path / "checkpoint" / "step-4"))
    assert any("checksum mismatch" in p and str(victim) in p for p in report.problems), report.problems


def test_async_saves_while_training_goes_on_resume(torchtitan_dir, tmp_path):
    """torchtitan's ``async_mode="async"``: steps 2 and 4 written by DCP's ``async_save`` through our writer while
    the next steps train, waited for before the next save."""
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    first.mkdir()
    run_ranks(2, _run, str(first), "ours", -1, "async", 4)
    assert os.path.exists(first / "checkpoint" / "step-4" / INDEX_FILE)
    shutil.copytree(first / "checkpoint", resumed / "checkpoint")
    assert run_ranks(2, _run, str(resumed), "ours", 4, "async", 4) == [4, 4]
    assert nested_equal(without_adam_steps(_kept(resumed, "loaded.pt")), without_adam_steps(_kept(first, "step-4.pt")))


def test_a_run_checkpointed_by_torchtitans_own_writer_resumes_through_ours(torchtitan_dir, tmp_path):
    """Switching a run to FastPersist: its last checkpoint of torchtitan's own writer (no index of ours) is read
    (unchecked), and its next ones are ours."""
    run_ranks(2, _run, str(tmp_path), "stock", -1, "disabled", 2)
    stock = _kept(tmp_path, "step-2.pt")
    assert not os.path.exists(tmp_path / "checkpoint" / "step-2" / INDEX_FILE)
    assert run_ranks(2, _run, str(tmp_path), "ours", -1, "disabled", 4) == [2, 2]
    assert nested_equal(_kept(tmp_path, "loaded.pt"), stock)
    assert os.path.exists(tmp_path / "checkpoint" / "step-4" / INDEX_FILE)


EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "torchtitan_resume.py"


def test_dcp_doc_shows_the_torchtitan_example_verbatim():
    _shown_verbatim(EXAMPLE, "import os", "docs/dcp.md")


@pytest.mark.slow
def test_torchtitan_example_runs_under_torchrun(torchtitan_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), torchtitan_dir])))
    out = _torchrun(EXAMPLE, tmp_path)
    assert "torchtitan: 2 ranks resumed at step 4, saved ['step-2', 'step-4', 'step-6', 'step-8']; " \
           "verify step-4: OK" in out, out
