"""Which local copies a node keeps: the newest ``keep_local`` and every copy something still needs (not durable
yet, the newest durable, still replicating, being read); a copy of a checkpoint the persistent tier no longer
holds goes whatever its age (docs/design.md, "Retention").
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

from ...format.kinds import MARKERS
from ...format.tiers import DURABLE, TIERS_FILE, TierManifest
from ...storage.files import unlink_quietly
from ...storage.persistent import PosixDir, persistent_dir
from ...util.config import TierConfig
from ...util.errors import FastPersistError
from .state import read_manifest

logger = logging.getLogger(__name__)

IN_USE_FILE = ".fastpersist_in_use"


@contextmanager
def reading(copy_dir: Optional[str]) -> Iterator[None]:
    """Hold ``copy_dir`` (a node's copy being read; None: nothing) against removal while the block runs."""
    if copy_dir is None or not os.path.isdir(copy_dir):
        yield
        return
    fd = os.open(os.path.join(copy_dir, IN_USE_FILE), os.O_RDONLY | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


def _remove_unless_read(path: str) -> bool:
    """Remove the copy at ``path`` unless a load holds it, its manifest first; whether it was removed."""
    try:
        fd = os.open(os.path.join(path, IN_USE_FILE), os.O_RDONLY | os.O_CREAT, 0o644)
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        unlink_quietly(os.path.join(path, TIERS_FILE))  # no longer a copy of anything, whatever is left of it
        shutil.rmtree(path, ignore_errors=True)
        return True
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Retention:
    """After a local commit, on its node's first rank: what :func:`retain` is run with."""

    config: TierConfig
    current: TierManifest


def retain(config: TierConfig, current: TierManifest, replicating: frozenset[str] = frozenset()) -> None:
    """Remove this node's local copies that are no longer kept (see the module); ``replicating``: the ids of the
    checkpoints whose replication this process has not finished."""
    copies = []
    for name in os.listdir(config.local_dir):
        path = os.path.join(config.local_dir, name)
        if not os.path.isdir(path):
            continue
        try:
            manifest = read_manifest(PosixDir(path))
        except FastPersistError:
            continue  # a damaged copy is no copy to count: left for a person to look at
        if manifest is not None:
            copies.append((manifest.created, path, manifest))
    copies.sort(reverse=True)
    held = {path: _held(m) for _, path, m in copies if m.checkpoint_id != current.checkpoint_id}
    newest_durable = next((p for _, p, _ in copies if held.get(p) == DURABLE), None)
    for age, (_, path, manifest) in enumerate(copies):
        if manifest.checkpoint_id == current.checkpoint_id or path == newest_durable or (
                manifest.checkpoint_id in replicating):
            continue
        if held[path] == GONE:
            why = "its checkpoint is no longer in the persistent tier: removed there, or overwritten"
        elif age < config.keep_local or (manifest.persistent and held[path] != DURABLE):
            continue
        else:
            why = f"durable; {config.keep_local} newer copies kept" if manifest.persistent else \
                f"a local checkpoint; {config.keep_local} newer copies kept"
        if _remove_unless_read(path):
            logger.info("fastpersist: removed the local copy %s of %s (%s)", path, manifest.checkpoint_dir, why)
        else:
            logger.debug("fastpersist: the local copy %s is being read: kept for now", path)


GONE = "gone"  # the checkpoint's persistent directory is gone (removed), or holds another save's checkpoint
UNKNOWN = "unknown"  # the persistent tier cannot be asked now, or its manifest is not written yet


def _held(m: TierManifest) -> str:
    """How the persistent tier holds ``m``'s checkpoint: its state (``DURABLE``: a local copy is not the only
    one), ``GONE`` or ``UNKNOWN``."""
    try:
        home = persistent_dir(m.checkpoint_dir)
        current = read_manifest(home)
        if current is None:  # removed, saved again without tiers, or a save that has not written it yet
            names = set(home.names())
            return GONE if not names or names.intersection(MARKERS) else UNKNOWN
    except FastPersistError:
        return UNKNOWN
    return current.state if current.checkpoint_id == m.checkpoint_id else GONE
