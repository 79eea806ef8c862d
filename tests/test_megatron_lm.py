"""fastpersist_dist.megatron_lm: Megatron-LM's own checkpointing through FastPersist.

Two levels:

* ``test_enable_*`` (always, on the installed megatron-core): ``enable()`` replaces exactly the
  two names Megatron-LM's checkpointing.py builds its strategies with, in a module that imports
  them from megatron-core as checkpointing.py does; the strategies they then build save through
  megatron's ``save()`` inside ``FullyParallelSaveStrategyWrapper`` (Megatron-LM's default) into
  our format, load back, and ``disable()`` restores megatron's own.
* ``test_megatron_lm_training_*``: Megatron-LM's training code itself (tests/megatron_lm_driver.py:
  its parser, ``setup_model_and_optimizer`` with ``load_checkpoint``, ``save_checkpoint`` every
  2 steps, ``--async-save`` through its persistent ``AsyncCallsQueue`` worker, a resume), 2 ranks
  on gloo (TP=1 x DP=2). megatron-core 0.17.1, 0.18.2 and 0.19.2's wheels ship ``megatron.training``
  (0.17/0.18's needs pyyaml, in the test extras); for 0.16.1 set
  ``FASTPERSIST_MEGATRON_LM`` to a Megatron-LM checkout at ``core_v0.16.1`` (its training code
  also needs six, regex, pyyaml and triton importable). Skipped, saying so, where neither is there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Optional

import pytest
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies import torch as mcore_torch_strategies
from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

from fastpersist_dist import (
    FastPersistLoadStrategy,
    FastPersistSaveStrategy,
    TierConfig,
    checkpoint_state,
    compat,
    prepare_checkpoint_dir,
)
from fastpersist_dist.format.records import INDEX_FILE, is_data_file
from fastpersist_dist.format.tiers import local_copy_dir
from fastpersist_dist.integrations import megatron_lm
from fastpersist_dist.tools.bench.baselines import torch_dist_cpu_shims
from fastpersist_dist.tools.inspect import inspect_checkpoint
from fastpersist_dist.tools.ranks import run_ranks, serve_store
from fastpersist_dist.tools.verify import verify_checkpoint
from fastpersist_dist.util.errors import FastPersistError

from .helpers import rows_and_replica
from .nodes import on_node

pytestmark = pytest.mark.contract

REPO = Path(__file__).resolve().parent.parent
DRIVER = REPO / "tests" / "megatron_lm_driver.py"
SAVE_SEAM, LOAD_SEAM = compat.TRAINING_STRATEGY_SEAMS


def _as_megatron_lm_imports_them() -> types.ModuleType:
    """A module holding the two seams and the fully-parallel wrapper as checkpointing.py imports them."""
    from megatron.core.dist_checkpointing import serialization

    module = types.ModuleType("checkpointing_seams")
    for name in compat.TRAINING_STRATEGY_SEAMS:
        source = serialization if hasattr(serialization, name) else mcore_torch_strategies
        setattr(module, name, getattr(source, name))
    setattr(module, compat.WRAPPER_SEAM, FullyParallelSaveStrategyWrapper)
    return module


def _state(rank: int, world: int, empty: bool) -> dict:
    return rows_and_replica("mlm", rank, world, empty)


def _save_and_load_through_seams(rank: int, world: int, path: str, checkpoint_format: str) -> dict:
    module = _as_megatron_lm_imports_them()
    originals = {name: getattr(module, name) for name in (*compat.TRAINING_STRATEGY_SEAMS, compat.WRAPPER_SEAM)}
    returned = megatron_lm.enable(checkpoint_format, target=module)
    try:
        built = getattr(module, SAVE_SEAM)("torch_dist")  # Megatron-LM's arguments are ignored
        assert built is returned and isinstance(built, FastPersistSaveStrategy)
        assert built.checkpoint_format == checkpoint_format
        assert getattr(module, SAVE_SEAM)() is built  # one instance: its plan and buffers last the run
        prepare_checkpoint_dir(path)
        # What Megatron-LM does by default (fully-parallel save): its wrapper around the strategy, built by name.
        wrapper = getattr(module, compat.WRAPPER_SEAM)(built, dist.group.WORLD, False)
        assert isinstance(wrapper, FullyParallelSaveStrategyWrapper) and wrapper.base_strategy is built
        dist_checkpointing.save(_state(rank, world, empty=False), path, wrapper)
        loader = getattr(module, LOAD_SEAM)(path)
        assert isinstance(loader, FastPersistLoadStrategy)
        loaded = dist_checkpointing.load(_state(rank, world, empty=True), path, loader)
        expected = _state(rank, world, empty=False)
        assert all(torch.equal(loaded[k], expected[k].data) for k in expected)
    finally:
        megatron_lm.disable()
    assert {name: getattr(module, name) for name in originals} == originals
    return {"files": sorted(os.listdir(path))}


@pytest.mark.parametrize("checkpoint_format", ["torch_dist", "fastpersist"])
def test_enable_replaces_megatron_lm_strategy_seams_and_saves_our_format(tmp_path, checkpoint_format):
    path = str(tmp_path / "iter_0000001")
    results = run_ranks(2, _save_and_load_through_seams, path, checkpoint_format)
    files = results[0]["files"]
    data = {"torch_dist": ".metadata", "fastpersist": "fastpersist_r00000.bin"}[checkpoint_format]
    assert {INDEX_FILE, data, "metadata.json"} <= set(files), files
    with open(os.path.join(path, "metadata.json")) as f:
        # torch_dist: any Megatron-LM loads it; fastpersist: megatron-core 0.16's load() picks our loader by it
        # (megatron-core 0.17+'s own wrapper would have written "torch_dist" whatever it wrapped)
        assert json.load(f)["sharded_backend"] == checkpoint_format
    report = verify_checkpoint(path)
    assert report.ok, report.problems


def _enable_with_argv(rank: int, world: int) -> list:
    """Whether this rank's writer process runs after enable(), without and then with --async-save in sys.argv."""
    from fastpersist_dist.engine.writer_process import writer_client

    running = []
    for argv in (["pretrain_gpt.py", "--save", "/ckpt"], ["pretrain_gpt.py", "--save", "/ckpt", "--async-save"]):
        sys.argv = argv
        megatron_lm.enable(target=_as_megatron_lm_imports_them())
        megatron_lm.disable()
        running.append(writer_client().pid is not None)
    return running


