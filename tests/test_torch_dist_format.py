"""The ``torch_dist`` format: DCP files written through our engine, read by megatron's and torch's own loaders.

Runs on whichever megatron-core the venv has (0.16.1 or 0.19.2): on 0.17+ it
is the default format and ``save()`` must keep our strategy; on 0.16 it is
chosen with ``checkpoint_format="torch_dist"``. megatron's own loader is named
where it is meant (``stock_loader``): a plain ``load()`` uses ours.
"""

from __future__ import annotations

import importlib
import json
import os
import pickle
import sys
import shutil
import signal

import pytest
import torch
import torch.distributed.checkpoint as dcp
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

from fastpersist_dist import FastPersistLoadStrategy, FastPersistSaveStrategy, compat
from fastpersist_dist.bench.baselines import torch_dist_cpu_shims
from fastpersist_dist.checkpoint_formats import DCP_METADATA_FILE, TORCH_DIST
from fastpersist_dist.errors import CorruptCheckpointError, IncompleteCheckpointError, SaveFailedError
from fastpersist_dist.commit import read_index
from fastpersist_dist.format import COMMON_FILE, INDEX_FILE, aux_copy_name
from fastpersist_dist.index_pages import part_file_name
from fastpersist_dist.verify import verify_checkpoint

from .helpers import (COMMON_STATE_OBJECT, NVRX_DIR, assert_same, empty_like_request, flip_bit, global_tensor, make_dir,
                      megatron_queue, save, sharded, stock_loader)
from .multiproc import run_ranks
from .test_faults import KILL_AT, KILLABLE, _die_at_file_size, _save_error, run_faulty

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool]
SPLITS = {"rows": 0, "cols": 1, "grid": "grid", "replicated": None}


def _tensor(key: str, shape: tuple[int, ...], dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    if dtype.is_floating_point and dtype.itemsize == 1:  # float8: from float32, finite values
        return global_tensor(key, shape, torch.float32, salt).clamp(-200, 200).to(dtype)
    return global_tensor(key, shape, dtype, salt)


def state(rank: int, world: int, salt: int = 0) -> dict:
    """Tensors of every dtype and sharding, objects, and plain common values; the same for any world."""
    sd: dict = {}
    for dtype in DTYPES:
        name = str(dtype).split(".")[1]
        for split_name, split in SPLITS.items():
            if split == "grid" and world % 2:
                split = 0
            key = f"{name}.{split_name}"
            sd[key] = sharded(key, _tensor(key, (8, 12, 3), dtype, salt), rank, world, split)
    sd["obj"] = ShardedObject("obj", {"salt": salt, "ids": [1, 2]}, (1,), (0,), replica_id=rank)
    sd["common"] = {"step": 100 + salt, "lr": 0.5}
    return sd


def template(rank: int, world: int) -> dict:
    """A request for :func:`state` whose tensors hold garbage and whose objects hold nothing."""
    out = {}
    for k, v in state(rank, world).items():
        if isinstance(v, ShardedTensor):
            out[k] = empty_like_request(v)
        elif isinstance(v, ShardedObject):
            out[k] = ShardedObject(v.key, None, v.global_shape, v.global_offset, v.replica_id)
    return out


def check(loaded: dict, rank: int, world: int, salt: int = 0, common: bool = True) -> int:
    want = state(rank, world, salt)
    for k, v in want.items():
        if isinstance(v, ShardedTensor):
            assert_same(loaded[k], v.data, k)
    assert loaded["obj"] == {"salt": salt, "ids": [1, 2]}, loaded["obj"]
    if common:
        assert loaded["common"] == {"step": 100 + salt, "lr": 0.5}, loaded.get("common")
    return len(want)


def strategy(**kw) -> FastPersistSaveStrategy:
    return FastPersistSaveStrategy("torch_dist", **kw)


def _save(rank: int, world: int, path: str, salt: int = 0) -> None:
    save(state(rank, world, salt), path, strategy=strategy())


def _load_stock(rank: int, world: int, path: str, salt: int = 0) -> int:
    return check(dist_checkpointing.load(template(rank, world), path, sharded_strategy=stock_loader()), rank, world, salt)


def _load_plain(rank: int, world: int, path: str, salt: int = 0) -> int:
    """``load()`` with no strategy: ours on every stack (``registry``)."""
    return check(dist_checkpointing.load(template(rank, world), path), rank, world, salt)


def _load_ours(rank: int, world: int, path: str, salt: int = 0) -> int:
    loaded = dist_checkpointing.load(template(rank, world), path, sharded_strategy=FastPersistLoadStrategy())
    return check(loaded, rank, world, salt)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("dcp") / "ckpt")
    run_ranks(2, _save, path)
    return path


