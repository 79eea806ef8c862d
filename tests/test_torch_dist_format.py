"""The ``torch_dist`` format: DCP files written through our engine, read by megatron's and torch's own loaders.

Runs on whichever megatron-core the venv has (0.16.1 or 0.19.2): on 0.17+ it
is the default format and ``save()`` must keep our strategy; on 0.16 it is
chosen with ``checkpoint_format="torch_dist"``. megatron's own loader is named
where it is meant (``stock_loader``): a plain ``load()`` uses ours.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import pickle
import shutil
import signal
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
from torch.distributed.checkpoint.api import CheckpointException

from fastpersist_dist import FastPersistLoadStrategy, FastPersistSaveStrategy, compat
from fastpersist_dist.engine.index_reader import read_index
from fastpersist_dist.format.index_pages import part_file_name
from fastpersist_dist.format.kinds import DCP_METADATA_FILE, TORCH_DIST
from fastpersist_dist.format.records import COMMON_FILE, INDEX_FILE, aux_copy_name
from fastpersist_dist.tools.bench.baselines import torch_dist_cpu_shims
from fastpersist_dist.tools.ranks import RanksFailed, run_ranks
from fastpersist_dist.tools.verify import verify_checkpoint
from fastpersist_dist.util.errors import CorruptCheckpointError, IncompleteCheckpointError, SaveFailedError

from .faults import KILL_AT, KILLABLE, die_at_file_size, run_faulty, save_error
from .helpers import (
    COMMON_STATE_OBJECT,
    NVRX_DIR,
    assert_same,
    flip_bit,
    global_tensor,
    make_dir,
    megatron_queue,
    save,
    sharded,
    stock_loader,
)
from .states import (
    check_dtype_state,
    dcp_strategy,
    dtype_state,
    dtype_template,
    load_dtype_state_plain,
    load_dtype_state_stock,
)

pytestmark = pytest.mark.contract


def _save(rank: int, world: int, path: str, salt: int = 0) -> None:
    save(dtype_state(rank, world, salt), path, strategy=dcp_strategy())


def _load_ours(rank: int, world: int, path: str, salt: int = 0) -> int:
    loaded = dist_checkpointing.load(dtype_template(rank, world), path, sharded_strategy=FastPersistLoadStrategy())
    return check_dtype_state(loaded, rank, world, salt)


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
    assert min(run_ranks(world, load_dtype_state_stock, saved)) > 40


@pytest.mark.parametrize("world", [1, 2])
def test_plain_load_reads_it(saved, world):
    assert min(run_ranks(world, load_dtype_state_plain, saved)) > 40


@pytest.mark.parametrize("world", [1, 4])
def test_our_loader_reads_it_verified(saved, world):
    assert min(run_ranks(world, _load_ours, saved)) > 40


def test_torch_dcp_load_reads_it(saved):
    want = dtype_state(0, 1)
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
    assert dtypes and dtypes == {k: v.data.dtype for k, v in dtype_state(0, 1).items() if isinstance(v, ShardedTensor)}


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
    with pytest.raises(RanksFailed, match="CorruptCheckpointError: .*checksum mismatch"):
        run_ranks(1, _load_ours, path)
    with pytest.raises(RanksFailed, match="CorruptCheckpointError: .*checksum mismatch"):
        run_ranks(1, load_dtype_state_plain, path)  # ours by default too (before: megatron's, checking nothing)
    proc_out = run_ranks(1, _inspect, saved)[0]
    assert "format: torch_dist" in proc_out and "PROBLEM" not in proc_out, proc_out


def test_loads_by_pread_check_the_framing_read_beside_the_elements(saved, shm_dir):
    """On tmpfs a load preads: a record's elements straight into the destination, the torch.save framing in the
    same checksum blocks beside them into a staging buffer. A damaged byte anywhere in those blocks is caught."""
    path = os.path.join(shm_dir, "ckpt")
    shutil.copytree(saved, path)
    assert min(run_ranks(2, _load_ours, path)) > 40
    assert min(run_ranks(4, _load_ours, path)) > 40  # resharded: runs inside records
    rec = next(r for r in read_index(path, "test").records if r.key == "float32.rows" and r.file == "__1_0.distcp")
    assert 0 < rec.data_offset and rec.data_offset + 4 * math.prod(rec.local_shape) < rec.length  # framing both sides
    victim = os.path.join(path, rec.file)
    for at in (rec.offset + rec.data_offset - 1, rec.offset + rec.data_offset, rec.offset + rec.length - 1):
        flip_bit(victim, at, 0x10)
        with pytest.raises(RanksFailed, match="CorruptCheckpointError: .*checksum mismatch.*float32.rows"):
            run_ranks(1, _load_ours, path)
        flip_bit(victim, at, 0x10)  # whole again
    assert min(run_ranks(1, _load_ours, path)) > 40


def _inspect(rank: int, world: int, path: str) -> str:
    from fastpersist_dist.tools.inspect import format_report, inspect_checkpoint

    return format_report(inspect_checkpoint(path))


def test_gpt_model_saved_at_tp2_loads_at_tp1_with_the_stock_loader(tmp_path):
    from .states import load_model, save_model

    path = str(tmp_path / "gpt")
    run_ranks(2, save_model, path, dcp_strategy())
    assert run_ranks(1, load_model, path, stock_loader)[0] > 20


def _overwrite_and_die(rank: int, world: int, root: str, victim: int):
    _save(rank, world, f"{root}/ckpt", salt=1)
    big = {"w": sharded("w", global_tensor("w", (2048, 4096)), rank, world, 0)}
    save(big, f"{root}/ckpt", strategy=dcp_strategy())  # 16 MiB per rank: old data files larger than KILL_AT
    if rank == victim:
        die_at_file_size(KILL_AT)
    big = {"w": sharded("w", global_tensor("w", (2048, 4096), salt=2), rank, world, 0)}
    return save_error(lambda: save(big, f"{root}/ckpt", strategy=dcp_strategy(**KILLABLE)))


def _refused_by_every_loader(rank: int, world: int, path: str) -> list[str]:
    req = {"w": sharded("w", torch.zeros(2048, 4096), rank, world, 0)}
    messages = []
    with pytest.raises(IncompleteCheckpointError) as ours:
        FastPersistLoadStrategy().load(req, path)
    messages.append(str(ours.value))
    with pytest.raises(CheckpointException) as stock:  # torch DCP's, a BaseException
        dist_checkpointing.load(req, path, sharded_strategy=stock_loader())
    messages.append(f"{type(stock.value).__name__}: {stock.value}")
    # megatron-core 0.19 reads the common state through DCP before asking any loader: torch's error, as stock's
    with pytest.raises(CheckpointException if COMMON_STATE_OBJECT else IncompleteCheckpointError) as plain:
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
        dist_checkpointing.save(dtype_state(rank, world, salt=3), path,
                                sharded_strategy=("torch_dist", 1))  # megatron's own writer on either stack
    with pytest.raises(CorruptCheckpointError) as info:
        FastPersistLoadStrategy().load(dtype_template(rank, world), path)
    return str(info.value)


def test_stock_resave_over_our_checkpoint_is_not_read_through_the_stale_sidecar(saved, tmp_path):
    path = str(tmp_path / "ckpt")
    shutil.copytree(saved, path)
    for message in run_ranks(2, _stock_over_ours, path):
        assert "is not the one committed with" in message and f"remove {INDEX_FILE}" in message, message
    os.unlink(os.path.join(path, INDEX_FILE))  # as the message says: now megatron's own checkpoint, loaded by it
    run_ranks(2, _load_ours, path, 3)


def _fully_parallel(rank: int, world: int, path: str) -> int:
    wrapper = FullyParallelSaveStrategyWrapper(dcp_strategy())
    make_dir(path)
    dist_checkpointing.save(dtype_state(rank, world), path, sharded_strategy=wrapper)
    return load_dtype_state_stock(rank, world, path)


def test_megatron_fully_parallel_wrapper_around_our_strategy(tmp_path):
    assert min(run_ranks(2, _fully_parallel, str(tmp_path / "fp"))) > 40


def _async_with_megatron_queue(rank: int, world: int, path: str, queue_name: str) -> int:
    if queue_name == "nvrx":
        sys.path.insert(0, NVRX_DIR)
    queue = megatron_queue(queue_name)
    sd = dtype_state(rank, world)
    before = {k: v.data.clone() for k, v in sd.items() if isinstance(v, ShardedTensor)}
    make_dir(path)
    with torch_dist_cpu_shims():
        request = dist_checkpointing.save(sd, path, sharded_strategy=dcp_strategy(), async_sharded_save=True,
                                          async_strategy=queue_name)
        for k in before:
            sd[k].data.zero_() if sd[k].data.dtype != torch.bool else sd[k].data.logical_not_()  # training goes on
        queue.schedule_async_request(request)
        assert not os.path.exists(os.path.join(path, "metadata.json"))  # only finalize writes it
        queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
        queue.close()
    return load_dtype_state_stock(rank, world, path)


@pytest.mark.skipif(compat.REGISTRY, reason="megatron-core 0.16 has no get_async_strategy; its queue is tested in test_async")
def test_async_save_runs_on_megatrons_mcore_queue(tmp_path):
    assert min(run_ranks(2, _async_with_megatron_queue, str(tmp_path / "a"), "mcore")) > 40


@pytest.mark.skipif(compat.REGISTRY, reason="megatron-core 0.16 has no get_async_strategy")
def test_async_save_runs_on_nvidia_resiliency_ext_queue(nvrx_dir, tmp_path):
    """megatron-core 0.17+'s default async queue, from nvidia-resiliency-ext (installed by setup.sh)."""
    assert min(run_ranks(2, _async_with_megatron_queue, str(tmp_path / "a"), "nvrx")) > 40


