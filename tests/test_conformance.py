"""Drop-in conformance: each behaviour of megatron's contract, run against our formats and torch_dist.

Every scenario saves and loads with each backend on 3 gloo ranks (CUDA calls
stubbed for torch_dist only, see ``torch_dist_cpu_shims``) and returns plain
values; the test asserts that every backend returns the same, and that the
values are the ones saved.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensorFactory
from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
from megatron.core.dist_checkpointing.validation import StrictHandling
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorProperties

from fastpersist_dist import FastPersistLoadStrategy, FastPersistSaveStrategy
from fastpersist_dist.tools.bench.baselines import torch_dist_cpu_shims
from fastpersist_dist.tools.ranks import run_ranks

from .helpers import global_tensor, logged, make_dir

pytestmark = pytest.mark.contract

WORLD = 3
BACKENDS = ["fastpersist", "fastpersist_dcp", "torch_dist"]


def _save(backend: str, sd: dict, path: str, **kwargs: Any) -> None:
    make_dir(path)
    strategy = {"fastpersist": lambda: FastPersistSaveStrategy("fastpersist"),
                "fastpersist_dcp": lambda: FastPersistSaveStrategy("torch_dist"),
                "torch_dist": lambda: ("torch_dist", 1)}[backend]()
    with torch_dist_cpu_shims():
        dist_checkpointing.save(sd, path, sharded_strategy=strategy, **kwargs)


def _load(backend: str, sd: dict, path: str, **kwargs: Any) -> Any:
    """Our native format through our loader; both torch_dist formats through megatron's plain load()."""
    if backend == "fastpersist":
        kwargs["sharded_strategy"] = FastPersistLoadStrategy()
    with torch_dist_cpu_shims():
        return dist_checkpointing.load(sd, path, **kwargs)


def _uneven(key: str, full: torch.Tensor, rows: tuple[int, ...], rank: int, fill: float = 0) -> ShardedTensor:
    """Rank's rows of ``full`` split as ``rows`` along axis 0 (zero-row shards included); ``fill`` makes a template."""
    start = sum(rows[:rank])
    local = full[start : start + rows[rank]].clone()
    if fill:
        local.fill_(fill)
    return ShardedTensor(key, local, local.dtype, tuple(local.shape), tuple(full.shape),
                         (start,) + (0,) * (full.dim() - 1), None, 0)


def _empty_shards(backend: str, rank: int, path: str) -> list:
    full = global_tensor("e", (6, 2))
    _save(backend, {"e": _uneven("e", full, (6, 0, 0), rank)}, path, validate_access_integrity=False)
    out = []
    for rows in ((2, 2, 2), (0, 6, 0), (6, 0, 0)):
        loaded = _load(backend, {"e": _uneven("e", full, rows, rank, fill=7)}, path, validate_access_integrity=False)
        out.append(loaded["e"].tolist())
    return out


def _shape_mismatch_zero_padding(backend: str, rank: int, path: str) -> list:
    full = global_tensor("p", (3 * 4, 5))
    _save(backend, {"p": ShardedTensor.from_rank_offsets("p", full[4 * rank : 4 * rank + 4].clone(), (0, rank, WORLD))},
          path)
    req = ShardedTensor.from_rank_offsets("p", torch.full((4, 7), 7.0), (0, rank, WORLD), allow_shape_mismatch=True)
    return _load(backend, {"p": req}, path)["p"].tolist()


def _factory_and_nonpersistent(backend: str, rank: int, path: str) -> list:
    full = global_tensor("f", (6, 4))

    def sd() -> dict:
        def build(key: str, t: torch.Tensor, replica_id: Any, flattened_range: Any) -> dict:
            return {"half0": ShardedTensor.from_rank_offsets(f"{key}.0", t[:, :2].contiguous(), (0, rank, WORLD)),
                    "half1": ShardedTensor.from_rank_offsets(f"{key}.1", t[:, 2:].contiguous(), (0, rank, WORLD))}

        def merge(parts: dict) -> torch.Tensor:
            return torch.cat([parts["half0"], parts["half1"]], dim=1)

        return {"f": ShardedTensorFactory("f", full[2 * rank : 2 * rank + 2].clone(), build, merge),
                "np": LocalNonpersistentObject(f"local-{rank}")}

    _save(backend, sd(), path)
    template = sd()
    template["f"].data.fill_(7)
    loaded = _load(backend, template, path)
    return [loaded["f"].tolist(), loaded["np"]]


def _strict_missing_and_unexpected(backend: str, rank: int, path: str) -> list:
    t = global_tensor("a", (WORLD, 4))
    _save(backend, {k: ShardedTensor.from_rank_offsets(k, t[rank : rank + 1].clone(), (0, rank, WORLD))
                    for k in ("a", "b")}, path)
    req = {k: ShardedTensor.from_rank_offsets(k, torch.zeros(1, 4), (0, rank, WORLD)) for k in ("a", "c")}
    loaded, missing, unexpected = _load(backend, req, path, strict=StrictHandling.RETURN_ALL)
    return [loaded["a"].tolist(), sorted(missing), sorted(unexpected)]