def test_files_are_torch_dcp_with_our_sidecar(saved):
    names = sorted(os.listdir(saved))
    # megatron <= 0.18's save() writes common.pt (we commit it and a copy); 0.19 keeps the common state in DCP
    common = [] if COMMON_STATE_OBJECT else [COMMON_FILE, aux_copy_name(COMMON_FILE)]
    assert names == sorted([DCP_METADATA_FILE, "__0_0.distcp", "__1_0.distcp", INDEX_FILE, part_file_name(0),
                            "metadata.json", *common])
    with open(os.path.join(saved, "metadata.json")) as f:
        doc = json.load(f)
    assert (doc["sharded_backend"], doc["sharded_backend_version"]) == ("torch_dist", 1), doc
    with open(os.path.join(saved, INDEX_FILE)) as f:
        body = json.load(f)["body"]
    assert (body["format_version"], body["container"]) == (3, "torch_save")


@pytest.mark.parametrize("world", [1, 2, 4])
def test_megatron_stock_loader_reads_it_in_any_sharding(saved, world):
    assert min(run_ranks(world, _load_stock, saved)) > 40


@pytest.mark.parametrize("world", [1, 2])
def test_plain_load_reads_it(saved, world):
    assert min(run_ranks(world, _load_plain, saved)) > 40


@pytest.mark.parametrize("world", [1, 4])
def test_our_loader_reads_it_verified(saved, world):
    assert min(run_ranks(world, _load_ours, saved)) > 40


def test_torch_dcp_load_reads_it(saved):
    want = state(0, 1)
    tensors = {k: torch.zeros_like(v.data) for k, v in want.items() if isinstance(v, ShardedTensor)}
    dcp.load(tensors, checkpoint_id=saved, no_dist=True)
    for k, t in tensors.items():
        assert_same(t, want[k].data, k)


class _TensorPropertiesUpTo214:
    """torch <= 2.14's ``TensorProperties.__setstate__``: exactly five fields (2.15 added ``strides``)."""

    def __setstate__(self, state: tuple) -> None:
        self.dtype, self.layout, self.requires_grad, _memory_format, self.pin_memory = state


class _UnpicklerUpTo214(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) == ("torch.distributed.checkpoint.metadata", "TensorProperties"):
            return _TensorPropertiesUpTo214
        return super().find_class(module, name)


def test_dcp_metadata_reads_on_older_torch_whichever_torch_wrote_it(saved):
    """A checkpoint written on torch 2.15 loads on 2.13 and 2.14 (tests/cross_stack.py across venvs checks it whole)."""
    with open(os.path.join(saved, DCP_METADATA_FILE), "rb") as f:
        metadata = _UnpicklerUpTo214(f).load()
    dtypes = {k: md.properties.dtype for k, md in metadata.state_dict_metadata.items() if hasattr(md, "properties")}
    assert dtypes and dtypes == {k: v.data.dtype for k, v in state(0, 1).items() if isinstance(v, ShardedTensor)}


def test_verify_and_inspect_know_the_format(saved, tmp_path):
    report = verify_checkpoint(saved)
    assert report.ok and report.bytes_checked > 0, report.problems
    path = str(tmp_path / "flipped")
    shutil.copytree(saved, path)
    rec = next(r for r in read_index(path, "test").records if r.key == "float32.rows" and r.file == "__1_0.distcp")
    at = rec.offset + rec.data_offset + 5  # one byte of tensor data
    flip_bit(os.path.join(path, "__1_0.distcp"), at, 0x10)
    problems = verify_checkpoint(path).problems
    assert any("checksum mismatch" in p and "__1_0.distcp" in p and "float32.rows" in p for p in problems), problems
    with pytest.raises(AssertionError, match="CorruptCheckpointError: .*checksum mismatch"):
        run_ranks(1, _load_ours, path)
    with pytest.raises(AssertionError, match="CorruptCheckpointError: .*checksum mismatch"):
        run_ranks(1, _load_plain, path)  # ours by default too (before: megatron's, checking nothing)
    proc_out = run_ranks(1, _inspect, saved)[0]
    assert "format: torch_dist" in proc_out and "PROBLEM" not in proc_out, proc_out


def _inspect(rank: int, world: int, path: str) -> str:
    from fastpersist_dist.inspect_ckpt import format_report, inspect_checkpoint

    return format_report(inspect_checkpoint(path))


def test_gpt_model_saved_at_tp2_loads_at_tp1_with_the_stock_loader(tmp_path):
    from .test_gpt_model import _load_model, _save_model

    path = str(tmp_path / "gpt")
    run_ranks(2, _save_model, path, strategy())
    assert run_ranks(1, _load_model, path, stock_loader)[0] > 20


