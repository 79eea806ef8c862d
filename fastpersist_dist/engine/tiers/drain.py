"""The drain: a tiered checkpoint copied from the local tiers to the persistent tier, its index committed last
(docs/design.md, "The drain").

Each rank's job waits for its save's local commit, then copies the rank's data
file from the node's copy, every block checked, marks it copied there and
counts itself done in the default group's store; rank 0 waits for that count,
lists the directory once and commits the index, then records ``durable``. A
copy failing for a reason other than the bytes is tried again until
``retry_s``; one that fails for good leaves a failure marker, and the
checkpoint stays in the local tiers. A wait for another rank (rank 0's word,
the ranks' counts) ends when that rank shows no sign of life for ``retry_s``
(a process that died): each drain beats in the store while it works.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from contextlib import contextmanager
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Iterator, TypeVar

import torch.distributed as dist

from ...format.checksum import digest_bytes
from ...format.records import INDEX_FILE, is_data_file
from ...format.tiers import DRAINED_PREFIX, DURABLE, TierManifest
from ...storage.spans import block_spans
from ...storage.files import TMP_SUFFIX
from ...storage.persistent import PersistentDir, persistent_dir
from ...util.beside import Beside
from ...util.errors import CorruptCheckpointError, FastPersistError
from ...util.events import COPIED, DURABLE as DURABLE_EVENT, RETRYING, event
from ..index_reader import read_index
from .state import advance, drained_marker, failed_copies, mark_failed, pauses, pending_dir, superseded

logger = logging.getLogger(__name__)

T = TypeVar("T")
FIRST_PAUSE_S = 1.0
LONGEST_PAUSE_S = 30.0
COUNT_POLL_S = 0.2  # the longest pause of a drain's wait between its looks at the process group's store
BEATS_PER_SILENCE = 8  # a live drain beats this often within the silence after which a wait gives it up
LEAST_SILENCE_S = 10.0  # ... at least this long (retry_s may be 0), whatever the store's latency under load
RANK_0_BEAT = "rank0/beat"  # rank 0's drain beats here while it works on any checkpoint


@dataclass(frozen=True)
class Drain:
    """One rank's part of draining one checkpoint."""

    committed: "Future[TierManifest]"  # the local commit's manifest; an exception where the save failed
    checkpoint_dir: str  # the persistent tier's
    local: str  # this node's copy of the checkpoint
    rank: int
    node: str  # this node, for messages
    data_file: str  # this rank's
    retry_s: float
    store: dist.Store  # topology.drain_store(): where each rank counts its part done
    world: int  # the ranks that count themselves there
    unpublished: list[Callable[[], None]]  # rank 0: its save's steps on the persistent tier still to make (save.py)


def drain(job: Drain) -> None:
    """This rank's part of ``job`` (see the module)."""
    who = f"rank {job.rank} ({job.node})"
    try:
        m = job.committed.result()
    except Exception as e:  # noqa: BLE001 - the save failed: its finalize reported it on every rank
        logger.debug("fastpersist: %s: %s was not committed, nothing to drain: %s", who, job.checkpoint_dir, e)
        return
    with _beating(job, RANK_0_BEAT if job.rank == 0 else _key(m, "beat")):
        _drain_committed(job, m, who)


def _drain_committed(job: Drain, m: TierManifest, who: str) -> None:
    # Rank 0 publishes what its save could not write on the persistent tier, even where the checkpoint is kept
    # local (persistent=False, or the drain's backlog full); only a checkpoint to be drained is copied.
    published = _published(job, m, who) if job.rank == 0 else m.persistent and _await_published(job, m, who)
    if not (published and m.persistent):
        return
    start, home = time.perf_counter(), persistent_dir(job.checkpoint_dir)
    try:
        sizes = _copy_and_mark(job, m, home, who)
    finally:
        _count_done(job, m, who)
    if job.rank == 0 and sizes is not None:
        try:
            _commit(home, m, sizes, job, start)
        except FastPersistError as e:
            logger.error("fastpersist: rank 0: %s stays in the local tiers (not durable): %s", m.checkpoint_dir, e)


def _silence(job: Drain) -> float:
    """How long a wait for another rank's drain goes on without a sign of it (a beat, a count) before it gives that
    rank up as dead."""
    return max(job.retry_s, LEAST_SILENCE_S)