def _metadata_and_content(backend: str, rank: int, path: str) -> list:
    sd = {
        "bf": ShardedTensor.from_rank_offsets("bf", global_tensor("bf", (WORLD, 3), torch.bfloat16)[rank : rank + 1].clone(),
                                              (0, rank, WORLD)),
        "scalar": ShardedTensor.from_rank_offsets("scalar", torch.tensor(3.5), replica_id=rank),
        "obj": ShardedObject("obj", {"ids": [rank]}, (WORLD,), (rank,), replica_id=(0, 0)),
    }
    _save(backend, sd, path, content_metadata={"run": "conformance", "step": 9})
    strategy = FastPersistLoadStrategy() if backend == "fastpersist" else None
    meta = dist_checkpointing.load_tensors_metadata(path, strategy)
    content = dist_checkpointing.load_content_metadata(path)
    objs = [k for k in dist_checkpointing.serialization.load_sharded_metadata(path, strategy) if k.startswith("obj")]
    return [{k: (tuple(v.global_shape), str(v.dtype)) for k, v in meta.items() if k != "common_state"}, content,
            sorted(objs)]


def _views_scalars_objects(backend: str, rank: int, path: str) -> list:
    base = global_tensor("v", (WORLD * 4, 6))
    view = base[4 * rank : 4 * rank + 4, ::2]  # non-contiguous
    sd = {
        "v": ShardedTensor.from_rank_offsets("v", view, (0, rank, WORLD)),
        "s": ShardedTensor.from_rank_offsets("s", torch.tensor(rank * 1.0 if rank == 0 else 0.0), replica_id=rank),
        "o": ShardedObject("o", {"r": rank}, (WORLD,), (rank,), replica_id=(0, 0)),
    }
    _save(backend, sd, path)
    req = {
        "v": ShardedTensor.from_rank_offsets("v", torch.full((4, 3), 7.0), (0, rank, WORLD)),
        "s": ShardedTensor.from_rank_offsets("s", torch.tensor(7.0), replica_id=rank),
        "o": ShardedObject("o", None, (WORLD,), (rank,), replica_id=(0, 0)),
    }
    loaded = _load(backend, req, path)
    return [loaded["v"].tolist(), loaded["s"].item(), loaded["o"]]


def _dtypes(backend: str, rank: int, path: str) -> list:
    dtypes = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
              torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]
    full = {str(d): global_tensor(str(d), (WORLD * 2, 3), torch.float32 if d.itemsize == 1 and d.is_floating_point else d)
            .to(d) for d in dtypes}
    _save(backend, {k: ShardedTensor.from_rank_offsets(k, t[2 * rank : 2 * rank + 2].clone(), (0, rank, WORLD))
                    for k, t in full.items()}, path)
    req = {k: ShardedTensor.from_rank_offsets(k, torch.zeros(2, 3, dtype=t.dtype), (0, rank, WORLD))
           for k, t in full.items()}
    loaded = _load(backend, req, path)
    return [(k, loaded[k].view(torch.uint8).tolist() == full[k][2 * rank : 2 * rank + 2].contiguous().view(torch.uint8)
             .tolist()) for k in full]


SCENARIOS: dict[str, Callable[[str, int, str], Any]] = {
    "empty_shards": _empty_shards,
    "shape_mismatch_zero_padding": _shape_mismatch_zero_padding,
    "factory_and_nonpersistent": _factory_and_nonpersistent,
    "strict_missing_and_unexpected": _strict_missing_and_unexpected,
    "metadata_and_content": _metadata_and_content,
    "views_scalars_objects": _views_scalars_objects,
    "dtypes": _dtypes,
}


def _run(rank: int, world: int, scenario: str, backend: str, path: str) -> Any:
    return SCENARIOS[scenario](backend, rank, path)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_same_results_as_torch_dist(tmp_path, scenario):
    results = {b: run_ranks(WORLD, _run, scenario, b, str(tmp_path / b)) for b in BACKENDS}
    for backend in BACKENDS[:-1]:
        assert results[backend] == results["torch_dist"], (backend, results[backend], results["torch_dist"])
    _check_values(scenario, results["torch_dist"])


def _check_values(scenario: str, per_rank: list) -> None:
    """The shared result is also the right one (not just the same mistake everywhere)."""
    if scenario == "empty_shards":
        full = global_tensor("e", (6, 2))
        for rank, (even, middle, first) in enumerate(per_rank):
            assert even == full[2 * rank : 2 * rank + 2].tolist()
            assert middle == (full.tolist() if rank == 1 else [])
            assert first == (full.tolist() if rank == 0 else [])
    elif scenario == "shape_mismatch_zero_padding":
        full = global_tensor("p", (12, 5))
        for rank, got in enumerate(per_rank):
            assert got == torch.cat([full[4 * rank : 4 * rank + 4], torch.zeros(4, 2)], dim=1).tolist()
    elif scenario == "strict_missing_and_unexpected":
        for got in per_rank:
            assert got[1] and got[2], got  # "c" missing from the checkpoint, "b" not requested
    elif scenario == "dtypes":
        for got in per_rank:
            assert all(ok for _, ok in got), got