def _overwrite_and_die(rank: int, world: int, root: str, victim: int):
    _save(rank, world, f"{root}/ckpt", salt=1)
    big = {"w": sharded("w", global_tensor("w", (2048, 4096)), rank, world, 0)}
    save(big, f"{root}/ckpt", strategy=strategy())  # 16 MiB per rank: old data files larger than KILL_AT
    if rank == victim:
        _die_at_file_size(KILL_AT)
    big = {"w": sharded("w", global_tensor("w", (2048, 4096), salt=2), rank, world, 0)}
    return _save_error(lambda: save(big, f"{root}/ckpt", strategy=strategy(**KILLABLE)))


def _refused_by_every_loader(rank: int, world: int, path: str) -> list[str]:
    req = {"w": sharded("w", torch.zeros(2048, 4096), rank, world, 0)}
    messages = []
    with pytest.raises(IncompleteCheckpointError) as ours:
        FastPersistLoadStrategy().load(req, path)
    messages.append(str(ours.value))
    with pytest.raises(BaseException) as stock:  # torch DCP's CheckpointException is a BaseException
        dist_checkpointing.load(req, path, sharded_strategy=stock_loader())
    messages.append(f"{type(stock.value).__name__}: {stock.value}")
    with pytest.raises(BaseException) as plain:
        dist_checkpointing.load(req, path)
    messages.append(f"{type(plain.value).__name__}: {plain.value}")
    return messages


def test_resave_killed_half_way_is_refused_by_every_loader(tmp_path):
    root = str(tmp_path)
    outcomes = run_faulty(2, _overwrite_and_die, root, 1)
    assert outcomes[1].kind == "killed" and outcomes[1].value == signal.SIGKILL, outcomes[1]
    assert outcomes[0].kind == "ok" and outcomes[0].value.kind == "SaveFailedError", outcomes[0]
    ckpt = f"{root}/ckpt"
    # rank 0 wrote its new file, rank 1 died half-way: the old .metadata would mix old and new data.
    assert os.path.exists(os.path.join(ckpt, "metadata.json")) and not os.path.exists(os.path.join(ckpt, DCP_METADATA_FILE))
    ours, stock, plain = run_ranks(2, _refused_by_every_loader, ckpt)[0]
    assert "this torch_dist checkpoint is incomplete" in ours or "is incomplete" in ours, ours
    assert DCP_METADATA_FILE in stock or "metadata" in stock.lower(), stock
    # megatron-core 0.19 reads the common state through DCP before asking the loader: its own error, as stock's
    assert "is incomplete" in plain or DCP_METADATA_FILE in plain, plain
    assert any("incomplete" in p for p in verify_checkpoint(ckpt).problems)


def _stock_over_ours(rank: int, world: int, path: str) -> str:
    with torch_dist_cpu_shims():
        dist_checkpointing.save(state(rank, world, salt=3), path,
                                sharded_strategy=("torch_dist", 1))  # megatron's own writer on either stack
    with pytest.raises(CorruptCheckpointError) as info:
        FastPersistLoadStrategy().load(template(rank, world), path)
    return str(info.value)


def test_stock_resave_over_our_checkpoint_is_not_read_through_the_stale_sidecar(saved, tmp_path):
    path = str(tmp_path / "ckpt")
    shutil.copytree(saved, path)
    for message in run_ranks(2, _stock_over_ours, path):
        assert "is not the one committed with" in message and f"remove {INDEX_FILE}" in message, message
    os.unlink(os.path.join(path, INDEX_FILE))  # as the message says: now megatron's own checkpoint, loaded by it
    run_ranks(2, _load_ours, path, 3)


def _fully_parallel(rank: int, world: int, path: str) -> int:
    wrapper = FullyParallelSaveStrategyWrapper(strategy())
    make_dir(path)
    dist_checkpointing.save(state(rank, world), path, sharded_strategy=wrapper)
    return _load_stock(rank, world, path)


def test_megatron_fully_parallel_wrapper_around_our_strategy(tmp_path):
    assert min(run_ranks(2, _fully_parallel, str(tmp_path / "fp"))) > 40


def _async_with_megatron_queue(rank: int, world: int, path: str, queue_name: str) -> int:
    if queue_name == "nvrx":
        sys.path.insert(0, NVRX_DIR)
    queue = megatron_queue(queue_name)
    sd = state(rank, world)
    before = {k: v.data.clone() for k, v in sd.items() if isinstance(v, ShardedTensor)}
    make_dir(path)
    with torch_dist_cpu_shims():
        request = dist_checkpointing.save(sd, path, sharded_strategy=strategy(), async_sharded_save=True,
                                          async_strategy=queue_name)
        for k in before:
            sd[k].data.zero_() if sd[k].data.dtype != torch.bool else sd[k].data.logical_not_()  # training goes on
        queue.schedule_async_request(request)
        assert not os.path.exists(os.path.join(path, "metadata.json"))  # only finalize writes it
        queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
        queue.close()
    return _load_stock(rank, world, path)


