"""py-cpuinfo's answer, asked once per machine instead of at every load of a DeepSpeed op.

DeepSpeed's op builders ask ``cpuinfo.get_cpu_info()`` for the architecture
and SIMD flags at every load of an op, built or not: the compiler flags they
derive are what torch compares with the build's. py-cpuinfo answers by
running a new Python process that probes the CPU (about a second), twice per
load of ``async_io``, in every process that writes or reads a checkpoint (each
rank, each forked writer): seconds added to a job's first save. Its answer
depends only on the CPU, so while ops load, :func:`answered_once` serves it
from a file in the ops cache named after this machine's CPU identity
(``/proc/cpuinfo``'s vendor, model and flags), asking py-cpuinfo only when no
file matches. A machine of another CPU sharing the cache gets its own file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

from .files import unlink_quietly

logger = logging.getLogger(__name__)

# The lines of /proc/cpuinfo that identify what a compiler targets; clock speed and bogomips vary.
_IDENTITY_FIELDS = ("vendor_id", "model name", "flags", "Features", "CPU implementer", "CPU part", "cpu")


def cpu_identity(proc_cpuinfo: str, machine: str) -> str:
    """A short key for a CPU: the machine type and the identifying fields of its first processor."""
    first = proc_cpuinfo.split("\n\n", 1)[0]
    fields = sorted(line.strip() for line in first.splitlines() if line.split(":", 1)[0].strip() in _IDENTITY_FIELDS)
    return hashlib.sha256("\n".join([machine, *fields]).encode()).hexdigest()[:16]


def _cache_path(ext_dir: str) -> Optional[str]:
    """This machine's answer file in ``ext_dir``; None where the CPU cannot be identified (no /proc)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    return os.path.join(ext_dir, f"cpuinfo-{cpu_identity(text, platform.machine())}.json")


def _cached(ask: Callable[[], dict], path: Optional[str]) -> Callable[[], dict]:
    """``ask`` answered from ``path`` when it holds an answer, else asked once and written there."""
    answer: dict[str, Any] = {}

    def get_cpu_info() -> dict:
        if answer:
            return dict(answer)
        if path is not None:
            try:
                with open(path, encoding="utf-8") as f:
                    answer.update(json.load(f))
                return dict(answer)
            except (OSError, ValueError):
                pass
        fresh = ask()
        if fresh and path is not None:  # py-cpuinfo returns {} when its probe failed: not kept
            # A temp name per process, not storage.files.atomic_write's one: a node's ranks write it at once.
            tmp = f"{path}.{os.getpid()}.tmp"
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(tmp, "w", encoding="utf-8") as f:
                    json.dump(fresh, f)
                os.replace(tmp, path)
            except OSError as e:
                unlink_quietly(tmp)
                logger.debug("cpu info not cached in %s: %s", path, e)
        answer.update(fresh)
        return dict(fresh)

    return get_cpu_info


@contextmanager
def answered_once(ext_dir: str) -> Iterator[None]:
    """While DeepSpeed loads ops: ``cpuinfo.get_cpu_info`` answered from this machine's file in ``ext_dir``."""
    try:
        import cpuinfo
    except ImportError:  # DeepSpeed then asks lscpu itself
        yield
        return
    original = cpuinfo.get_cpu_info
    cpuinfo.get_cpu_info = _cached(original, _cache_path(ext_dir))
    try:
        yield
    finally:
        cpuinfo.get_cpu_info = original
