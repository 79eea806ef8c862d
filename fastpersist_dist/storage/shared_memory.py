"""Host buffers that the trainer fills and its writer process reads: memfd mappings.

A snapshot must be readable by the rank's persistent writer process, which was
started before the buffer existed, so an anonymous ``MAP_SHARED`` mapping (seen
only by processes forked after it) will not do. A memfd is shared by passing
its descriptor over a unix socket (``SCM_RIGHTS``), and, unlike a named file in
``/dev/shm``, it has no name to leak when the trainer is killed: its pages are
freed with the last process that maps it. Pages are allocated and mapped up
front (``MAP_POPULATE``): the first snapshot into a buffer then copies at
memory speed instead of taking a page fault per 4 KiB.
"""

from __future__ import annotations

import itertools
import logging
import mmap
import os

import torch

logger = logging.getLogger(__name__)

_IDS = itertools.count(1)


def map_fd(fd: int, nbytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    """Map ``nbytes`` of the memfd ``fd`` (populated) as a 1-D uint8 tensor."""
    mapping = mmap.mmap(fd, max(nbytes, 1), flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
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
            self._mapping, self.tensor = map_fd(self.fd, nbytes)
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
