"""The threads that move tiered checkpoints while training goes on (docs/design.md, "Tiers"): the local commit
of async saves, the replication, the drain, the retention of local copies, the removals a framework's retention
asks for, and a framework's writes deferred until the persistent tier answers.

Each thread runs its jobs in the order of the saves, a failed job logged and the next one run. A process waits
at exit for its copies (``FASTPERSIST_EXIT_WAIT_S`` bounds it); the threads are started with the first tiered
save, since an exiting interpreter starts none.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
from concurrent.futures import InvalidStateError
from dataclasses import dataclass
from typing import Any, Callable, Generic, Optional, TypeVar

from ...storage.persistent import checkpoint_url
from ...util.beside import keep_helpers
from ...util.errors import FastPersistError
from ...util.events import WAITING_FOR_COPIES, event
from ...util.per_process import PerProcess
from ..writer_process import writer_client
from .drain import Drain, drain, retrying
from .local_commit import LocalCommit, await_writers_and_commit, finalize_step
from .removal import Removal, SavesBegun, remove
from .replicate import Replication, replicate
from .retention import Retention, retain
from .topology import release_replication_groups

logger = logging.getLogger(__name__)

J = TypeVar("J")
EXIT_WAIT_ENV = "FASTPERSIST_EXIT_WAIT_S"


class Worker(Generic[J]):
    """A thread running ``run(job)`` for each submitted job, in order."""

    def __init__(self, name: str, run: Callable[[J], None]):
        self.name = name
        self._run = run
        self._jobs: queue.Queue[J] = queue.Queue()
        self._open: list[J] = []  # submitted, not finished
        self.last: Optional[J] = None  # the last job submitted
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: J) -> None:
        _exit_wait_registered.get()  # the exit waits for the copies
        with self._lock:
            self._open.append(job)
            self.last = job
        self._jobs.put(job)

    def open_jobs(self) -> list[J]:
        """Jobs submitted and not finished, oldest first."""
        with self._lock:
            return list(self._open)

    @property
    def pending(self) -> int:
        """Copies of committed saves submitted and not finished (local commits and uncommitted drains aside)."""
        return sum(1 for job in self.open_jobs()
                   if not isinstance(job, LocalCommit) and (not isinstance(job, Drain) or job.committed.done()))

    def _loop(self) -> None:
        while True:
            self._run_one(self._jobs.get())  # holds no finished job (and its process group) while it waits

    def _run_one(self, job: J) -> None:
        try:
            self._run(job)
        except Exception:  # noqa: BLE001 - the checkpoint stays where it is; the next ones still move
            logger.exception("fastpersist: %s: a job failed; the checkpoint stays where it got to", self.name)
        finally:
            with self._lock:
                self._open.remove(job)


def _retain(job: Retention) -> None:
    """The retention of one local commit, keeping what this process's replication still sends or receives."""
    retain(job.config, job.current, replicating())


POLL_S = 0.05  # how often a wait for background jobs looks again
SAY_WAITING_AFTER_S = 1.0  # a save that waits this long (for copies, for a removal under way) says so


def _until(done: Callable[[], bool], timeout: Optional[float] = None,
           slow: Callable[[], None] = lambda: None) -> bool:
    """Look at ``done()`` every ``POLL_S`` until it holds; whether it did within ``timeout`` s. ``slow()`` once
    after ``SAY_WAITING_AFTER_S``."""
    start, said = time.monotonic(), False
    while not done():
        waited = time.monotonic() - start
        if timeout is not None and waited >= timeout:
            return False
        if not said and waited >= SAY_WAITING_AFTER_S:
            slow()
            said = True
        time.sleep(POLL_S)
    return True


def _open_drains() -> tuple[Drain, ...]:
    """This process's drains queued and not finished."""
    return tuple(_drainer.get().open_jobs()) if _drainer.made() else ()


def _until_drained(drains: tuple[Drain, ...]) -> None:
    """Return once every one of ``drains`` is finished."""
    _until(lambda: not any(d is o for o in _drainer.get().open_jobs() for d in drains))


def _remove(job: Removal) -> None:
    """A removal, once the drains queued before it are done (``removal.py``)."""
    _until_drained(job.after)
    remove(job, _begun.get())


