"""Removing a checkpoint the way a training framework's retention does, without losing the newest durable one.

A removal waits for this process's drains of the saves made before it was asked for, then removes the directory
only where the newest of those checkpoints is durable (or lies inside it); a save begun in the directory since
keeps it. Commit markers go first, so a removal cut short leaves nothing taken for a checkpoint. A persistent
tier out of reach is tried again for the newest drain's ``retry_s``, each try taking the saves' lock anew.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Optional

from ...format.kinds import MEGATRON_CONFIG_FILE
from ...format.tiers import DURABLE, TIERED_MARKERS
from ...storage.persistent import checkpoint_url, persistent_dir
from ...util.config import TierConfig
from ...util.errors import CorruptCheckpointError, FastPersistError
from .drain import Drain, retrying
from .state import checkpoint_state

logger = logging.getLogger(__name__)

# Removed before anything else of a checkpoint: what makes a directory a checkpoint to megatron and to us.
COMMIT_MARKERS = frozenset({*TIERED_MARKERS, MEGATRON_CONFIG_FILE})


@dataclass(frozen=True)
class Removal:
    """One directory to remove once that loses no durable checkpoint."""

    path: str  # as checkpoint_url gives it
    after: tuple[Drain, ...]  # this process's drains not finished when the removal was asked for: waited for
    newest: Optional[Drain]  # the last drain queued before it: this process's newest checkpoint on a persistent tier
    asked: float  # time.monotonic() of the request


def _inside(checkpoint_dir: str, path: str) -> bool:
    """Whether ``checkpoint_dir`` is ``path`` or lies in it."""
    return checkpoint_dir == path or checkpoint_dir.startswith(path.rstrip("/") + "/")


class SavesBegun:
    """When this process began each save (``time.monotonic()``, by directory URL) that a removal still pending may
    have to respect, and the lock ordering a removal against a save beginning where it removes."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._at: dict[str, float] = {}

    def note(self, url: str, oldest: Optional[float]) -> None:
        """A save into ``url`` begins now; ``oldest``: when the oldest removal still pending was asked for (None:
        none is, and no earlier save matters any more). Hold the lock."""
        self._at = {u: t for u, t in self._at.items() if oldest is not None and t >= oldest}
        self._at[url] = time.monotonic()

    def since(self, path: str, asked: float) -> Optional[str]:
        """A directory in ``path`` (or ``path`` itself) a save began in after ``asked``, if any; hold the lock."""
        return next((u for u, t in self._at.items() if t >= asked and _inside(u, path)), None)


def kept_because(job: Removal) -> Optional[str]:
    """Why ``job.path`` must stay (its drains done): None where removing it loses no durable checkpoint. Raises
    ``FastPersistError`` where the persistent tier does not answer (tried again by :func:`remove`)."""
    newest = job.newest
    if newest is None:
        return None
    failed = newest.committed.exception()
    if failed is not None:
        return (f"the newest checkpoint this process saved to a persistent tier, {newest.checkpoint_dir}, was not "
                f"committed ({failed}), so {job.path} may hold the newest durable checkpoint")
    newest_dir = checkpoint_url(newest.checkpoint_dir)
    if _inside(newest_dir, job.path):
        return None
    try:
        state = checkpoint_state(newest_dir)
    except CorruptCheckpointError as e:
        return f"the state of the newest checkpoint this process saved, {newest_dir}, cannot be read ({e})"
    if state == DURABLE:
        return None
    return (f"the newest checkpoint this process saved, {newest_dir}, is {state}, not durable (its copy to the "
            "persistent tier failed: see the errors logged), so it may hold the newest durable checkpoint")


def remove(job: Removal, begun: SavesBegun) -> None:
    """Remove ``job.path`` unless :func:`kept_because` says why not, or a save began in it since the removal was
    asked for (logged); its drains are done. A persistent tier that does not answer is tried again for the newest
    drain's ``retry_s`` (see the module), then logged as an error."""
    retry_s = TierConfig.retry_s if job.newest is None else job.newest.retry_s
    try:
        reason = retrying(lambda: _remove_once(job, begun), retry_s, f"removing {job.path}")
    except (FastPersistError, ValueError) as e:  # ValueError: remove_tree refused the directory itself
        logger.error("fastpersist: %s was to be removed: %s", job.path, e)
        return
    if reason is not None:
        logger.warning("fastpersist: %s was to be removed and is kept: %s", job.path, reason)
        return
    newest = "" if job.newest is None else f", once {job.newest.checkpoint_dir} was durable"
    logger.info("fastpersist: removed %s%s (%.2f s after it was asked for)", job.path, newest,
                time.monotonic() - job.asked)


def _remove_once(job: Removal, begun: SavesBegun) -> Optional[str]:
    """One try of :func:`remove`: why ``job.path`` is kept, or None where it is removed; raises
    ``FastPersistError`` where the persistent tier does not answer (tried again), ``ValueError`` where
    ``remove_tree`` refuses the directory (not)."""
    reason = kept_because(job)
    if reason is not None:
        return f"{reason}; remove it once a newer checkpoint is durable"
    with begun.lock:
        again = begun.since(job.path, job.asked)
        if again is not None:
            return (f"this process began saving into {again} after the removal was asked for, so it holds a newer "
                    "checkpoint than the one to remove")
        persistent_dir(job.path).remove_tree(COMMIT_MARKERS)
    return None
