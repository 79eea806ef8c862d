"""Removing a checkpoint the way a training framework's retention does, without losing the newest durable one.

A framework keeps its last checkpoints (NeMo's ``save_top_k``, a cleanup
script) and removes an older one right after saving a newer one. With tiers
the newer one is then in the local tiers only: removed at once, the older one
would leave the run without a durable checkpoint until the drain ends, and a
node lost meanwhile would lose the run's progress. So a removal
(``background.remove_checkpoint``) runs on a thread of its own: it waits for
this process's copies to the persistent tier of the saves made before it was
asked for (an async save still being written included), then removes the
directory where the newest of those checkpoints is durable, or lies inside
the directory removed (a framework removing the checkpoint it just saved).
Otherwise (that save failed, or its copy to the persistent tier did) the
directory stays, and a warning names both. Where this process saved nothing to
a persistent tier there is nothing to wait for.

A save this process begins in the directory after the removal was asked for
(the same name saved again) keeps it, with a warning: the removal was of the
checkpoint that was there. The check and the removal hold the lock a save
takes to record its beginning (``SavesBegun``), so a save never begins in a
directory while it is being removed.

Commit markers go first (``remove_tree``): a removal cut short leaves files
that no loader takes for a checkpoint. Each node's local copy of a removed
checkpoint goes with that node's next local commit (``retention.py``).
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
from ...util.errors import FastPersistError
from .drain import Drain
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
    """Why ``job.path`` must stay (its drains done): None where removing it loses no durable checkpoint."""
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
    except FastPersistError as e:
        return f"the state of the newest checkpoint this process saved, {newest_dir}, cannot be read ({e})"
    if state == DURABLE:
        return None
    return (f"the newest checkpoint this process saved, {newest_dir}, is {state}, not durable (its copy to the "
            "persistent tier failed: see the errors logged), so it may hold the newest durable checkpoint")


def remove(job: Removal, begun: SavesBegun) -> None:
    """Remove ``job.path`` unless :func:`kept_because` says why not, or a save began in it since the removal was
    asked for (logged); its drains are done."""
    reason = kept_because(job)
    if reason is not None:
        logger.warning("fastpersist: %s was to be removed and is kept: %s; remove it once a newer checkpoint is "
                       "durable", job.path, reason)
        return
    with begun.lock:
        again = begun.since(job.path, job.asked)
        if again is not None:
            logger.warning("fastpersist: %s was to be removed and is kept: this process began saving into %s after "
                           "the removal was asked for, so it holds a newer checkpoint than the one to remove",
                           job.path, again)
            return
        try:
            persistent_dir(job.path).remove_tree(COMMIT_MARKERS)
        except FastPersistError as e:
            logger.error("fastpersist: %s was to be removed: %s", job.path, e)
            return
    newest = "" if job.newest is None else f", once {job.newest.checkpoint_dir} was durable"
    logger.info("fastpersist: removed %s%s (%.2f s after it was asked for)", job.path, newest,
                time.monotonic() - job.asked)
