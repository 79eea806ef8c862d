"""The drain: a tiered checkpoint copied from the local tiers to the persistent tier, its index committed last.

Runs on every rank's drain thread after the local commit. Each rank copies its
own data file from its node's copy to the persistent directory (a shared
filesystem or an object store, ``storage/persistent.py``), every block checked
against the index on the way, and leaves a marker there naming the checkpoint.
Rank 0's drain, once every rank's marker is there, copies the index files in
commit order (the format's marker last), then records the state ``durable``
and removes the markers and the pending index. Nothing of the persistent
directory's committed index exists before that: it never shows durable early.

A copy that fails for a reason other than the bytes (the store unreachable,
the filesystem full) is tried again with growing pauses until
``TierConfig.retry_s`` has passed, each failure logged; a damaged source
block is not retried. A rank whose copy failed for good leaves a failure
marker, so rank 0 stops waiting and says which rank and why; the checkpoint
stays in the local tiers (loadable there), and the next save goes on.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

from ...format.records import is_data_file
from ...format.tiers import DURABLE, TierManifest
from ...storage.copy import block_spans
from ...storage.files import TMP_SUFFIX
from ...storage.persistent import PersistentDir, persistent_dir
from ...util.errors import CorruptCheckpointError, FastPersistError
from ..index_reader import read_index
from .part import RankPart
from .state import DRAINED_PREFIX, advance, drained_marker, failed_marker, pending_dir, poll_interval, superseded

logger = logging.getLogger(__name__)

T = TypeVar("T")
FIRST_PAUSE_S = 1.0
LONGEST_PAUSE_S = 30.0


@dataclass(frozen=True)
class Drain(RankPart):
    """One rank's part of draining one checkpoint."""

    data_file: str  # this rank's
    retry_s: float


def drain(job: Drain) -> None:
    """This rank's part of ``job`` (see the module)."""
    m, who = job.manifest, f"rank {job.rank} ({job.node})"
    home = persistent_dir(m.checkpoint_dir)
    start = time.perf_counter()
    index = read_index(job.local, who)
    size = index.files.get(job.data_file)
    try:
        if _retrying(lambda: superseded(m), job.retry_s, f"{who}: reading the state of {m.checkpoint_dir}"):
            return
        if job.rank == 0:
            _remove_stale(home, m)
        if size is not None:  # a rank with nothing to write has no data file
            src = os.path.join(job.local, job.data_file)
            spans = block_spans([r for r in index.records if r.file == job.data_file], index.checksum_block_bytes,
                                size, src)
            seconds = _retrying(lambda: home.put(job.data_file, src, spans, size, who), job.retry_s,
                                f"{who}: copying {src} to {home.where(job.data_file)}")
            logger.debug("fastpersist: %s: %s copied to %s in %.2f s (%.2f GiB/s), every block checked", who, src,
                         home.where(job.data_file), seconds, size / 2**30 / max(seconds, 1e-9))
        _retrying(lambda: home.write(drained_marker(m, job.data_file), b""), job.retry_s,
                  f"{who}: marking {job.data_file} copied in {home.url}")
    except FastPersistError as e:
        logger.error("fastpersist: %s: %s stays in the local tiers: %s", who, m.checkpoint_dir, e)
        try:
            home.write(failed_marker(m, job.data_file), json.dumps({"rank": job.rank, "error": str(e)}).encode())
        except FastPersistError as again:
            logger.error("fastpersist: %s: cannot leave the failure marker in %s either (%s): rank 0's drain of it "
                         "waits until the next save into that directory", who, home.url, again)
        return
    if job.rank == 0:
        try:
            _commit(home, m, index.files, job, start)
        except FastPersistError as e:
            logger.error("fastpersist: rank 0: %s stays in the local tiers (not durable): %s", m.checkpoint_dir, e)


def _commit(home: PersistentDir, m: TierManifest, sizes: dict[str, int], job: Drain, start: float) -> None:
    """Rank 0: wait for every rank's copy, then commit the index in the persistent directory."""
    wanted = {f for f in m.files if f in sizes}

    def retrying(step: Callable[[], T], what: str) -> T:
        return _retrying(step, job.retry_s, f"rank 0: {what} {home.url}")

    while True:
        names = set(retrying(home.names, "listing"))
        failed = sorted(f for f in m.files if failed_marker(m, f) in names)
        if failed:
            reasons = [json.loads(home.read(failed_marker(m, f)) or b"{}").get("error", "?") for f in failed]
            logger.error("fastpersist: %s stays in the local tiers (not durable): %s", m.checkpoint_dir,
                         " | ".join(reasons))
            return
        if all(drained_marker(m, f) in names for f in wanted):
            break
        if retrying(lambda: superseded(m), "reading the state of"):
            return
        time.sleep(poll_interval(m.checkpoint_dir))
    for name in m.index_files:  # the format's marker is last among them
        with open(os.path.join(job.local, name), "rb") as f:
            data = f.read()
        retrying(lambda: home.write(name, data), f"committing {name} in")
    if not retrying(lambda: advance(m, DURABLE), "recording the state of"):
        return
    try:
        for f in m.files:
            home.remove(drained_marker(m, f))
        pending = pending_dir(home)
        for name in m.index_files:
            pending.remove(name)
    except FastPersistError as e:  # left for the next save into the directory
        logger.warning("fastpersist: %s is durable, but its markers could not all be removed: %s",
                       m.checkpoint_dir, e)
    logger.info("fastpersist: %s is durable: every data file copied to the persistent tier and checked, its index "
                "committed there (%.2f s after its drain started)", m.checkpoint_dir, time.perf_counter() - start)


def _retrying(step: Callable[[], T], retry_s: float, what: str) -> T:
    """``step()``, tried again after failures other than damaged bytes until ``retry_s`` seconds have passed."""
    end = time.monotonic() + retry_s
    pause = FIRST_PAUSE_S
    while True:
        try:
            return step()
        except CorruptCheckpointError:
            raise
        except (FastPersistError, OSError) as e:
            left = end - time.monotonic()
            if left <= 0:
                raise FastPersistError(f"{what} failed, and kept failing for {retry_s:.0f} s: {e}") from e
            logger.warning("fastpersist: %s failed (%s); trying again in %.0f s (for %.0f s more)", what, e, pause,
                           left)
            time.sleep(min(pause, left))
            pause = min(pause * 2, LONGEST_PAUSE_S)


def _remove_stale(home: PersistentDir, m: TierManifest) -> None:
    """The persistent directory's files of an earlier checkpoint there that this one does not rewrite (as far
    as the directory can be reached: what stays is removed by the next save)."""
    try:
        _remove_stale_files(home, m)
    except FastPersistError as e:
        logger.warning("fastpersist: rank 0: files of an earlier checkpoint in %s could not all be removed: %s",
                       home.url, e)


def _remove_stale_files(home: PersistentDir, m: TierManifest) -> None:
    keep = set(m.files) | set(m.index_files)
    for name in home.names():
        if name in keep:
            continue
        if name.endswith(TMP_SUFFIX) and name[: -len(TMP_SUFFIX)].rsplit(".", 1)[0] in keep:
            continue  # a copy of this checkpoint under way
        if is_data_file(name) or name.endswith(TMP_SUFFIX) or (
                name.startswith(DRAINED_PREFIX) and m.checkpoint_id not in name):
            home.remove(name)