def _nvrx_without_package(rank: int, world: int, path: str) -> str:
    _save(rank, world, path, salt=4)
    with pytest.raises(SaveFailedError) as info:
        dist_checkpointing.save(dtype_state(rank, world), path, sharded_strategy=dcp_strategy(), async_sharded_save=True,
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
    assert min(run_ranks(2, load_dtype_state_plain, path)) > 40  # ours hands megatron's own checkpoint to megatron's loader


def _save_stock(rank: int, world: int, path: str) -> None:
    make_dir(path)
    with torch_dist_cpu_shims():
        dist_checkpointing.save(dtype_state(rank, world), path, sharded_strategy=("torch_dist", 1))


def test_default_format_per_stack():
    assert FastPersistSaveStrategy().checkpoint_format == ("fastpersist" if compat.REGISTRY else TORCH_DIST.name)


def _other_stack(other_python: str, action: str, path: str) -> str:
    import subprocess
    import sys

    proc = subprocess.run([other_python, "-m", "tests.cross_stack", action, path], capture_output=True, text=True,
                          timeout=600, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout + sys.version


@pytest.mark.slow
def test_checkpoint_crosses_megatron_core_versions_both_ways(other_python, tmp_path):
    from . import cross_stack

    here, there = str(tmp_path / "here"), str(tmp_path / "there")
    run_ranks(2, cross_stack.save_state, here)
    assert "cross_stack: load" in _other_stack(other_python, "load", here)
    _other_stack(other_python, "save", there)
    for world in (1, 2):
        run_ranks(world, cross_stack.load_and_check, there)
