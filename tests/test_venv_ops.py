"""Each virtualenv keeps its own built DeepSpeed ops: using one venv never rebuilds another's;
a CUDA arch list DeepSpeed cannot parse does not stop them from building; a failed build advises
installing libaio only where DeepSpeed finds none; DeepSpeed imported after ``init_process_group`` leaves the
world group to ``destroy_process_group``; py-cpuinfo, which DeepSpeed asks at every load of an op, is asked
once per machine.

The venv test needs a second venv: ``FASTPERSIST_OTHER_PYTHON=<other venv>/bin/python`` (``.ci/run``
sets it in its second run, pointing at the first).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fastpersist_dist.storage import cpu_info
from fastpersist_dist.storage.deepspeed_ops import _arch_list_deepspeed_sorts, _libaio_hint, use_venv_extension_cache

pytestmark = pytest.mark.engine

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OWN_ENV_VARS = ("TORCH_EXTENSIONS_DIR", "FASTPERSIST_TORCH_EXT_DIR")

# Loads the async_io and utils ops the way a save does; prints where they came from.
PROBE = """
import json, sys
from deepspeed.io import fast_file_writer
from fastpersist_dist.storage.deepspeed_ops import aio_module, ensure_fast_file_writer_usable
aio = aio_module()
ensure_fast_file_writer_usable()
utils = fast_file_writer.UtilsBuilder().load(verbose=False)
print(json.dumps({"prefix": sys.prefix, "async_io": aio.__file__, "utils": utils.__file__}))
"""


def _probe(python: str, env: dict[str, str]) -> dict[str, str]:
    proc = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=1200, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _builds(prefix: str) -> dict[str, tuple[int, int]]:
    """(mtime, size) of every file under the venv's op cache."""
    root = os.path.join(prefix, "torch_ext")
    return {os.path.join(d, f): (os.stat(os.path.join(d, f)).st_mtime_ns, os.stat(os.path.join(d, f)).st_size)
            for d, _, files in os.walk(root) for f in files}


@pytest.mark.slow
def test_second_venv_leaves_the_first_ones_ops_alone(other_python, monkeypatch):
    clean = {k: v for k, v in os.environ.items() if k not in OWN_ENV_VARS}
    pythons = (sys.executable, other_python)
    first = [_probe(p, clean) for p in pythons]  # each venv's ops built (set-up does it) and loaded
    for seen in first:
        ext = os.path.join(seen["prefix"], "torch_ext") + os.sep
        assert seen["async_io"].startswith(ext) and seen["utils"].startswith(ext), seen
    assert first[0]["prefix"] != first[1]["prefix"], "FASTPERSIST_OTHER_PYTHON is this venv's python"
    before = {seen["prefix"]: _builds(seen["prefix"]) for seen in first}

    # As in a test or a launcher that starts the other venv's python after our ops were used here.
    for name in OWN_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    use_venv_extension_cache()
    again = [_probe(p, dict(os.environ)) for p in (other_python, sys.executable, other_python)]
    assert again == [first[1], first[0], first[1]]  # same files, each from its own venv
    assert {prefix: _builds(prefix) for prefix in before} == before  # nothing rebuilt anywhere


def test_users_extension_dir_is_kept(monkeypatch, tmp_path):
    for name in OWN_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    use_venv_extension_cache()
    assert os.environ["TORCH_EXTENSIONS_DIR"] == os.path.join(sys.prefix, "torch_ext")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # the user's choice
    use_venv_extension_cache()
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(tmp_path)
    monkeypatch.setenv("FASTPERSIST_TORCH_EXT_DIR", "/elsewhere/torch_ext")  # ours, from another venv's process
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/elsewhere/torch_ext")
    use_venv_extension_cache()
    assert os.environ["TORCH_EXTENSIONS_DIR"] == os.path.join(sys.prefix, "torch_ext")


@pytest.mark.parametrize("arch_list, flags", [
    ("9.0a", ["-gencode=arch=compute_90,code=sm_90"]),
    ("8.0;9.0a+PTX", ["-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90",
                      "-gencode=arch=compute_90,code=compute_90"]),
    ("9.0 10.0f", ["-gencode=arch=compute_90,code=sm_90", "-gencode=arch=compute_100,code=sm_100"]),
])
def test_an_arch_list_deepspeed_cannot_sort_is_built_without_its_suffixes_and_restored(monkeypatch, arch_list, flags):
    """An H200 machine's environment made DeepSpeed's CUDA build of our ops fail ("'0a'"); our ops hold no device code."""
    from deepspeed.ops.op_builder.async_io import AsyncIOBuilder  # its CUDA builder, on any host

    builder = AsyncIOBuilder()
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", arch_list)
    with pytest.raises(ValueError, match="invalid literal for int"):
        builder.compute_capability_args()  # the failure, as DeepSpeed 0.19 gives it
    with _arch_list_deepspeed_sorts():
        assert builder.compute_capability_args() == flags
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == arch_list


