"""The snapshot's streaming copy (storage/host_copy.py): built here, byte-exact, and torch's copy where it must be."""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys

import pytest
import torch

from fastpersist_dist.storage import host_copy, shared_memory
from fastpersist_dist.storage.shared_memory import SharedBuffer
from fastpersist_dist.tools.ranks import run_ranks

pytestmark = pytest.mark.engine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


_BUILD = """
import json, os, sys
from fastpersist_dist.storage import host_copy
assert host_copy.prepare()
print(json.dumps(sorted(os.listdir(os.path.join(sys.argv[1], "fastpersist_dist")))))
"""


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the streaming copy is built for x86-64 only")
def test_streaming_copy_is_built_on_x86_64_into_the_cache(tmp_path):
    """Built from the source with the system's compiler (into an empty cache), then loaded."""
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path), PYTHONPATH=ROOT, PYTHONWARNINGS="ignore")
    env.pop("CC", None)
    run = subprocess.run([sys.executable, "-c", _BUILD, str(tmp_path)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    built = json.loads(run.stdout.strip().splitlines()[-1])  # the cache's listing, printed by the child
    assert len(built) == 1 and built[0].startswith("stream_copy-") and built[0].endswith(".so"), built
    assert host_copy.prepare()  # and here (this process's cache may hold it already)


# The copies run in a forked rank: tensors this large start torch's OpenMP pool, and a pytest
# process whose pool is up forks ranks that hang in their own parallel work (test_async.py).


# Where the streaming copy can be built, the byte-exact tests check it did the copies, not torch's fallback.
STREAMS = platform.machine() in ("x86_64", "AMD64")


def _byte_exact(rank: int, world: int, nbytes: int) -> None:
    gen = torch.Generator().manual_seed(nbytes)
    for src_off in range(3):
        for dest_off in range(3):
            source = torch.randint(0, 256, (nbytes + src_off,), dtype=torch.uint8, generator=gen)[src_off:]
            dest = torch.zeros(nbytes + dest_off + 1, dtype=torch.uint8)
            assert host_copy.copy_to_host(dest[dest_off : dest_off + nbytes], source) == STREAMS
            assert torch.equal(dest[dest_off : dest_off + nbytes], source), (nbytes, src_off, dest_off)
            assert dest[dest_off + nbytes] == 0, "wrote past the end"


@pytest.mark.parametrize("nbytes", [0, 1, 15, 16, 17, 63, 64, 65, 127, 4096 + 7, (3 << 20) + 5])
def test_copy_is_byte_exact_at_any_size_and_alignment(nbytes):
    """Every misalignment of source and destination: the aligned head, the 64-byte body and the tail."""
    run_ranks(1, _byte_exact, nbytes)


def _into_shared_buffer(rank: int, world: int, dtype: torch.dtype) -> None:
    source = (torch.randn(257, 129) * 100).to(dtype)
    buffer = SharedBuffer(source.numel() * source.element_size())
    try:
        dest = buffer.tensor.view(dtype).view(source.shape)
        assert host_copy.copy_to_host(dest, source) == STREAMS
        assert torch.equal(dest, source)
    finally:
        del dest
        buffer.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool])
def test_copy_into_shared_buffer_keeps_values(dtype):
    run_ranks(1, _into_shared_buffer, dtype)


def _mapping_kib(address: int) -> dict[str, int]:
    """Rss and dirty KiB of this process's mapping that holds ``address`` (/proc/self/smaps)."""
    with open("/proc/self/smaps") as f:
        for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", f.read()):
            low, high = (int(x, 16) for x in block.split(None, 1)[0].split("-"))
            if low <= address < high:
                fields = dict((k, int(v)) for k, v in re.findall(r"^(\w+):\s+(\d+) kB", block, re.M))
                return {"rss": fields["Rss"], "dirty": fields["Shared_Dirty"] + fields["Private_Dirty"]}
    raise AssertionError(f"no mapping holds {address:#x}")


_KERNEL = tuple(int(x) for x in re.findall(r"\d+", platform.release())[:2])


@pytest.mark.skipif(_KERNEL < (5, 14), reason="MADV_POPULATE_WRITE needs Linux 5.14")
def test_a_snapshot_buffer_is_populated_for_writing():
    """Every page resident and already written-to (dirty) before the first copy, which then takes no fault per page."""
    buffer = SharedBuffer(8 << 20)
    try:
        assert _mapping_kib(buffer.tensor.data_ptr()) == {"rss": 8 << 10, "dirty": 8 << 10}
    finally:
        buffer.close()


def test_without_populate_write_a_buffer_is_populated_for_reading(monkeypatch):
    """A kernel that refuses the advice (EINVAL, as before 5.14; here an advice no kernel has) still maps every page."""
    monkeypatch.setattr(shared_memory, "MADV_POPULATE_WRITE", 0x7FFF)
    buffer = SharedBuffer(8 << 20)
    try:
        assert _mapping_kib(buffer.tensor.data_ptr()) == {"rss": 8 << 10, "dirty": 0}
        pages = buffer.tensor[:: 4096]  # one byte per page: too few elements to start torch's thread pool here
        pages.fill_(7)
        assert pages.tolist() == [7] * (2 << 10)
    finally:
        buffer.close()


def test_strided_and_conjugate_sources_are_copied_as_values():
    """Not streamable (their bytes are not their values in order): torch's copy_ resolves them."""
    strided = torch.randn(64, 33).t()
    dest = torch.empty(strided.shape)
    assert not host_copy.copy_to_host(dest, strided)
    assert torch.equal(dest, strided)
    conj = torch.randn(100, dtype=torch.complex64).conj()
    dest = torch.empty(100, dtype=torch.complex64)
    assert not host_copy.copy_to_host(dest, conj)
    assert torch.equal(dest, conj.resolve_conj())
    negative = torch.randn(100, dtype=torch.complex64).conj().imag
    dest = torch.empty(100)
    assert not host_copy.copy_to_host(dest, negative)
    assert torch.equal(dest, negative.resolve_neg())


_WITHOUT_COMPILER = """
import logging, torch
logging.basicConfig(level=logging.WARNING, format="%(message)s")
from fastpersist_dist.storage import host_copy
assert not host_copy.prepare()
source = torch.arange(1000, dtype=torch.float32)
dest = torch.empty(1000)
assert not host_copy.copy_to_host(dest, source)  # torch's copy_
assert torch.equal(dest, source)
print("copied")
"""


def test_without_a_compiler_the_copy_is_torchs_with_one_warning(tmp_path):
    env = dict(os.environ, CC=str(tmp_path / "no-such-cc"), XDG_CACHE_HOME=str(tmp_path / "cache"),
               PYTHONPATH=ROOT, PYTHONWARNINGS="ignore")
    run = subprocess.run([sys.executable, "-c", _WITHOUT_COMPILER], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().endswith("copied")
    if platform.machine() == "x86_64":
        warnings = [line for line in run.stderr.splitlines() if "cannot build the streaming copy" in line]
        assert len(warnings) == 1 and "no-such-cc" in warnings[0] and "copy_" in warnings[0], run.stderr
