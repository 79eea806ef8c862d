"""The ``inspect`` command on real checkpoints, the bench chart, and argument errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from megatron.core.dist_checkpointing import ShardedObject
from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config

from fastpersist_dist.format.checksum import digest_bytes
from fastpersist_dist.format.records import (
    COMMON_FILE,
    INDEX_FILE,
    aux_copy_name,
    data_file_name,
    dtype_name,
    status_file_name,
)
from fastpersist_dist.tools.bench.plot import plot_report
from fastpersist_dist.tools.inspect import inspect_checkpoint
from fastpersist_dist.tools.ranks import run_ranks
from fastpersist_dist_cli import main

from .helpers import ADDED_OBJECTS, COMMON_STATE_OBJECT, global_tensor, save, sharded
from .states import write_flat_checkpoint

pytestmark = pytest.mark.engine

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# Committed beside a native checkpoint's index: common.pt (megatron-core 0.19 loads the common state from it
# before asking a strategy) and, where megatron-core <= 0.18 writes it itself, a copy its next save cannot touch.
COMMON_FILES = (COMMON_FILE,) + (() if COMMON_STATE_OBJECT else (aux_copy_name(COMMON_FILE),))
# key -> (global shape, dtype, split, shards saved by 2 ranks)
TENSORS = {
    "w": ((64, 256), torch.float32, 0, 2),
    "b": ((8, 6), torch.bfloat16, 1, 2),
    "step": ((3,), torch.int64, None, 1),  # replicated: rank 0 holds the main replica
}


def _save(rank: int, world: int, path: str) -> None:
    sd = {k: sharded(k, global_tensor(k, shape, dtype), rank, world, split)
          for k, (shape, dtype, split, _) in TENSORS.items()}
    sd["obj"] = ShardedObject("obj", {"rank": rank}, (world,), (rank,))
    save(sd, path)


@pytest.fixture(scope="module")
def good_ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("inspect") / "ckpt")
    run_ranks(2, _save, path)
    return path


def _main(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_inspect_json_matches_what_was_saved(good_ckpt, capsys):
    code, out, err = _main(capsys, "inspect", "--json", good_ckpt)
    assert code == 0 and not err, err
    doc = json.loads(out)
    assert (doc["backend"], doc["backend_version"], doc["committed"], doc["ok"]) == ("fastpersist", 1, True, True)
    assert (doc["index"], doc["world_size"], doc["problems"]) == ("committed", 2, [])
    entries = {e["key"]: e for e in doc["entries"]}
    assert set(entries) == set(TENSORS) | {"obj"} | ADDED_OBJECTS
    for key, (shape, dtype, _, shards) in TENSORS.items():
        e = entries[key]
        assert (e["kind"], e["dtype"], tuple(e["global_shape"])) == ("tensor", dtype_name(dtype), shape)
        assert e["shards"] == e["records"] == shards
        assert e["bytes"] == torch.Size(shape).numel() * dtype.itemsize
    obj = entries["obj"]
    assert (obj["kind"], obj["dtype"], obj["global_shape"], obj["records"]) == ("object", None, [2], 2)
    assert obj["bytes"] > 0
    assert set(doc["files"]) == {data_file_name(0), data_file_name(1)}
    for name, size in doc["files"].items():
        assert size == os.path.getsize(os.path.join(good_ckpt, name))
    assert sum(doc["files"].values()) == sum(e["bytes"] for e in entries.values())
    aux = {a["name"]: a for a in doc["aux_files"]}
    assert set(aux) == set(COMMON_FILES)
    for name, a in aux.items():
        with open(os.path.join(good_ckpt, name), "rb") as f:
            data = f.read()
        assert (a["bytes"], a["xxh3"], a["intact"]) == (len(data), digest_bytes(data), True)


def test_inspect_text(good_ckpt, capsys):
    code, out, _ = _main(capsys, "inspect", good_ckpt)
    assert code == 0
    assert "backend: fastpersist version 1" in out and "index: committed; written by 2 ranks" in out
    objects = 1 + len(ADDED_OBJECTS)
    assert f"3 tensors, {'1 object' if objects == 1 else f'{objects} objects'}, {6 + objects} records:" in out
    lines = out.splitlines()
    w = next(line.split() for line in lines if line.split()[:1] == ["w"])
    assert w[:3] == ["w", "tensor", "float32"] and w[-3:] == ["2", "2", str(64 * 256 * 4)]
    assert any(line.split()[:3] == ["b", "tensor", "bfloat16"] and "(8, 6)" in line for line in lines)
    for rank in range(2):
        size = os.path.getsize(os.path.join(good_ckpt, data_file_name(rank)))
        assert f"{data_file_name(rank)}  {size} bytes" in out


def test_inspect_uncommitted_and_damaged(good_ckpt, tmp_path):
    path = str(tmp_path / "ckpt")
    shutil.copytree(good_ckpt, path)
    index = os.path.join(path, INDEX_FILE)
    with open(index, "r+b") as f:  # one flipped digit inside the index body
        data = f.read()
        f.seek(data.index(b'"world_size":2') + len(b'"world_size":'))
        f.write(b"3")
    report = inspect_checkpoint(path)
    assert (report.index, report.committed, report.ok) == ("invalid", False, False)
    assert any("index checksum mismatch" in p for p in report.problems), report.problems

    os.unlink(index)
    with open(os.path.join(path, status_file_name(1)), "w") as f:
        f.write("{}")  # a writer's leftover, as after a crash before finalize
    # Through the real command line, for the exit code and the stream each part goes to.
    proc = subprocess.run([sys.executable, "-m", "fastpersist_dist_cli", "inspect", path],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "index: NOT committed (incomplete checkpoint)" in proc.stdout
    for name in (data_file_name(0), data_file_name(1), status_file_name(1), *COMMON_FILES):
        assert f"  {name}  " in proc.stdout
    assert f"inspect: {path}: NOT committed (incomplete checkpoint)" in proc.stderr

    save_config(CheckpointingConfig("zarr", 1), path)
    assert any("this is not a FastPersist checkpoint" in p for p in inspect_checkpoint(path).problems)


def test_inspect_unusable_directory(tmp_path, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for target in (str(a_file), str(tmp_path / "missing")):
        code, out, err = _main(capsys, "inspect", target)
        assert code == 2 and not out and f"inspect: {target} is not a directory" in err


def test_inspect_counts_flattened_range_pieces_as_records(tmp_path):
    path = str(tmp_path / "flat")
    full = write_flat_checkpoint(path)
    report = inspect_checkpoint(path)
    assert report.ok, report.problems
    (entry,) = report.entries
    assert (entry.key, entry.dtype, entry.global_shape) == ("flat", "float32", tuple(full.shape))
    assert (entry.shards, entry.records, entry.bytes) == (2, 4, full.numel() * 4)


def _op(median: float, lo: float, hi: float, gib: float) -> dict:
    return {"median_s": median, "min_s": lo, "max_s": hi, "gib_s": gib / median}


def test_plot_report_writes_png(tmp_path):
    gib = 1.5
    rep = {
        "config": {"ranks": 2, "tp": 2, "reps": 3},
        "bytes": int(gib * 2**30),
        "results": [
            {"name": "fastpersist", "save": _op(1.0, 0.9, 1.4, gib), "load": _op(2.0, 1.8, 2.5, gib),
             "reshard": _op(2.2, 2.0, 3.0, gib)},
            {"name": "fastpersist_async", "save": _op(1.5, 1.4, 1.6, gib), "load": _op(2.0, 2.0, 2.0, gib),
             "reshard": _op(2.1, 1.9, 2.4, gib), "blocking": _op(0.3, 0.25, 0.5, gib)},
            {"name": "device_bound", "save": {"gib_s": 3.0}, "load": _op(1.0, 1.0, 1.1, gib)},
        ],
        "notes": [],
    }
    path = tmp_path / "bench.png"
    plot_report(rep, str(path))
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 1000


_WITHOUT_MATPLOTLIB = """
import sys
sys.modules["matplotlib"] = None  # as if not installed: importing it raises ImportError
from fastpersist_dist_cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_plot_without_matplotlib_is_refused_saying_how_to_install_it(tmp_path):
    """matplotlib is an optional extra: ``--plot`` without it fails at once, before anything runs."""
    argv = ["bench", "--dir", str(tmp_path / "b"), "--plot", str(tmp_path / "chart.png")]
    proc = subprocess.run([sys.executable, "-c", _WITHOUT_MATPLOTLIB, *argv], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "--plot needs matplotlib" in proc.stderr and "pip install 'fastpersist-dist[plot]'" in proc.stderr
    assert not (tmp_path / "b").exists()


def test_bench_rejects_bad_output_paths_before_running(tmp_path, capsys):
    bench_dir = tmp_path / "b"
    cases = [
        (["--plot", str(tmp_path / "chart.svg")], "must end in .png"),
        (["--plot", str(tmp_path / "nowhere" / "chart.png")], "does not exist"),
        (["--json", str(tmp_path / "nowhere" / "r.json")], "does not exist"),
        (["--ranks", "3", "--tp", "2"], "must be a multiple of --tp"),
    ]
    for args, message in cases:
        code, out, err = _main(capsys, "bench", "--dir", str(bench_dir), *args)
        assert code == 2 and message in err and err.startswith("bench: "), (args, err)
    assert not bench_dir.exists()  # nothing ran