def test_the_libaio_advice_is_given_only_where_deepspeed_finds_no_libaio():
    """A build failing for another reason (libaio there) must not blame libaio; without a working
    compiler DeepSpeed's own check finds none, and the advice is given."""
    assert _libaio_hint() == ""  # scripts/setup.sh installed libaio-dev
    probe = "from fastpersist_dist.storage.deepspeed_ops import _libaio_hint; print(repr(_libaio_hint()))"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=600, cwd=REPO,
                          env={**os.environ, "CC": "false"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "is libaio-dev installed?" in proc.stdout.strip().splitlines()[-1]


# A training script's order: imports, init_process_group, then DeepSpeed imported by the first save; prints the
# world group's references left after destroy_process_group (2: the script's variable and getrefcount's argument).
AFTER_INIT = """
import sys
import torch.distributed as dist
from fastpersist_dist.storage.deepspeed_ops import aio_module
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
world = dist.group.WORLD
aio_module()
dist.destroy_process_group()
print(sys.getrefcount(world))
"""


def test_deepspeed_imported_after_init_leaves_the_world_group_to_destroy_process_group():
    # A group that outlives destroy_process_group keeps its gloo threads into the interpreter's finalization,
    # where releasing a finished collective's tensors aborts the process ("terminate called without an active
    # exception").
    proc = subprocess.run([sys.executable, "-c", AFTER_INIT], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.split()[-1] == "2", "something still holds the world process group after destroy_process_group"


PROC_CPUINFO = """processor\t: {n}
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480C
cpu MHz\t\t: {mhz}
flags\t\t: fpu sse2 avx2 {extra}
bogomips\t: {mhz}

"""


def test_a_cpu_is_known_by_its_model_and_flags_not_its_clock():
    one = PROC_CPUINFO.format(n=0, mhz="2000.000", extra="avx512f") + PROC_CPUINFO.format(n=1, mhz="2000.000",
                                                                                          extra="avx512f")
    key = cpu_info.cpu_identity(one, "x86_64")
    assert key == cpu_info.cpu_identity(PROC_CPUINFO.format(n=0, mhz="3712.5", extra="avx512f"), "x86_64")
    assert key != cpu_info.cpu_identity(PROC_CPUINFO.format(n=0, mhz="2000.000", extra=""), "x86_64")
    assert key != cpu_info.cpu_identity(one, "aarch64")


def test_the_cpu_answer_is_asked_once_kept_in_its_file_and_asked_again_when_unreadable(tmp_path):
    asked = []

    def ask():
        asked.append(1)
        return {"arch": "X86_64", "flags": ["avx2"]}

    path = str(tmp_path / "ext" / "cpuinfo-0123456789abcdef.json")
    first = cpu_info._cached(ask, path)
    assert first() == first() == {"arch": "X86_64", "flags": ["avx2"]} and len(asked) == 1
    assert cpu_info._cached(ask, path)() == {"arch": "X86_64", "flags": ["avx2"]} and len(asked) == 1  # its file
    with open(path, "w") as f:
        f.write('{"arch": "X86')  # cut short
    assert cpu_info._cached(ask, path)()["arch"] == "X86_64" and len(asked) == 2
    assert json.load(open(path)) == {"arch": "X86_64", "flags": ["avx2"]}  # rewritten whole
    failed = str(tmp_path / "failed.json")
    assert cpu_info._cached(dict, failed)() == {} and not os.path.exists(failed)  # a failed probe is not kept


# Loads the ops as a save does, counting py-cpuinfo's probes (each a new Python process); prints the count.
COUNTED_PROBES = """
import cpuinfo
probes = []
probe = cpuinfo.get_cpu_info_json
cpuinfo.get_cpu_info_json = lambda: probes.append(1) or probe()
from fastpersist_dist.storage.deepspeed_ops import aio_module, ensure_fast_file_writer_usable
aio_module()
ensure_fast_file_writer_usable()
print(len(probes))
"""


def test_loading_the_ops_probes_the_cpu_at_most_once_per_machine():
    """DeepSpeed asks py-cpuinfo at every op load (about a second each, twice for async_io) in every rank and
    writer process; the first load on a machine probes, the file in the ops cache answers the next ones."""
    counts = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", COUNTED_PROBES], capture_output=True, text=True, timeout=600,
                              cwd=REPO)
        assert proc.returncode == 0, proc.stderr[-4000:]
        counts.append(int(proc.stdout.split()[-1]))
    assert counts[0] <= 1 and counts[1] == 0, counts