@contextmanager
def _beating(job: Drain, key: str) -> Iterator[None]:
    """Add to ``key`` in the store now and then while the block runs: the waits for this rank see it alive."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(_silence(job) / BEATS_PER_SILENCE):
            try:
                job.store.add(key, 1)
            except RuntimeError:  # the store's server is gone: the waits on it fail too
                return

    beats = Beside(beat, "fastpersist-drain-beat")  # a kept thread: a drain also runs while the process exits
    try:
        yield
    finally:
        stop.set()
        beats.join()


def _copy_and_mark(job: Drain, m: TierManifest, home: PersistentDir, who: str) -> dict[str, int] | None:
    """This rank's data file copied and marked (its failure marked where it failed for good); the sizes of the
    checkpoint's data files, or None where its copy failed or a newer save took the directory over."""
    index = read_index(job.local, who)
    size = index.files.get(job.data_file)
    try:
        if retrying(lambda: superseded(m), job.retry_s, f"{who}: reading the state of {m.checkpoint_dir}"):
            return None
        if size is not None:  # a rank with nothing to write has no data file
            src, dst = os.path.join(job.local, job.data_file), home.where(job.data_file)
            spans = block_spans([r for r in index.records if r.file == job.data_file], index.checksum_block_bytes,
                                size, src)
            seconds = retrying(lambda: home.put(job.data_file, src, spans, size, who), job.retry_s,
                               f"{who}: copying {src} to {dst}")
            logger.debug("fastpersist: %s: %s copied to %s in %.2f s (%.2f GiB/s), every block checked", who, src,
                         dst, seconds, size / 2**30 / max(seconds, 1e-9), extra=event(COPIED, file=dst))
        retrying(lambda: home.write(drained_marker(m, job.data_file), b""), job.retry_s,
                 f"{who}: marking {job.data_file} copied in {home.url}")
    except FastPersistError as e:
        logger.error("fastpersist: %s: %s stays in the local tiers: %s", who, m.checkpoint_dir, e)
        try:
            mark_failed(home, m, job.data_file, job.rank, str(e))
        except FastPersistError as again:
            logger.error("fastpersist: %s: cannot leave the failure marker in %s either (%s)", who, home.url, again)
        return None
    return index.files


def _key(m: TierManifest, what: str) -> str:
    """The store's key of ``what`` (``done``: the ranks' count; ``published``: rank 0's word) for ``m``."""
    return f"{m.checkpoint_id}/{what}"


def _published(job: Drain, m: TierManifest, who: str) -> bool:
    """Rank 0: the steps of ``m``'s save that could not reach the persistent tier made now, tried again until
    ``retry_s``; whether every one is made, which the other ranks' drains learn from the store."""
    try:
        while job.unpublished:
            retrying(job.unpublished[0], job.retry_s, f"{who}: writing the local commit of {m.checkpoint_dir} there")
            job.unpublished.pop(0)
        done = True
    except FastPersistError as e:
        logger.error("fastpersist: %s: %s stays in the local tiers: %s", who, m.checkpoint_dir, e)
        done = False
    if m.persistent:
        if done:
            _remove_stale(persistent_dir(job.checkpoint_dir), m)
        try:
            job.store.set(_key(m, "published"), b"1" if done else b"0")
        except RuntimeError as e:
            logger.error("fastpersist: %s: cannot tell the other ranks that %s is %s (%s)", who, m.checkpoint_dir,
                         "published" if done else "not published", e)
    return done


def _await_published(job: Drain, m: TierManifest, who: str) -> bool:
    """Another rank: whether rank 0's drain wrote ``m``'s local commit on the persistent tier, once it says."""
    key = _key(m, "published")
    try:
        if _store_wait(job, lambda: job.store.check([key]), lambda: job.store.add(RANK_0_BEAT, 0)):
            return job.store.get(key) == b"1"
        why = f"rank 0's drain showed no sign of life for {_silence(job):.0f} s (its process died?)"
    except RuntimeError as e:
        why = str(e)
    logger.error("fastpersist: %s: cannot learn whether %s is published on the persistent tier (%s); not copying it "
                 "there", who, m.checkpoint_dir, why)
    return False


def _store_wait(job: Drain, done: Callable[[], bool], progress: Callable[[], Any]) -> bool:
    """Look at ``done()`` (the process group's store) after each pause: True once it holds; False once
    ``progress()``, the signs of life of the ranks waited for, stayed the same for :func:`_silence`."""
    silence = _silence(job)
    seen, since = progress(), time.monotonic()
    looked = since
    for pause in pauses(COUNT_POLL_S):
        if done():
            return True
        now = time.monotonic()
        if now - looked >= silence / BEATS_PER_SILENCE:
            looked, signs = now, progress()
            if signs != seen:
                seen, since = signs, now
            elif now - since >= silence:
                return False
        time.sleep(pause)
    return False  # pauses() never ends


def _count_done(job: Drain, m: TierManifest, who: str) -> None:
    """Count this rank's part of ``m``'s drain over, whatever became of it: rank 0's drain waits for every rank's."""
    try:
        job.store.add(_key(m, "done"), 1)
    except RuntimeError as e:  # torch's DistError family: the store's server is gone
        logger.error("fastpersist: %s: cannot tell rank 0 that its copy of %s is over (%s); rank 0's drain of it "
                     "waits for it", who, m.checkpoint_dir, e)


