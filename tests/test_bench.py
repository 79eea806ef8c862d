"""The main job runs end to end on a tiny state (no timing assertions)."""

import json
import subprocess
import sys

from fastpersist_dist.bench.gpt_state import GptShape


def test_gpt_shape_sizes():
    shape = GptShape.for_bytes(2 << 30, tp=2)
    assert shape.hidden % 128 == 0 and 0.5 < shape.total_bytes() / (2 << 30) <= 1.0


def test_bench_command_tiny(tmp_path):
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "fastpersist_dist.cli", "bench", "--gib", "0.02", "--reps", "1",
         "--dir", str(tmp_path / "b"), "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [r["name"] for r in report["results"]] == ["fastpersist", "fastpersist_async", "torch_dist"]
    assert report["results"][1]["blocking"]["median_s"] > 0
    assert "fastpersist" in proc.stdout and "x t_dist" in proc.stdout
    assert "bench: fastpersist_async 1/1: save" in proc.stderr  # progress while it runs
    assert not list((tmp_path / "b").iterdir())  # checkpoints removed unless --keep


def test_bench_rejects_bad_arguments():
    for args in (["--ranks", "3", "--tp", "2"], ["--gib", "0"], ["--contenders", "nope"]):
        proc = subprocess.run([sys.executable, "-m", "fastpersist_dist.cli", "bench", *args],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode != 0 and proc.stderr.strip(), args
