"""``--help`` and argument errors answer before torch, megatron-core or DeepSpeed is imported."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fastpersist_dist.tools.bench import baselines
from fastpersist_dist_cli import CONTENDER_NAMES, DEFAULT_CONTENDERS

pytestmark = pytest.mark.engine

HEAVY = ("torch", "megatron", "deepspeed", "fastpersist_dist")

# Runs the command line in a fresh interpreter; prints the exit code and the heavy modules imported.
PROBE = """
import json, sys
from fastpersist_dist_cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
heavy = sorted(m for m in sys.modules if m.split(".")[0] in {heavy!r})
print(json.dumps({{"code": code, "heavy": heavy}}), file=sys.stderr)
""".format(heavy=set(HEAVY))


@pytest.mark.parametrize("argv, code, says", [
    (["--help"], 0, "Exit codes: 0 success"),
    (["bench", "--help"], 0, "--log-level {WARNING,INFO,DEBUG}"),
    (["sweep", "--help"], 0, "--reps"),
    (["verify", "--help"], 0, "checkpoint directory"),
    (["bench", "--gib", "0"], 2, "argument --gib: must be > 0"),
    (["bench", "--ranks", "3", "--tp", "2"], 2, "bench: --ranks (3) must be a multiple of --tp (2)"),
    (["bench", "--contenders", "fastpersist,nope"], 2, "bench: unknown contenders ['nope']"),
    (["sweep", "--ranks", "3", "--tp", "2"], 2, "sweep: --ranks (3) must be a multiple of --tp (2)"),
    (["nope"], 2, "invalid choice: 'nope'"),
])
def test_help_and_argument_errors_import_nothing_heavy(argv, code, says):
    proc = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=120)
    result = json.loads(proc.stderr.strip().splitlines()[-1])
    assert result == {"code": code, "heavy": []}, proc.stderr
    assert says in proc.stdout + proc.stderr


def test_bench_help_lists_log_level_on_its_own():
    proc = subprocess.run([sys.executable, "-m", "fastpersist_dist_cli", "bench", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and not proc.stderr
    lines = proc.stdout.splitlines()
    (i,) = [i for i, line in enumerate(lines) if line.strip().startswith("--log-level")]
    assert lines[i + 1].strip().startswith("WARNING (default)")


def test_contender_names_are_the_bench_contenders():
    assert set(CONTENDER_NAMES) == set(baselines.CONTENDERS) and DEFAULT_CONTENDERS == baselines.DEFAULT_CONTENDERS