@dataclass(frozen=True)
class Deferred:
    """A framework's write to the persistent tier that failed when made (:func:`after_copies`)."""

    write: Callable[[], None]
    what: str  # for messages: the file and where
    retry_s: float
    after: tuple[Drain, ...]  # the drains queued before it


def _write_deferred(job: Deferred) -> None:
    _until_drained(job.after)
    try:
        retrying(job.write, job.retry_s, f"writing {job.what}")
    except FastPersistError as e:
        logger.error("fastpersist: %s", e)
        return
    logger.info("fastpersist: wrote %s, once the persistent tier answered", job.what)


_committer = PerProcess(lambda: Worker("fastpersist-commit", await_writers_and_commit))
_replicator = PerProcess(lambda: Worker("fastpersist-replicate", replicate))
_drainer = PerProcess(lambda: Worker("fastpersist-drain", drain))
_retainer = PerProcess(lambda: Worker("fastpersist-retain", _retain))
_remover = PerProcess(lambda: Worker("fastpersist-remove", _remove))
_deferred = PerProcess(lambda: Worker("fastpersist-deferred", _write_deferred))
_begun = PerProcess(SavesBegun)
replicator: Callable[[], Worker[Replication]] = _replicator.get
drainer: Callable[[], Worker[Drain]] = _drainer.get
retainer: Callable[[], Worker[Retention]] = _retainer.get


def start_threads(replicas: bool) -> None:
    """Start the threads of a tiered save's background work (the replication's where ``replicas``) and their
    helpers (``util/beside.py``), unless running: an exiting process, which may still move its last checkpoint,
    starts no thread."""
    for worker in (_committer, _drainer, _retainer, _deferred) + ((_replicator,) if replicas else ()):
        worker.get()
    keep_helpers()


def commit_beside(job: LocalCommit) -> Callable[[], None]:
    """Queue an async tiered save's local commit (``local_commit.py``); the save's finalize step, which waits for
    it."""
    committer = _committer.get()
    committer.submit(job)
    return finalize_step(job, committer.open_jobs)


def replicating() -> frozenset[str]:
    """The checkpoint ids whose replication this process has queued or running (one done here is done on every
    rank: each ends with an all-reduce over the group)."""
    if not _replicator.made():
        return frozenset()
    return frozenset(job.manifest.checkpoint_id for job in _replicator.get().open_jobs())


def _workers() -> list[Worker[Any]]:
    """This process's workers made so far."""
    return [w.get() for w in (_committer, _replicator, _drainer, _retainer, _remover, _deferred) if w.made()]


def remove_checkpoint(path: str) -> None:
    """Remove the checkpoint directory ``path`` (or a directory holding one, as a NeMo checkpoint holds its
    ``weights/``), a path or an ``msc://`` prefix, once that loses no durable checkpoint (``removal.py``); returns
    at once. Call it on rank 0, whose drain commits each checkpoint on the persistent tier."""
    newest = _drainer.get().last if _drainer.made() else None
    _remover.get().submit(Removal(checkpoint_url(path), _open_drains(), newest, time.monotonic()))


def after_copies(write: Callable[[], None], what: str, retry_s: float) -> None:
    """``write()``, a framework's write to the persistent tier that failed just now, made in the background once
    the drains queued so far are done, tried until ``retry_s``: a file naming a checkpoint (Megatron-LM's
    tracker) never lands before that checkpoint's files."""
    _deferred.get().submit(Deferred(write, what, retry_s, _open_drains()))


def _copies_of(checkpoint_dir: str, local: Optional[str]) -> list[Any]:
    """This process's replications and committed drains not finished whose checkpoint is ``checkpoint_dir``
    (a URL) or whose node copy is ``local``."""
    def same(home: str, copy: str) -> bool:
        return copy == local or checkpoint_url(home) == checkpoint_dir

    jobs: list[Any] = []
    if _replicator.made():
        jobs += [j for j in _replicator.get().open_jobs() if same(j.manifest.checkpoint_dir, j.local)]
    if _drainer.made():
        jobs += [j for j in _drainer.get().open_jobs() if j.committed.done() and same(j.checkpoint_dir, j.local)]
    return jobs


