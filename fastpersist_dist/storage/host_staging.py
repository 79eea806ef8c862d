"""Reused host memory for the copies a synchronous write makes of records that are not host bytes.

A write copies accelerator tensors and strided views to the host as it reaches
them (storage/writer.py). Into fresh memory every copy paid a page fault per
4 KiB, and a GPU's copy into pageable memory also passes through the CPU. So
the copies go into one block per process, allocated and mapped once
(page-locked when it serves an accelerator: the copy is then the device's DMA
alone), used as a ring: regions are taken in the order the write reaches the
records and given back in the same order once written and checksummed. The
block stays for the process's next save; a forked child never writes its
parent's (the mapping is shared), and a write that finds the block in use by
another copies into fresh memory as before.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from contextlib import contextmanager
from typing import Iterator, Optional

import torch

from .shared_memory import SharedBuffer

logger = logging.getLogger(__name__)

ALIGN = 64  # every region starts here, so a region can be viewed as any dtype


class Ring:
    """Regions of ``capacity`` bytes, taken and given back first in, first out (offsets only: no memory)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._held: deque[tuple[int, int]] = deque()  # (start, end), oldest first

    def take(self, nbytes: int) -> Optional[int]:
        """The offset of ``nbytes`` (> 0) free bytes after the newest region, wrapping to 0; None while held."""
        size = -(-nbytes // ALIGN) * ALIGN
        start = self._free_start(size)
        if start is not None:
            self._held.append((start, start + size))
        return start

    def give_back_oldest(self) -> None:
        self._held.popleft()

    def _free_start(self, size: int) -> Optional[int]:
        if size > self.capacity:
            return None
        if not self._held:
            return 0
        first, end = self._held[0][0], self._held[-1][1]
        if end > first:  # not wrapped: after the newest region, else from 0 up to the oldest
            if end + size <= self.capacity:
                return end
            return 0 if size <= first else None
        return end if end + size <= first else None  # wrapped: between the newest and the oldest


_LOCK = threading.Lock()
_BLOCKS: dict[int, tuple[bool, SharedBuffer]] = {}  # by process id: (page-locked, block)


@contextmanager
def staging_block(capacity: int, pinned: bool) -> Iterator[Optional[torch.Tensor]]:
    """This process's block of ``capacity`` bytes (``pinned``: page-locked) for one write; None while another has it."""
    if not _LOCK.acquire(blocking=False):
        yield None
        return
    try:
        pid = os.getpid()
        kept = _BLOCKS.get(pid)
        if kept is None or kept[1].nbytes != capacity or (pinned and not kept[0]):
            if kept is not None:
                kept[1].close()
            kept = _BLOCKS[pid] = (pinned, SharedBuffer(capacity, pinned=pinned))
            logger.debug("fastpersist: host copies of synchronous writes go through a reused block of %d MiB%s",
                         capacity >> 20, " (page-locked)" if pinned else "")
        yield kept[1].tensor
    finally:
        _LOCK.release()
