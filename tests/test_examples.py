"""The README's and the docs' examples run as printed: torchrun, 2 ranks, on this stack."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fastpersist_dist.format.tiers import local_copy_dir

pytestmark = pytest.mark.contract

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "quickstart.py"


def _shown_verbatim(example: Path, first_line: str, doc: str) -> None:
    """The doc's code is the example file from ``first_line`` on, so it cannot drift from what the tests run."""
    code = example.read_text()
    body = code[code.index(first_line):]
    assert f"```python\n{body}```" in (ROOT / doc).read_text()


def _torchrun(example: Path, *args: object) -> str:
    """``example`` under torchrun on 2 ranks of this machine; its output, once it succeeded."""
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(example),
         *map(str, args)], capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"},
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def test_readme_shows_the_example_verbatim():
    _shown_verbatim(EXAMPLE, "import sys", "README.md")


def test_quickstart_runs_under_torchrun(tmp_path):
    out = _torchrun(EXAMPLE, tmp_path / "ckpts")
    assert f"quickstart: 2 ranks saved, loaded resharded and verified {tmp_path / 'ckpts'}/step_200" in out
    assert sorted(os.listdir(tmp_path / "ckpts")) == ["step_100", "step_200"]


TIERED = ROOT / "examples" / "tiered.py"


def test_tiers_doc_shows_the_tiered_example_verbatim():
    _shown_verbatim(TIERED, "import os", "docs/tiers.md")


def test_tiered_example_runs_under_torchrun(tmp_path):
    local, persistent = tmp_path / "local", tmp_path / "persistent"
    out = _torchrun(TIERED, local, persistent)
    assert f"rank 0: {persistent}/step_100 is local right after the save" in out
    assert f"tiered: 2 ranks on 1 node(s) saved {persistent}/step_200 to {local}, now durable; " \
           f"{persistent}/step_100 removed: True" in out
    assert os.listdir(persistent) == ["step_200"]
    # the node's copy of step_200; step_100's goes with the node's next commit, or went with step_200's if its
    # removal came first
    copies = {os.path.basename(local_copy_dir(str(local), str(persistent / s))) for s in ("step_100", "step_200")}
    assert os.path.basename(local_copy_dir(str(local), str(persistent / "step_200"))) in os.listdir(local)
    assert set(os.listdir(local)) <= copies, os.listdir(local)


DCP = ROOT / "examples" / "dcp_fsdp2.py"


def test_dcp_doc_shows_the_dcp_example_verbatim():
    _shown_verbatim(DCP, "import sys", "docs/dcp.md")


def test_dcp_example_runs_under_torchrun(tmp_path):
    out = _torchrun(DCP, tmp_path)
    assert f"dcp: 2 ranks saved {tmp_path}/step_1 and {tmp_path}/step_2, loaded step_1; verify: OK" in out
    assert sorted(os.listdir(tmp_path)) == ["step_1", "step_2"]