def begin_save(checkpoint_dir: str, local: Optional[str], who: str) -> None:
    """Before a save into ``checkpoint_dir`` (tiered: its node copy ``local``; None for one without tiers)
    touches anything, on each rank before the save's first collective: wait for this process's replication and
    committed drain of the checkpoint saved there before (the save removes and rewrites the files they read and
    write), then record that the save began (:func:`saving_into`)."""
    url = checkpoint_url(checkpoint_dir)
    if _copies_of(url, local):
        waiting = (f"fastpersist: {who}: saving {url} again: waiting for this process's copies (replicas, the copy "
                   "to the persistent tier) of the checkpoint saved there before to end first")
        logger.debug(waiting, extra=event(WAITING_FOR_COPIES, checkpoint=url))
        start = time.monotonic()
        _until(lambda: not _copies_of(url, local), slow=lambda: logger.info(waiting))
        logger.debug("fastpersist: %s: waited %.2f s for them", who, time.monotonic() - start)
    saving_into(url, who)


def saving_into(checkpoint_dir: str, who: str) -> None:
    """Record that this process begins saving into ``checkpoint_dir``: a removal of it asked for before keeps it;
    one removing it right now is waited for."""
    url, begun = checkpoint_url(checkpoint_dir), _begun.get()
    if not begun.lock.acquire(timeout=SAY_WAITING_AFTER_S):
        logger.info("fastpersist: %s: saving %s: waiting for a removal under way to end first", who, url)
        begun.lock.acquire()
    try:
        oldest = min((job.asked for job in _remover.get().open_jobs()), default=None) if _remover.made() else None
        begun.note(url, oldest)
    finally:
        begun.lock.release()


def wait_copies(timeout: Optional[float] = None) -> bool:
    """Wait until this process's background work submitted so far (replicas, drains, removals) is done, at most
    ``timeout`` s; whether it is."""
    return _until(lambda: not any(w.pending for w in _workers()), timeout)


def _give_up_uncommitted() -> None:
    """At exit, the saves not committed: the rank's writer finishes its jobs and stops (a later one fails), each
    local commit still waiting is given up (on every rank, unless every write is done by then), then the drains
    of saves never committed."""
    commits = _committer.get().open_jobs() if _committer.made() else []
    drains = _drainer.get().open_jobs() if _drainer.made() else []
    if commits:
        writer_client().stop(_exit_limit())
    for commit in commits:
        commit.given_up.set()
    if commits and not _until(lambda: not _committer.get().open_jobs(), _exit_limit()):
        logger.error("fastpersist: exiting with the local commits of %s unfinished",
                     ", ".join(job.checkpoint_dir for job in _committer.get().open_jobs()))
    for commit in commits:  # no finalize reports these
        if commit.result.done() and commit.result.exception() is not None:
            logger.warning("fastpersist: rank %d: %s was not committed: %s", commit.rank, commit.checkpoint_dir,
                           commit.result.exception())
    for job in drains:
        try:
            job.committed.set_exception(RuntimeError("the save was not committed before the process exited"))
        except InvalidStateError:  # committed (or failed) after all
            pass


def _exit_limit() -> Optional[float]:
    """The most seconds an exit waits for copies (``FASTPERSIST_EXIT_WAIT_S``); None: no bound."""
    limit = os.environ.get(EXIT_WAIT_ENV)
    return float(limit) if limit else None


def _wait_at_exit() -> None:
    try:
        _wait_for_copies()
    finally:
        release_replication_groups()


def _wait_for_copies() -> None:
    _give_up_uncommitted()
    pending = sum(w.pending for w in _workers())
    if not pending:
        return
    limit = _exit_limit()
    logger.warning("fastpersist: waiting for %d checkpoint copies (replicas, drains to the persistent tier) to finish "
                   "before this process exits%s", pending, f" (at most {limit:g} s, {EXIT_WAIT_ENV})"
                   if limit is not None else f"; {EXIT_WAIT_ENV} bounds the wait")
    if not wait_copies(limit):
        logger.error("fastpersist: exiting with checkpoint copies unfinished: those checkpoints stay in the local "
                     "tiers (not durable)")


def _register() -> bool:
    atexit.register(_wait_at_exit)
    return True


_exit_wait_registered = PerProcess(_register)