@pytest.mark.skipif(compat.REGISTRY, reason="megatron-core 0.16 has no get_async_strategy; its queue is tested in test_async")
def test_async_save_runs_on_megatrons_mcore_queue(tmp_path):
    assert min(run_ranks(2, _async_with_megatron_queue, str(tmp_path / "a"), "mcore")) > 40


@pytest.mark.skipif(compat.REGISTRY, reason="megatron-core 0.16 has no get_async_strategy")
def test_async_save_runs_on_nvidia_resiliency_ext_queue(tmp_path):
    """megatron-core 0.17+'s default async queue, from nvidia-resiliency-ext (installed by setup.sh)."""
    if not os.path.isdir(os.path.join(NVRX_DIR, "nvidia_resiliency_ext")):
        pytest.skip(f"nvidia-resiliency-ext not in {NVRX_DIR} (FASTPERSIST_STACK=mcore-0.19 scripts/setup.sh puts it there)")
    assert min(run_ranks(2, _async_with_megatron_queue, str(tmp_path / "a"), "nvrx")) > 40


def _nvrx_without_package(rank: int, world: int, path: str) -> str:
    _save(rank, world, path, salt=4)
    with pytest.raises(SaveFailedError) as info:
        dist_checkpointing.save(state(rank, world), path, sharded_strategy=strategy(), async_sharded_save=True,
                                async_strategy="nvrx")
    # megatron <= 0.18 rewrote common.pt first; rank 0 put the committed one back before the refusal, which
    # every rank raises after a collective: no barrier needed before loading.
    _load_ours(rank, world, path, 4)  # refused before anything was touched
    return str(info.value)


@pytest.mark.skipif(compat.REGISTRY, reason="megatron-core 0.16 has no async_strategy")
def test_nvrx_queue_without_nvidia_resiliency_ext_fails_before_touching_the_checkpoint(tmp_path):
    pytest.importorskip("megatron.core.dist_checkpointing.strategies.nvrx")
    try:
        importlib.import_module("nvidia_resiliency_ext")  # only whether it imports
        pytest.skip("nvidia-resiliency-ext is installed here")
    except ImportError:
        pass
    for m in run_ranks(2, _nvrx_without_package, str(tmp_path / "n")):
        assert "nothing was written" in m and "nvidia-resiliency-ext" in m, m
        for rank in range(2):  # megatron's own error, from each rank that cannot serve the queue
            assert f"rank {rank}: async_strategy='nvrx' cannot be served: ModuleNotFoundError: " in m, m


def test_megatron_asks_for_its_default_loader_and_gets_ours(saved, tmp_path):
    from megatron.core.dist_checkpointing import serialization

    from fastpersist_dist import register

    register()  # again: idempotent
    assert isinstance(serialization.get_default_load_sharded_strategy(saved), FastPersistLoadStrategy)
    path = str(tmp_path / "stock")
    run_ranks(1, _save_stock, path)
    assert min(run_ranks(2, _load_plain, path)) > 40  # ours hands megatron's own checkpoint to megatron's loader


def _save_stock(rank: int, world: int, path: str) -> None:
    make_dir(path)
    with torch_dist_cpu_shims():
        dist_checkpointing.save(state(rank, world), path, sharded_strategy=("torch_dist", 1))


def test_default_format_per_stack():
    assert FastPersistSaveStrategy().checkpoint_format == ("fastpersist" if compat.REGISTRY else TORCH_DIST.name)


OTHER_PYTHON = os.environ.get("FASTPERSIST_OTHER_PYTHON")  # .ci/run sets it to the other stack's venv


def _other_stack(action: str, path: str) -> str:
    import subprocess
    import sys

    proc = subprocess.run([OTHER_PYTHON, "-m", "tests.cross_stack", action, path], capture_output=True, text=True,
                          timeout=600, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout + sys.version


@pytest.mark.skipif(not OTHER_PYTHON, reason="FASTPERSIST_OTHER_PYTHON (the other stack's venv python) not set")
def test_checkpoint_crosses_megatron_core_versions_both_ways(tmp_path):
    from . import cross_stack

    here, there = str(tmp_path / "here"), str(tmp_path / "there")
    run_ranks(2, cross_stack._save, here)
    assert "cross_stack: load" in _other_stack("load", here)
    _other_stack("save", there)
    for world in (1, 2):
        run_ranks(world, cross_stack._load, there)
