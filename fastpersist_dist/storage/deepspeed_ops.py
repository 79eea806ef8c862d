"""Access to DeepSpeed's native ops: the ``async_io`` handle and the ``utils`` op.

Six traps of DeepSpeed 0.19 and the torch JIT build under it are handled here, once:

* On a CPU-only torch the accelerator maps ``UtilsBuilder`` to
  ``NotImplementedBuilder``, so ``FastFileWriter()`` raises. The generic
  ``deepspeed.ops.op_builder.utils.UtilsBuilder`` builds on any host, so we
  rebind the name FastFileWriter looks up to it, and only in that case.
* An aio handle created before ``fork`` hangs in the child: handles and their
  locked bounce buffers are cached per process id, so a forked writer always
  makes its own.
* With CUDA, its JIT build sorts ``TORCH_CUDA_ARCH_LIST`` numerically and fails
  on an architecture-specific entry such as ``9.0a`` ("invalid literal for
  int() with base 10: '0a'", seen on an H200 machine). Our ops are host C++
  with no device code, so they are built with the suffixes dropped
  (:func:`arch_list_without_suffixes`); the user's variable is restored after.
* ``TorchBackend.barrier`` and ``monitored_barrier`` take the world process
  group as a default argument, evaluated at DeepSpeed's import: imported after
  ``init_process_group``, DeepSpeed keeps the world group alive past
  ``destroy_process_group``. Its gloo threads then outlive the interpreter's
  finalization, and one that releases a finished collective's tensors there
  aborts the process at exit ("terminate called without an active
  exception"). Both methods read None as the world group, so
  :func:`import_deepspeed` puts None in the group's place.
* torch's JIT build waits without end on a build lock that a process killed
  while building left behind: ``build_locks`` clears such a lock, and bounds
  the wait for a live one.
* Every load of an op asks py-cpuinfo for the CPU (a new Python process, about
  a second, twice per load): ``cpu_info`` answers from a file per machine.

The ops are built (JIT, minutes) into ``<venv>/torch_ext`` unless the user's
``TORCH_EXTENSIONS_DIR`` says otherwise: one cache per virtualenv, also for a
process of one venv started from another's, so venvs of different torch or
megatron-core stacks never rebuild each other's ops.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import re
import resource
import sys
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from ..util.config import AioSettings
from . import cpu_info
from .build_locks import loading_ops

logger = logging.getLogger(__name__)

_AIO_MODULE: Optional[Any] = None
_AIO_ERROR: Optional[str] = None
_UTILS_LOADED = False


# Set with TORCH_EXTENSIONS_DIR when we chose it: a process of another venv started from
# ours inherits both, sees that the directory is ours and not the user's, and uses its own.
_CHOSEN_DIR_VAR = "FASTPERSIST_TORCH_EXT_DIR"


def use_venv_extension_cache() -> None:
    """Build and load native ops under this virtualenv unless the user set ``TORCH_EXTENSIONS_DIR``."""
    current = os.environ.get("TORCH_EXTENSIONS_DIR")
    if current is None or current == os.environ.get(_CHOSEN_DIR_VAR):
        ours = os.path.join(sys.prefix, "torch_ext")
        os.environ["TORCH_EXTENSIONS_DIR"] = os.environ[_CHOSEN_DIR_VAR] = ours


def arch_list_without_suffixes(arch_list: str) -> str:
    """``TORCH_CUDA_ARCH_LIST`` without the letter suffixes of architecture-specific targets ("9.0a" -> "9.0").

    Separators and ``+PTX`` are kept; DeepSpeed 0.19 parses each entry's
    "major.minor" as integers.
    """
    return re.sub(r"(\d+\.\d+)[a-z]+", r"\1", arch_list)


@contextmanager
def _arch_list_deepspeed_sorts() -> Iterator[None]:
    """Build DeepSpeed ops under an arch list its JIT build can sort (see module doc)."""
    name = "TORCH_CUDA_ARCH_LIST"
    current = os.environ.get(name)
    usable = arch_list_without_suffixes(current) if current else current
    if usable == current:
        yield
        return
    logger.debug("building DeepSpeed ops with %s=%r (was %r; they hold no device code)", name, usable, current)
    os.environ[name] = usable
    try:
        yield
    finally:
        os.environ[name] = current


@contextmanager
def _loading_ops() -> Iterator[None]:
    """Around DeepSpeed's load of an op: no wait on a build lock a dead process left (``build_locks``), an
    arch list its JIT build can sort, and the CPU's description from this machine's file."""
    who = f"rank {os.environ['RANK']} (pid {os.getpid()})" if "RANK" in os.environ else f"pid {os.getpid()}"
    ext_dir = os.environ["TORCH_EXTENSIONS_DIR"]
    with loading_ops(ext_dir, who), _arch_list_deepspeed_sorts(), cpu_info.answered_once(ext_dir):
        yield


@functools.cache
def import_deepspeed() -> None:
    """Import DeepSpeed without its reference to the world process group (see module doc).

    Every use of DeepSpeed here goes through this first; a forked child
    inherits the module as it was fixed.
    """
    from deepspeed.comm.torch import TorchBackend

    for name in ("barrier", "monitored_barrier"):
        method = inspect.unwrap(getattr(TorchBackend, name))
        group, *rest = method.__defaults__
        if isinstance(group, dist.ProcessGroup):
            method.__defaults__ = (None, *rest)


def aio_module() -> Any:
    """The built ``async_io`` extension (built on first use: minutes; prebuilt by scripts/setup.sh)."""
    global _AIO_MODULE, _AIO_ERROR
    use_venv_extension_cache()
    if _AIO_MODULE is None and _AIO_ERROR is None:
        try:
            import_deepspeed()
            from deepspeed.ops.op_builder import AsyncIOBuilder

            with _loading_ops():
                _AIO_MODULE = AsyncIOBuilder().load(verbose=False)
        except Exception as e:  # noqa: BLE001 - any build/load failure means "no aio"
            _AIO_ERROR = f"{type(e).__name__}: {e}{_libaio_hint()}"
    if _AIO_MODULE is None:
        raise RuntimeError(f"DeepSpeed async_io op unavailable ({_AIO_ERROR})")
    return _AIO_MODULE


def _libaio_hint() -> str:
    """After a failed build: the libaio advice where DeepSpeed's own check finds no libaio, else nothing.

    The advice alone misled when the build failed for another reason (the arch
    list above, with libaio installed).
    """
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        found = AsyncIOBuilder().is_compatible(verbose=False)  # compiles and links a call of io_submit
    except Exception:  # noqa: BLE001 - no answer: give the advice
        found = False
    return "" if found else "; DeepSpeed finds no libaio: is libaio-dev installed?"


def aio_available() -> bool:
    """Whether the ``async_io`` op can be loaded in this environment."""
    try:
        aio_module()
        return True
    except RuntimeError:
        return False


def ensure_fast_file_writer_usable() -> None:
    """Make ``deepspeed.io.FastFileWriter`` constructible on CPU-only torch (see module doc)."""
    import_deepspeed()
    from deepspeed.io import fast_file_writer
    from deepspeed.ops.op_builder.cpu.no_impl import NotImplementedBuilder

    use_venv_extension_cache()
    current = fast_file_writer.UtilsBuilder
    if isinstance(current, type) and issubclass(current, NotImplementedBuilder):
        from deepspeed.ops.op_builder.utils import UtilsBuilder

        fast_file_writer.UtilsBuilder = UtilsBuilder
        logger.debug("FastFileWriter: using the generic UtilsBuilder (accelerator has none)")
    global _UTILS_LOADED
    if not _UTILS_LOADED:  # DeepSpeed keeps the loaded op; a forked child inherits it and this flag
        with _loading_ops():
            fast_file_writer.UtilsBuilder().load(verbose=False)
        _UTILS_LOADED = True


class LockedMemoryError(RuntimeError):
    """The bounce buffer cannot be page-locked under this process's RLIMIT_MEMLOCK."""


