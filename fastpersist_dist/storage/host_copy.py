"""The snapshot copy of an async save: host to host with streaming (non-temporal) stores.

A steady async save call is mostly this copy (docs/async.md), and an ordinary
copy reads every destination cache line before overwriting it (read for
ownership): three bytes of memory traffic per byte copied instead of two, and a
snapshot of several GiB flushed through the caches the training loop uses.
glibc's ``memcpy`` switches to streaming stores only for single copies above its
non-temporal threshold (hundreds of MiB, set from the cache size), far above a snapshot's
records (a few MiB each), and torch's ``copy_`` never does. So a 30-line C
routine (``stream_copy.c``) does it, compiled with the system's C compiler on
first use (``load_ops`` does that at start-up) and cached by its source's hash,
as DeepSpeed builds its ops (docs/async.md has the copy's measured cost).

Where it cannot be built (not x86-64, no compiler) the copy is torch's ``copy_``,
with one warning; so is any copy it does not apply to (a device or strided
tensor, a conjugate or negative view).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import torch

logger = logging.getLogger(__name__)

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stream_copy.c")


def _cache_dir() -> str:
    """Where built routines are kept: ``$XDG_CACHE_HOME/fastpersist_dist`` (default ``~/.cache``)."""
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fastpersist_dist")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def _remove_partial_builds(path: str) -> None:
    """Remove what builds of ``path`` by processes that died compiling left (``<path>.<pid>.tmp``).

    They never stand in the way (each build writes a file of its own and
    renames it over ``path``), but would pile up in the user's cache.
    """
    directory, name = os.path.split(path)
    for entry in os.listdir(directory):
        pid = entry[len(name) + 1 : -len(".tmp")]
        if entry.startswith(f"{name}.") and entry.endswith(".tmp") and pid.isdigit() and not _alive(int(pid)):
            try:
                os.remove(os.path.join(directory, entry))
            except FileNotFoundError:
                pass


def _build(compiler: str, source: bytes, path: str) -> None:
    """Compile ``source`` into the shared library ``path``, atomically (ranks of a node may race)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    _remove_partial_builds(path)
    partial = f"{path}.{os.getpid()}.tmp"
    try:
        subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-x", "c", "-", "-o", partial],
                       input=source, capture_output=True, check=True, timeout=120)
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)


@functools.cache
def _routine() -> Optional[Callable[[int, int, int], None]]:
    """The built ``fastpersist_stream_copy``, built now unless cached; None where it cannot be."""
    if platform.machine() not in ("x86_64", "AMD64"):
        logger.debug("fastpersist: snapshots are copied with torch's copy_ (no streaming copy for %s)",
                     platform.machine())
        return None
    with open(_SOURCE, "rb") as f:
        source = f.read()
    compiler = os.environ.get("CC", "cc")
    path = os.path.join(_cache_dir(), f"stream_copy-{hashlib.sha256(source + compiler.encode()).hexdigest()[:16]}.so")
    try:
        if not os.path.exists(path):
            _build(compiler, source, path)
        routine = ctypes.CDLL(path).fastpersist_stream_copy  # CDLL releases the GIL during calls
    except (OSError, subprocess.SubprocessError) as e:
        detail = e.stderr.decode(errors="replace").strip() if isinstance(e, subprocess.CalledProcessError) else e
        logger.warning("fastpersist: cannot build the streaming copy %s with %r (%s); async snapshots are "
                       "copied with torch's copy_, slower", path, compiler, detail)
        return None
    routine.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    routine.restype = None
    return routine


def prepare() -> bool:
    """Build (or find) the streaming copy now rather than in the first snapshot; whether it is there."""
    return _routine() is not None


def _streamable(dest: torch.Tensor, source: torch.Tensor) -> bool:
    return (dest.device.type == source.device.type == "cpu" and dest.is_contiguous() and source.is_contiguous()
            and dest.dtype == source.dtype and dest.shape == source.shape
            and not (source.is_conj() or source.is_neg()))


def copy_to_host(dest: torch.Tensor, source: torch.Tensor) -> bool:
    """``dest.copy_(source)`` for a host ``dest`` of ``source``'s shape and dtype, streaming where it can;
    whether the streaming routine copied (False: torch's ``copy_``)."""
    routine = _routine() if _streamable(dest, source) else None
    if routine is None:
        dest.copy_(source)
        return False
    if source.numel():
        routine(dest.data_ptr(), source.data_ptr(), source.numel() * source.element_size())
    return True


@contextmanager
def copies_on_this_thread() -> Iterator[None]:
    """Run FastFileWriter's bounce-buffer fills (torch ``copy_``) on the calling thread alone.

    torch's intra-op pool spins for as much CPU again as a large copy takes,
    beside the checksum thread, where one thread copies about as fast (compare
    with scripts/writer_ab.py). A synchronous save blocks the trainer, so the
    process-wide setting is restored before anything else runs.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
