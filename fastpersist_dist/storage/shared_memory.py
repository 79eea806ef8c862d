"""Host buffers that the trainer fills and its writer process reads: memfd mappings.

A snapshot must be readable by the rank's persistent writer process, which was
started before the buffer existed, so an anonymous ``MAP_SHARED`` mapping (seen
only by processes forked after it) will not do. A memfd is shared by passing
its descriptor over a unix socket (``SCM_RIGHTS``), and, unlike a named file in
``/dev/shm``, it has no name to leak when the trainer is killed: its pages are
freed with the last process that maps it. Pages are allocated and mapped up
front, so that the first snapshot into a buffer copies at memory speed instead
of taking a page fault per 4 KiB: by the trainer, which writes them, for
writing (``MADV_POPULATE_WRITE``; ``MAP_POPULATE`` maps a shared mapping's pages
for reading only, and the first copy into a buffer so populated is still slower
than the next: scripts/snapshot_floor.py measures both); by the writer
process, which only reads them, for reading.
"""

from __future__ import annotations

import errno
import itertools
import logging
import mmap
import os

import torch

logger = logging.getLogger(__name__)

_IDS = itertools.count(1)
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14; Python's mmap names it from 3.13 on


def map_fd(fd: int, nbytes: int, for_writing: bool = False) -> tuple[mmap.mmap, torch.Tensor]:
    """Map ``nbytes`` of the memfd ``fd`` as a 1-D uint8 tensor, its pages populated for reading or ``for_writing``.

    A kernel without ``MADV_POPULATE_WRITE`` (before 5.14) gets the pages populated for reading.
    """
    size = max(nbytes, 1)
    if for_writing:
        mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        try:
            mapping.madvise(MADV_POPULATE_WRITE)
        except OSError as e:
            mapping.close()
            if e.errno != errno.EINVAL:  # ENOMEM, EFAULT: memory that MAP_POPULATE would leave to a SIGBUS later
                raise OSError(e.errno, f"cannot allocate {nbytes} bytes of shared host memory: {e.strerror}") from e
            logger.debug("fastpersist: MADV_POPULATE_WRITE unsupported (Linux < 5.14); pages populated for reading")
        else:
            return mapping, torch.frombuffer(mapping, dtype=torch.uint8)[:nbytes]
    mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    return mapping, torch.frombuffer(mapping, dtype=torch.uint8)[:nbytes]


class SharedBuffer:
    """``nbytes`` of shared host memory: ``tensor`` here, ``fd`` for another process to map.

    ``pinned``: also page-locked for the accelerator (device-to-host copies are
    asynchronous only into locked memory).
    """

    def __init__(self, nbytes: int, pinned: bool = False):
        self.id = (os.getpid(), next(_IDS))
        self.nbytes = nbytes
        self.fd = os.memfd_create(f"fastpersist-snapshot-{self.id[1]}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, max(nbytes, 1))
            self._mapping, self.tensor = map_fd(self.fd, nbytes, for_writing=True)
        except BaseException:
            os.close(self.fd)
            raise
        self._pinned = pinned and nbytes > 0 and torch.cuda.is_available()
        if self._pinned:  # CUDA's registration of existing host memory (tests/test_gpu.py; run on an H200)
            torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), nbytes, 0)

    def close(self) -> None:
        """Give the memory back (once no view of ``tensor`` is in use)."""
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self._pinned = False
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        # The mapping goes with the last tensor view of it (mmap refuses to close while exported).

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