def test_enable_starts_the_writer_process_ahead_only_for_async_save():
    assert run_ranks(1, _enable_with_argv) == [[False, True]]


def _as_megatron_lm_async_utils_imports_it() -> types.ModuleType:
    """A module holding the async queue seam as Megatron-LM's async_utils.py imports it from megatron-core."""
    from megatron.core.dist_checkpointing.strategies import async_utils

    module = types.ModuleType("async_utils_seams")
    seam = compat.MEGATRON_LM_ASYNC_SEAM
    setattr(module, seam, getattr(async_utils if hasattr(async_utils, seam) else mcore_torch_strategies, seam))
    return module


def _megatron_lm_queue(module: types.ModuleType) -> object:
    """The --async-save queue, made as the Megatron-LM of this megatron-core makes it."""
    if compat.MEGATRON_LM_ASYNC_SEAM == "get_async_strategy":  # 0.17+: the class its get_async_strategy answers
        return module.get_async_strategy("mcore")[1]["AsyncCallsQueue"](persistent=False)
    return module.AsyncCallsQueue()


def _async_saves_through_the_queue(rank: int, world: int, ours: str, theirs: str) -> dict:
    from fastpersist_dist.integrations.megatron_lm_queue import MegatronLMQueue

    module = _as_megatron_lm_async_utils_imports_it()
    original = getattr(module, compat.MEGATRON_LM_ASYNC_SEAM)
    megatron_lm.enable(target=_as_megatron_lm_imports_them(), async_target=module)
    try:
        queue = _megatron_lm_queue(module)
        assert isinstance(queue, MegatronLMQueue)
        out = {}
        for path, strategy in ((ours, FastPersistSaveStrategy("torch_dist")),
                               (theirs, mcore_torch_strategies.TorchDistSaveShardedStrategy("torch_dist", 1))):
            prepare_checkpoint_dir(path)
            with torch_dist_cpu_shims():
                request = dist_checkpointing.save(_state(rank, world, empty=False), path, strategy,
                                                  async_sharded_save=True, **compat.ASYNC_SAVE_KWARGS)
                queue.schedule_async_request(request)
                out[path] = queue._theirs is not None  # whether megatron's queue (a forked caller) was needed
                queue.maybe_finalize_async_calls(blocking=True)
            loaded = dist_checkpointing.load(_state(rank, world, empty=True), path)
            expected = _state(rank, world, empty=False)
            assert all(torch.equal(loaded[k], expected[k].data) for k in expected)
        assert queue.get_num_unfinalized_calls() == 0
        queue.close()
    finally:
        megatron_lm.disable()
    assert getattr(module, compat.MEGATRON_LM_ASYNC_SEAM) is original
    return out


