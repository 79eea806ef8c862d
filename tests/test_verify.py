"""The standalone verify (API and command) on good and damaged checkpoints."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fastpersist_dist.engine.index_reader import read_index
from fastpersist_dist.format.records import INDEX_FILE, data_file_name
from fastpersist_dist.tools.ranks import run_ranks
from fastpersist_dist.tools.verify import verify_checkpoint

from .helpers import ADDED_OBJECTS, global_tensor, save, sharded

pytestmark = pytest.mark.engine


def _save(rank: int, world: int, path: str) -> None:
    save({"w": sharded("w", global_tensor("w", (64, 256)), rank, world, 0),
          "b": sharded("b", global_tensor("b", (8, 8)), rank, world, 1)}, path)


def _cli(path: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fastpersist_dist_cli", "verify", path],
                          capture_output=True, text=True, timeout=300)


def test_verify_good_and_damaged(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(2, _save, path)
    report = verify_checkpoint(path)
    assert report.ok and report.tensors == 2 and report.records == 4 + len(ADDED_OBJECTS)
    index = read_index(path, "test")
    assert report.bytes_checked == sum(index.files.values())  # every byte listed (+ 0.19's common_state) ...
    assert sum(r.length for r in index.records if r.kind == "tensor") == (64 * 256 + 64) * 4  # ... all tensors
    proc = _cli(path)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr
    assert proc.stderr == ""  # megatron-core's and DeepSpeed's import warnings are not the command's output

    victim = os.path.join(path, data_file_name(1))
    with open(victim, "r+b") as f:
        f.seek(5)
        f.write(b"\x00\x01")
    os.unlink(os.path.join(path, "metadata.json"))
    report = verify_checkpoint(path)
    assert len(report.problems) == 2, report.problems
    assert any("checksum mismatch" in p and victim in p for p in report.problems)
    assert any("metadata.json is missing" in p for p in report.problems)
    proc = _cli(path)
    assert proc.returncode == 1 and "FAILED (2 problems)" in proc.stdout

    os.truncate(os.path.join(path, data_file_name(0)), 10)
    assert any("has 10 bytes, the index says" in p for p in verify_checkpoint(path).problems)
    os.unlink(os.path.join(path, INDEX_FILE))
    report = verify_checkpoint(path)
    assert any("this checkpoint is incomplete" in p for p in report.problems)


def test_verify_command_rejects_non_directory(tmp_path):
    proc = _cli(str(tmp_path / "nope"))
    assert proc.returncode == 2 and "is not a directory" in proc.stderr