def _await_every_rank(job: Drain, m: TierManifest) -> None:
    """Rank 0: return once every rank counted its part of ``m``'s drain done (looks at the store only)."""
    key, beat = _key(m, "done"), _key(m, "beat")
    try:
        over = _store_wait(job, lambda: job.store.add(key, 0) >= job.world,
                           lambda: (job.store.add(key, 0), job.store.add(beat, 0)))
    except RuntimeError as e:
        raise FastPersistError(f"cannot learn from the process group's store whether every rank's copy is over: "
                               f"{e}") from e
    if not over:
        raise FastPersistError(f"{job.world - job.store.add(key, 0)} of {job.world} ranks did not count their copies "
                               f"done and showed no sign of life for {_silence(job):.0f} s (their processes died?)")
    for done_with in (key, beat, _key(m, "published")):  # every rank has read them
        try:
            job.store.delete_key(done_with)
        except RuntimeError as e:
            logger.debug("fastpersist: rank 0: %s stays in the store: %s", done_with, e)


def _commit(home: PersistentDir, m: TierManifest, sizes: dict[str, int], job: Drain, start: float) -> None:
    """Rank 0: wait for every rank's copy, then commit the index in the persistent directory."""
    wanted = {f for f in m.files if f in sizes}

    def tried(step: Callable[[], T], what: str) -> T:
        return retrying(step, job.retry_s, f"rank 0: {what} {home.url}")

    _await_every_rank(job, m)
    names = set(tried(home.names, "listing"))
    failed = failed_copies(home, m, names)
    if failed:
        logger.error("fastpersist: %s stays in the local tiers (not durable): %s", m.checkpoint_dir,
                     " | ".join(failed.values()))
        return
    missing = sorted(f for f in wanted if drained_marker(m, f) not in names)
    if missing:  # their ranks found that a newer save took the directory over
        if not tried(lambda: superseded(m), "reading the state of"):
            logger.error("fastpersist: %s stays in the local tiers (not durable): no copy of %s was marked checked "
                         "in %s", m.checkpoint_dir, ", ".join(missing), home.url)
        return
    index = _committed_index(m, job.local)
    for name, data in index.items():  # the format's marker is last among them
        tried(lambda: home.write(name, data), f"committing {name} in")
    if not tried(lambda: advance(m, DURABLE), "recording the state of"):
        return
    try:
        home.remove_all([drained_marker(m, f) for f in m.files])
        pending_dir(home).remove_all(list(m.index_files))
    except FastPersistError as e:  # left for the next save into the directory
        logger.warning("fastpersist: %s is durable, but its markers could not all be removed: %s",
                       m.checkpoint_dir, e)
    seconds, nbytes = time.perf_counter() - start, sum(sizes[f] for f in wanted)
    logger.info("fastpersist: %s is durable: its %d data files (%.3f GiB) copied to the persistent tier and checked, "
                "its index committed there, %.2f s after its drain started (%.2f GiB/s)", m.checkpoint_dir,
                len(wanted), nbytes / 2**30, seconds, nbytes / 2**30 / max(seconds, 1e-9),
                extra=event(DURABLE_EVENT, checkpoint=m.checkpoint_dir))


def _committed_index(m: TierManifest, local: str) -> dict[str, bytes]:
    """The index files of ``m``'s checkpoint from this node's copy ``local``, in commit order; raises where they
    are not the ones its local commit wrote (its manifest holds the index's digest)."""
    index = {}
    for name in m.index_files:
        try:
            with open(os.path.join(local, name), "rb") as f:
                index[name] = f.read()
        except OSError as e:
            raise FastPersistError(f"cannot read this node's copy of its index: {e}") from e
    if digest_bytes(index[INDEX_FILE]) != m.index_xxh3_64:
        raise FastPersistError(f"{os.path.join(local, INDEX_FILE)} is not the index of checkpoint {m.checkpoint_id} "
                               "any more: another save rewrote this node's copy")
    return index


def retrying(step: Callable[[], T], retry_s: float, what: str) -> T:
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
            # Spread: ranks refused at once (each found the room the others had just allocated) retry apart.
            wait = min(pause * random.uniform(0.75, 1.25), left)
            logger.warning("fastpersist: %s failed (%s); trying again in %.1f s (for %.0f s more)", what, e, wait,
                           left, extra=event(RETRYING))
            time.sleep(wait)
            pause = min(pause * 2, LONGEST_PAUSE_S)


def _remove_stale(home: PersistentDir, m: TierManifest) -> None:
    """Rank 0, before any rank copies a file of ``m`` (each waits for its word): the files an earlier checkpoint
    left in the persistent directory that this one does not rewrite, its copies under temporary names and its
    markers among them (as far as the directory can be reached: what stays is removed by the next save)."""
    keep = set(m.files) | set(m.index_files)
    try:
        if not superseded(m):
            home.remove_all([name for name in home.names() if name not in keep and (
                is_data_file(name) or name.endswith(TMP_SUFFIX) or name.startswith(DRAINED_PREFIX))])
    except FastPersistError as e:
        logger.warning("fastpersist: rank 0: files of an earlier checkpoint in %s could not all be removed: %s",
                       home.url, e)
