"""Where a report's figures were measured, as the tool reads it: the machine, the storage of each benchmark
directory, the software versions, the date and the checkout's commit (never typed by hand)."""

from __future__ import annotations

import datetime
import importlib.metadata
import logging
import os
import platform
import socket
import subprocess
from typing import Any, Optional

from ...storage.mounts import describe_filesystem, mounted_filesystem

logger = logging.getLogger(__name__)

# distribution name -> the key the report stores its version under
DISTRIBUTIONS = {"torch": "torch", "megatron-core": "megatron_core", "deepspeed": "deepspeed",
                 "fastpersist-dist": "fastpersist_dist"}


def utc_now() -> str:
    """This instant in UTC, ISO 8601 to the second (``2026-12-07T14:03:12Z``)."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _proc_field(path: str, name: str) -> Optional[str]:
    """The value of the first ``name: value`` line of a /proc file, or None where there is none."""
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == name:
                    return value.strip()
    except OSError:
        return None
    return None


def machine(gpus: list[str]) -> dict[str, Any]:
    """The host: its name, CPU model, cores (all, and those this process may run on), memory and ``gpus``."""
    memory_kb = _proc_field("/proc/meminfo", "MemTotal")
    return {
        "hostname": socket.gethostname(),
        "cpu_model": _proc_field("/proc/cpuinfo", "model name") or platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)),
        "memory_bytes": int(memory_kb.split()[0]) * 1024 if memory_kb else None,
        "gpus": gpus,
    }


def gpu_names() -> list[str]:
    """The CUDA devices' names (none on a host). Initializes CUDA in this process: only once no rank is forked
    any more (a forked rank cannot use CUDA its parent initialized)."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def _mount_source(point: str) -> Optional[str]:
    """The device (mountinfo's source) mounted at ``point``: the last mount listed there, the one on top."""
    source = None
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split(" ")
                after = line.split(" - ", 1)[1].split(" ") if " - " in line else []
                if len(fields) > 4 and len(after) > 1 and fields[4] == point:
                    source = after[1]
    except OSError:
        return None
    return source


def storage(path: str) -> dict[str, Any]:
    """What holds the benchmark directory ``path``: its filesystem (as the benchmarks' reports describe it),
    type, mount point and device."""
    mount = mounted_filesystem(path)
    return {"path": os.path.abspath(path), "filesystem": describe_filesystem(path),
            "type": mount.fstype if mount else None, "mount": mount.point if mount else None,
            "device": _mount_source(mount.point) if mount else None}


def versions() -> dict[str, Optional[str]]:
    """Python's and the installed distributions' versions (None for one not installed)."""
    found: dict[str, Optional[str]] = {"python": platform.python_version()}
    for distribution, key in DISTRIBUTIONS.items():
        try:
            found[key] = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            found[key] = None
    return found


def _git(root: str, *args: str) -> Optional[str]:
    try:
        proc = subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        logger.warning("report: git %s in %s failed: %s", " ".join(args), root, e)
        return None
    return proc.stdout if proc.returncode == 0 else None


def commit(root: str) -> Optional[dict[str, Any]]:
    """The commit checked out at ``root`` and whether tracked files differ from it (``dirty``); None outside a
    git checkout."""
    sha = _git(root, "rev-parse", "HEAD")
    if sha is None:
        return None
    status = _git(root, "status", "--porcelain", "--untracked-files=no")
    return {"sha": sha.strip(), "dirty": bool(status and status.strip())}
