"""Where a rank's data file's bytes go: DeepSpeed's ``FastFileWriter`` (O_DIRECT, libaio, a page-locked double
bounce buffer) over this process's aio handle, or plain buffered writes with the same bytes.

``FastFileWriter``'s traps are handled here and in ``storage/writer.py``: it
opens without ``O_TRUNC`` (the writer unlinks first), and some filesystems
refuse O_DIRECT (a buffered sink then, once warned). On an in-memory filesystem
(tmpfs: ``/dev/shm`` as a local tier) O_DIRECT is a memory copy like any other
and the bounce one more, so files there are written buffered, straight from the
tensors' bytes.
"""

from __future__ import annotations

import errno
import logging
import os
from typing import Protocol

import torch

from ..util.config import WriteConfig
from ..util.errors import FastPersistError
from .deepspeed_ops import LockedMemoryError, aio_available, aio_module, aio_resources, ensure_fast_file_writer_usable
from .mounts import on_memory_filesystem

logger = logging.getLogger(__name__)

MODE_DIRECT = "direct"
MODE_BUFFERED = "buffered"
_warned: set[object] = set()


class Sink(Protocol):
    mode: str

    def write(self, data: torch.Tensor) -> None:
        """Append a 1-D uint8 host tensor."""

    def close(self) -> None:
        """Flush everything and fsync the file."""


class _DirectSink:
    """FastFileWriter over this process's aio handle and bounce buffer."""

    mode = MODE_DIRECT

    def __init__(self, path: str, cfg: WriteConfig):
        from deepspeed.io import FastFileWriter, FastFileWriterConfig

        ensure_fast_file_writer_usable()
        res = aio_resources(cfg.aio)
        self._writer = FastFileWriter(
            path,
            FastFileWriterConfig(
                dnvme_handle=res.handle, pinned_tensor=res.buffer, double_buffer=cfg.double_buffer
            ),
        )

    def write(self, data: torch.Tensor) -> None:
        # A storage slice is a zero-copy view of exactly these bytes; save_size=False
        # avoids DeepSpeed's freed-size-tensor bug.
        start = data.storage_offset()
        storage = data.untyped_storage()[start : start + data.numel()]
        self._writer.save_torch_storage_object_list([(storage, torch.uint8)], False)

    def close(self) -> None:
        self._writer.close()


class _BufferedSink:
    """Plain buffered writes + fsync: same bytes, for filesystems without O_DIRECT (and tmpfs)."""

    mode = MODE_BUFFERED

    def __init__(self, path: str):
        self._file = os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), "wb", buffering=0)

    def write(self, data: torch.Tensor) -> None:
        view = memoryview(data.numpy())
        while view:
            view = view[self._file.write(view) :]

    def close(self) -> None:
        try:
            os.fsync(self._file.fileno())
        finally:
            self._file.close()


def _warn_once(key: object, reason: str) -> None:
    """One warning per cause (and per filesystem), not one per save."""
    if key not in _warned:
        _warned.add(key)
        logger.warning("fastpersist: falling back to buffered writes: %s", reason)


def preload_ops(cfg: WriteConfig) -> None:
    """Load the native ops here, so that a writer forked from this process inherits them.

    Loading takes seconds and a file lock under ~/.cache/torch_extensions; only
    the aio *handle* must be made by the writer itself.
    """
    if cfg.direct_io != "off" and aio_available():
        ensure_fast_file_writer_usable()


def prepare_direct_writes(cfg: WriteConfig) -> None:
    """Make this process's aio handle and locked bounce buffer for ``cfg`` now, not in its first write.

    For the async writer process, before it serves: made inside the first job,
    they would delay that save while a training loop keeps the cores busy.
    Never in a trainer that may fork (a handle made before ``fork`` hangs in
    the child). What fails here fails again in the write, which falls back
    or raises with the cause.
    """
    if cfg.direct_io == "off" or not aio_available():
        return
    try:
        aio_resources(cfg.aio)
    except (RuntimeError, OSError) as e:  # LockedMemoryError too: the write warns and falls back, or raises
        logger.debug("fastpersist: aio handle and bounce buffer not made ahead (%s); the first write says why", e)


def _buffered_by_choice(directory: str, cfg: WriteConfig) -> bool:
    """Whether files in ``directory`` are written buffered whatever the system offers (asked to, or tmpfs)."""
    return cfg.direct_io == "off" or (cfg.direct_io == "auto" and on_memory_filesystem(directory))


def open_sink(path: str, cfg: WriteConfig) -> Sink:
    if _buffered_by_choice(os.path.dirname(path) or ".", cfg):
        return _BufferedSink(path)  # on tmpfs: one copy from the tensors into the files' pages, no bounce
    try:
        aio_module()
    except RuntimeError as e:
        if cfg.direct_io == "on":
            raise FastPersistError(f"direct_io='on' but {e}") from e
        _warn_once("no-aio", str(e))
        return _BufferedSink(path)
    try:
        return _DirectSink(path, cfg)
    except LockedMemoryError as e:
        if cfg.direct_io == "on":
            raise FastPersistError(f"direct_io='on' but {e}") from e
        _warn_once("memlock", str(e))
        return _BufferedSink(path)
    except OSError as e:
        if e.errno != errno.EINVAL or cfg.direct_io == "on":
            raise
        directory = os.path.dirname(path) or "."
        _warn_once(("no-o-direct", os.stat(directory).st_dev), f"the filesystem of {directory} refuses O_DIRECT ({e.strerror})")
        return _BufferedSink(path)
