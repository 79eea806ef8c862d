"""Retired data files kept for the next save on an in-memory filesystem: their pages are written again, not freed
and allocated again.

On tmpfs (``/dev/shm``) writing a new file allocates every page, and removing
an old one frees every page: both are kernel work on the cores the training
uses, which overwriting a file in place does not do (docs/tiers.md, the local
tier's write path, has the benchmark's figures). A node's local tier in memory retires a checkpoint's copy at every save beyond
``keep_local``; its data files are moved into :data:`POOL_DIR` (a rename)
instead of removed, at most as many as a copy of the node holds (its ranks'
files and the replicas it keeps for other nodes), and each rank's next write
(``storage/writer.py``) and each replica received (``storage/copy.py``'s
``AtomicFile``) takes one (a rename again: one taker per file), overwrites it
and cuts it to its new length. A file
in the pool belongs to no checkpoint: nothing reads it, and the process that
retired it removes it when it exits (:func:`empty_pools`, after its
background work).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import uuid
from typing import Iterable

from .files import unlink_quietly

logger = logging.getLogger(__name__)

POOL_DIR = ".fastpersist_recycled"  # in a local tier's directory, beside its checkpoints' copies
_filled: set[str] = set()  # the pools this process retired files into


def pool_dir(local_dir: str) -> str:
    """The pool of retired data files of the local tier ``local_dir``."""
    return os.path.join(local_dir, POOL_DIR)


def retire(pool: str, paths: Iterable[str], limit: int) -> int:
    """Move the files ``paths`` into ``pool`` while it holds fewer than ``limit`` files; remove the others.

    Returns how many were kept.
    """
    os.makedirs(pool, exist_ok=True)
    _filled.add(pool)
    held = len(os.listdir(pool))
    kept = 0
    for path in paths:
        if held < limit:
            try:
                os.rename(path, os.path.join(pool, uuid.uuid4().hex))
                held, kept = held + 1, kept + 1
                continue
            except OSError as e:
                logger.debug("fastpersist: %s not kept for reuse: %s", path, e)
        unlink_quietly(path)
    return kept


def take(pool: str, path: str) -> bool:
    """Rename a file of ``pool`` to ``path`` (replacing it); whether there was one. Several processes may take
    from one pool at once: each file goes to one of them."""
    try:
        names = os.listdir(pool)
    except OSError:  # none yet
        return False
    for name in names:
        try:
            os.rename(os.path.join(pool, name), path)
            return True
        except OSError as e:  # another rank took it; anything else: a new file then
            if e.errno != errno.ENOENT:
                logger.debug("fastpersist: %s not reused: %s", os.path.join(pool, name), e)
    return False


def empty_pools() -> None:
    """Remove the files this process retired that no save took (at exit: nothing will)."""
    for pool in sorted(_filled):
        shutil.rmtree(pool, ignore_errors=True)
    _filled.clear()