def test_enable_gives_megatron_lm_async_save_our_queue_and_megatrons_for_the_rest(tmp_path):
    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "megatrons")
    for got in run_ranks(2, _async_saves_through_the_queue, ours, theirs):
        assert got == {ours: False, theirs: True}  # ours waited for in a thread; megatron's own on its queue
    assert verify_checkpoint(ours).ok


def test_local_checkpoint_flags_translate_onto_tiers():
    plain = ["--save", "/ckpt", "--non-persistent-ckpt-type", "global"]
    assert megatron_lm.translate_local_flags(plain) == megatron_lm.LocalCheckpointFlags(plain, None)
    flags = megatron_lm.translate_local_flags(
        ["--save=/ckpt", "--non-persistent-ckpt-type=local", "--non-persistent-local-ckpt-dir", "/nvme/ckpt",
         "--replication", "--replication-jump", "8", "--replication-factor=3", "--non-persistent-local-ckpt-algo",
         "atomic", "--lr", "1e-3"])
    assert flags.argv == ["--save=/ckpt", "--lr", "1e-3", "--non-persistent-ckpt-type", "global"]
    assert flags.tiers is not None and (flags.tiers.local_dir, flags.tiers.replicas) == ("/nvme/ckpt", 2)
    assert flags.tiers.local_only_under == "/ckpt/non_persistent"
    assert not flags.tiers.for_checkpoint("/ckpt/non_persistent/iter_0000010").persistent
    assert flags.tiers.for_checkpoint("/ckpt/iter_0000010").persistent
    assert flags.tiers.for_checkpoint("/ckpt/non_persistent_old/iter_0000010").persistent
    unreplicated = megatron_lm.translate_local_flags(["--non-persistent-ckpt-type", "local",
                                                      "--non-persistent-local-ckpt-dir", "/nvme",
                                                      "--non-persistent-global-ckpt-dir", "/np"])
    assert unreplicated.tiers is not None and unreplicated.tiers.replicas == 0
    assert unreplicated.tiers.local_only_under == "/np"
    with pytest.raises(FastPersistError, match="needs --non-persistent-local-ckpt-dir"):
        megatron_lm.translate_local_flags(["--non-persistent-ckpt-type", "local"])


def test_the_runners_own_flags_set_what_megatron_lm_has_no_flag_for():
    """``--fastpersist-*``: TierConfig's knobs that Megatron-LM has no flag for, taken out of its arguments;
    refused without local checkpoints, and where TierConfig refuses them (naming the flags)."""
    local = ["--save", "/ckpt", "--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir", "/nvme"]
    default = TierConfig("/nvme", local_only_under="/ckpt/non_persistent")
    assert megatron_lm.translate_local_flags(local).tiers == default
    flags = megatron_lm.translate_local_flags([*local, "--fastpersist-keep-local=3"])
    assert flags.argv == ["--save", "/ckpt", "--non-persistent-ckpt-type", "global"]
    assert flags.tiers is not None and flags.tiers.keep_local == 3
    assert megatron_lm.translate_local_flags([*local, "--fastpersist-keep-local", "1"]).tiers.keep_local == 1
    with pytest.raises(FastPersistError, match="--fastpersist-keep-local: settings of local checkpoints, which "
                                               "need --non-persistent-ckpt-type local"):
        megatron_lm.translate_local_flags(["--save", "/ckpt", "--fastpersist-keep-local", "2"])
    with pytest.raises(FastPersistError, match="--fastpersist-keep-local: keep_local must be >= 1, got 0"):
        megatron_lm.translate_local_flags([*local, "--fastpersist-keep-local", "0"])