# What callers catch: megatron's base checkpointing error and torch DCP's.
FAMILIES = (CheckpointingException, CheckpointException)


def _strict_matrix(rank: int, world: int, backend: str, path: str) -> dict:
    """Each StrictHandling mode's outcome for a load asking "a" and "c" of a checkpoint of "a" and "b": the loaded
    values (and the missing and unexpected keys where the mode returns them), or the families of the error raised;
    and what fastpersist_dist logged at INFO or above meanwhile. "megatron": megatron's own torch_dist checkpoint
    through its own loader; "torch_dist": the same checkpoint through a plain load() (our loader hands it over)."""
    t = global_tensor("a", (WORLD, 4))
    _save("torch_dist" if backend == "megatron" else backend,
          {k: ShardedTensor.from_rank_offsets(k, t[rank : rank + 1].clone(), (0, rank, WORLD)) for k in ("a", "b")},
          path)
    records = logged(level=logging.INFO)  # as a trainer that shows INFO records
    outcomes = {}
    for mode in StrictHandling:
        req = {k: ShardedTensor.from_rank_offsets(k, torch.zeros(1, 4), (0, rank, WORLD)) for k in ("a", "c")}
        kwargs = {"sharded_strategy": TorchDistLoadShardedStrategy()} if backend == "megatron" else {}
        try:
            got = _load(backend, req, path, strict=mode, **kwargs)
        except BaseException as e:  # noqa: BLE001 - CheckpointException is a BaseException
            outcomes[mode.name] = ("raised", sorted(f.__name__ for f in FAMILIES if isinstance(e, f)))
            continue
        loaded, *mismatch = got if isinstance(got, tuple) else (got,)
        outcomes[mode.name] = ("loaded", loaded["a"].tolist(), [sorted(keys) for keys in mismatch])
    return {"outcomes": outcomes, "logged": [f"{r.name}: {r.getMessage()}" for r in records]}


def test_every_strict_handling_mode_as_megatrons_backend(tmp_path):
    results = {b: run_ranks(WORLD, _strict_matrix, b, str(tmp_path / b)) for b in ["megatron", *BACKENDS]}
    theirs = results["megatron"][0]["outcomes"]
    assert theirs["ASSUME_OK_UNEXPECTED"] == ("raised", ["CheckpointException"])  # torch DCP's error: "c" is absent
    assert theirs["RETURN_ALL"] == ("loaded", global_tensor("a", (WORLD, 4))[:1].tolist(), [["b"], ["c"]])
    for backend in BACKENDS:
        for rank, result in enumerate(results[backend]):
            for mode, outcome in result["outcomes"].items():
                expected = results["megatron"][rank]["outcomes"][mode]
                if expected[0] == "raised":  # ours may be of more families, never of fewer
                    assert outcome[0] == "raised" and set(outcome[1]) >= set(expected[1]), (backend, mode, outcome)
                else:
                    assert outcome == expected, (backend, rank, mode, outcome, expected)
    # megatron's loader logs nothing when it loads its own checkpoint; neither does ours when handing it over
    assert results["torch_dist"] == results["megatron"]


def _megatrons_own(rank: int, world: int, path: str) -> None:
    _save("torch_dist", {"w": ShardedTensor.from_rank_offsets("w", global_tensor("w", (WORLD, 3))[rank : rank + 1].clone(),
                                                               (0, rank, WORLD)),
                         "o": ShardedObject("o", {"r": rank}, (WORLD,), (rank,), replica_id=0)}, path)


def test_metadata_of_megatrons_own_checkpoint_reads_as_torch_2_15_unpickles_it(tmp_path, monkeypatch):
    """megatron-core rebuilds tensor metadata as ``torch.empty(size, **properties.__dict__)``; torch 2.15's
    unpickling sets ``TensorProperties.strides`` (None where none was stored), which ``torch.empty`` refuses.

    Stood in for here on older torch: megatron's own reading then fails, ours (a plain call hands megatron's
    checkpoints to megatron's reading) does not.
    """
    path = str(tmp_path / "torch_dist")
    run_ranks(WORLD, _megatrons_own, path)
    five_fields = TensorProperties.__setstate__

    def like_torch_2_15(self: TensorProperties, state: tuple) -> None:
        five_fields(self, state[:5])
        self.strides = state[5] if len(state) > 5 else None

    monkeypatch.setattr(TensorProperties, "__setstate__", like_torch_2_15)
    with pytest.raises(TypeError, match="strides"):
        TorchDistLoadShardedStrategy().load_tensors_metadata(Path(path))
    tensors = dist_checkpointing.load_tensors_metadata(path)
    assert {k: (tuple(v.global_shape), v.dtype) for k, v in tensors.items()} == {"w": ((WORLD, 3), torch.float32)}
    everything = dist_checkpointing.serialization.load_sharded_metadata(path)
    assert "w" in everything and sum(k.startswith("o/") for k in everything) == WORLD, sorted(everything)