def _check_memlock(nbytes: int) -> None:
    """DeepSpeed's locked allocation fails (returning NULL) past RLIMIT_MEMLOCK: say so up front.

    root (CAP_IPC_LOCK) is not limited; GPU clusters usually set the limit to
    unlimited for RDMA, desktops often leave it at 8 MiB.
    """
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if os.geteuid() != 0 and soft != resource.RLIM_INFINITY and soft < nbytes:
        raise LockedMemoryError(
            f"the {nbytes >> 20} MiB bounce buffer exceeds RLIMIT_MEMLOCK ({soft >> 20} MiB): "
            "raise it (ulimit -l unlimited, or LimitMEMLOCK= in systemd/containers) or lower io_buffer_mb"
        )


def _skip_offload_endurance_warning() -> None:
    """Mark DeepSpeed's once-per-process NVMe endurance warning as shown.

    Its native op logs it at the first aio write of every process (each forked
    writer too); it is advice about ZeRO-Infinity offloading, which rewrites the
    drive continuously, not about a checkpoint written every N steps.
    """
    import deepspeed.utils

    deepspeed.utils._deepspeed_nvme_write_warning_emitted = True  # the marker its C++ side checks


class AioResources:
    """An aio handle and its page-locked bounce buffer, owned by one process."""

    def __init__(self, settings: AioSettings):
        mod = aio_module()
        _check_memlock(settings.buffer_bytes)
        _skip_offload_endurance_warning()
        self.settings = settings
        self.handle = mod.aio_handle(
            settings.block_size, settings.queue_depth, False, True, settings.intra_op_parallelism
        )
        align = self.handle.get_alignment()
        # The double buffer needs each half aligned.
        size = max(2 * align, settings.buffer_bytes // (2 * align) * (2 * align))
        self.buffer = self.handle.new_cpu_locked_tensor(size, torch.empty(0, dtype=torch.uint8))


_RESOURCES: dict[tuple[int, AioSettings], AioResources] = {}
# Handles inherited over fork: kept referenced forever, since destroying one in the
# child would join worker threads that do not exist there.
_INHERITED: list[AioResources] = []


def aio_resources(settings: AioSettings) -> AioResources:
    """This process's aio handle + bounce buffer for ``settings``, created on first use."""
    key = (os.getpid(), settings)
    res = _RESOURCES.get(key)
    if res is None:
        for stale in [k for k in _RESOURCES if k[0] != os.getpid()]:
            _INHERITED.append(_RESOURCES.pop(stale))
        res = _RESOURCES[key] = AioResources(settings)
    return res