def test_enable_refuses_a_module_without_the_seams():
    with pytest.raises(Exception, match=f"has no {SAVE_SEAM}"):
        megatron_lm.enable(target=types.ModuleType("not_megatron_lm"))


# --- Megatron-LM's own training code ---------------------------------------------------------

TINY_GPT = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
    "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
    "--train-iters", "4", "--save-interval", "2", "--lr", "1e-3", "--min-lr", "1e-4", "--clip-grad", "0",
    "--vocab-size", "128", "--tokenizer-type", "NullTokenizer", "--mock-data", "--transformer-impl", "local",
    "--no-persist-layer-norm", "--no-gradient-accumulation-fusion", "--use-cpu-initialization",
    "--distributed-backend", "gloo", "--ckpt-format", "torch_dist",
]
# megatron-core 0.17+: Megatron-LM's --async-save defaults to the nvrx queue (nvidia-resiliency-ext).
ASYNC = ["--async-save", "--use-persistent-ckpt-worker"] + (
    ["--async-strategy", compat.ASYNC_SAVE_KWARGS["async_strategy"]] if compat.ASYNC_SAVE_KWARGS else [])


def _run(phase: str, ckpt: Path, extra: list[str], launcher: list[str], env: dict, world: int = 2,
         nodes: Optional[tuple[list[str], str]] = None, save: Optional[str] = None) -> list[dict]:
    """Run the driver on ``world`` ranks; every rank's RESULT line, or the failure with its log tail.

    ``env``: the training environment (the ``megatron_lm_env`` fixture) plus the test's variables.
    ``nodes``: (node directories, local path): rank r is node r, seeing directory r at the local path.
    ``save``: Megatron-LM's ``--save`` and ``--load`` (default ``ckpt``, where the driver keeps what it expects).
    """
    where = save or str(ckpt)
    argv = [*launcher, str(DRIVER), phase, str(ckpt), *TINY_GPT, "--save", where, "--load", where, *extra]
    with serve_store(world) as store:  # the ranks join it as torchrun's do
        env = {**env, **store}
        ranks = [{"RANK": str(r), "LOCAL_RANK": str(r)} for r in range(world)]
        commands = [argv] * world
        if nodes is not None:
            ranks = [{"RANK": str(r), "LOCAL_RANK": "0", "GROUP_RANK": str(r), "LOCAL_WORLD_SIZE": "1"}
                     for r in range(world)]
            commands = [on_node(nodes[0][r], nodes[1], argv) for r in range(world)]
        procs = [subprocess.Popen(commands[r], env={**env, **ranks[r]}, cwd=str(REPO), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for r in range(world)]
        outputs = []
        for p in procs:
            try:
                outputs.append(p.communicate(timeout=540)[0])
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise
    for r, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {r} of {phase} exited {p.returncode}:\n{out[-6000:]}"
    return [json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:]) for out in outputs]


def _check_run(ckpt: Path, train: list[dict], resume: list[dict], wrapper: str) -> None:
    for result in train:
        assert result["saved"] == [2, 4]
        assert result["save_strategy"] == [wrapper, "FastPersistSaveStrategy"]
    for result in resume:
        assert result["load_strategy"] == "FastPersistLoadStrategy"
        assert result["iteration"] == result["expected_iteration"] == 4
        assert result["mismatched"] == [] and result["params"] > 20
        assert result["optim_compared"] >= 2 * result["params"] and result["optim_equal"] is True
        assert result["num_steps"] == 4 * 4  # the scheduler's samples, restored
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "5"
    for iteration in (2, 4, 5):
        directory = ckpt / f"iter_{iteration:07d}"
        assert (directory / INDEX_FILE).exists() and (directory / "metadata.json").exists()
        report = verify_checkpoint(str(directory))
        assert report.ok, report.problems


