"""The README's example runs as printed: torchrun, 2 ranks, on this stack."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fastpersist_dist.format.tiers import local_copy_dir

pytestmark = pytest.mark.contract

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "quickstart.py"


def test_readme_shows_the_example_verbatim():
    """The README's code is the file the next test runs, so it cannot drift from what works."""
    code = EXAMPLE.read_text()
    body = code[code.index("import sys"):]
    assert f"```python\n{body}```" in (ROOT / "README.md").read_text()


def test_quickstart_runs_under_torchrun(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(EXAMPLE),
         str(tmp_path / "ckpts")],
        capture_output=True, text=True, timeout=600, env=env, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert f"quickstart: 2 ranks saved, loaded resharded and verified {tmp_path / 'ckpts'}/step_200" in proc.stdout
    assert sorted(os.listdir(tmp_path / "ckpts")) == ["step_100", "step_200"]


TIERED = ROOT / "examples" / "tiered.py"


def test_tiers_doc_shows_the_tiered_example_verbatim():
    code = TIERED.read_text()
    body = code[code.index("import os"):]
    assert f"```python\n{body}```" in (ROOT / "docs" / "tiers.md").read_text()


def test_tiered_example_runs_under_torchrun(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    local, persistent = tmp_path / "local", tmp_path / "persistent"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(TIERED),
         str(local), str(persistent)],
        capture_output=True, text=True, timeout=600, env=env, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert f"rank 0: {persistent}/step_100 is local right after the save" in proc.stdout
    assert f"tiered: 2 ranks on 1 node(s) saved {persistent}/step_200 to {local}, now durable; " \
           f"{persistent}/step_100 removed: True" in proc.stdout
    assert os.listdir(persistent) == ["step_200"]
    # the node's copy of step_200; step_100's goes with the node's next commit, or went with step_200's if its
    # removal came first
    copies = {os.path.basename(local_copy_dir(str(local), str(persistent / s))) for s in ("step_100", "step_200")}
    assert os.path.basename(local_copy_dir(str(local), str(persistent / "step_200"))) in os.listdir(local)
    assert set(os.listdir(local)) <= copies, os.listdir(local)