@pytest.mark.slow
def test_megatron_lm_training_sync_saves_and_resume(megatron_lm_env, tmp_path):
    """enable() in the launcher; Megatron-LM's default fully-parallel save wrapper around ours.

    The native format here; the runner's test below saves the torch_dist format (``enable()``'s default).
    """
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    # the driver calls megatron_lm.enable(FASTPERSIST_FORMAT) first
    enable = {**megatron_lm_env, "FASTPERSIST_ENABLE": "1", "FASTPERSIST_FORMAT": "fastpersist"}
    train = _run("train", ckpt, [], [sys.executable], enable)
    resume = _run("resume", ckpt, [], [sys.executable], enable)
    # Megatron-LM's fully-parallel wrapper, built by the name enable() replaced (megatron's own class on 0.16)
    _check_run(ckpt, train, resume, compat.FullyParallelSaveWrapper.__name__)
    assert not any(r["writer_before_first_save"] for r in train + resume)  # no writer process for sync saves


@pytest.mark.slow
def test_megatron_lm_training_async_through_the_runner(megatron_lm_env, tmp_path):
    """``python -m fastpersist_dist.megatron_lm SCRIPT``; --async-save on Megatron-LM's persistent worker, no wrapper.

    (TP > 1 does not get past Megatron-LM's validate_args on a CPU: it reads the GPU architecture.)
    """
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    launcher = [sys.executable, "-m", "fastpersist_dist.megatron_lm"]
    extra = ["--no-ckpt-fully-parallel-save", *ASYNC]
    train = _run("train", ckpt, extra, launcher, megatron_lm_env)
    resume = _run("resume", ckpt, extra, launcher, megatron_lm_env)
    _check_run(ckpt, train, resume, "FastPersistSaveStrategy")
    # The runner started each rank's writer before Megatron-LM built its model, not in the first save.
    assert all(r["writer_before_first_save"] for r in train + resume)
    assert all(r["async_queue_ours"] for r in train), train  # --async-save ran on our queue


@pytest.mark.slow
def test_megatron_lm_local_checkpoint_flags_through_the_runner(megatron_lm_env, tmp_path, root):
    """Megatron-LM's own flags for node-local checkpoints, through the runner, each rank a node with its own local
    tier (tests/nodes.py): its persistent saves become durable in --save, its non-persistent ones stay on the
    local tiers, replicated; the resume reads the newest (a non-persistent one) from the local tiers."""
    ckpt, local = tmp_path / "ckpt", tmp_path / "local-tier"
    node_dirs = [tmp_path / f"node{n}" for n in range(2)]
    for d in (ckpt, local, *node_dirs):
        d.mkdir()
    launcher = [sys.executable, "-m", "fastpersist_dist.megatron_lm"]
    extra = ["--train-iters", "5", "--non-persistent-save-interval", "1", "--non-persistent-ckpt-type", "local",
             "--non-persistent-local-ckpt-dir", str(local), "--replication", "--replication-jump", "1",
             "--replication-factor", "2"]
    nodes = ([str(d) for d in node_dirs], str(local))
    train = _run("train", ckpt, extra, launcher, megatron_lm_env, nodes=nodes)
    assert all(r["saved"] == [1, 2, 3, 4, 5] for r in train), train
    non_persistent = ckpt / megatron_lm.NON_PERSISTENT_SUBDIR / "iter_0000005"
    assert [checkpoint_state(str(ckpt / f"iter_{i:07d}")) for i in (2, 4)] == ["durable", "durable"]
    report = inspect_checkpoint(str(non_persistent))
    assert report.ok and report.tiers is not None, report.problems
    assert (report.tiers.state, report.tiers.persistent, report.tiers.replica_nodes) == ("replicated", False,
                                                                                       [[1], [0]]), report.tiers
    assert not [n for n in os.listdir(non_persistent) if is_data_file(n)]  # its data: on the local tiers only
    for node_dir in node_dirs:  # each node: its own file of the newest checkpoint and the other node's replica
        copy = Path(node_dir) / os.path.relpath(local_copy_dir(str(local), str(non_persistent)), local)
        assert len([n for n in os.listdir(copy) if is_data_file(n)]) == 2, os.listdir(copy)
    resume = _run("resume", ckpt, extra, launcher, megatron_lm_env, nodes=nodes)
    for result in resume:
        assert result["iteration"] == result["expected_iteration"] == 5
        assert result["mismatched"] == [] and result["optim_equal"] is True
    assert checkpoint_state(str(ckpt / "iter_0000006")) == "durable"
