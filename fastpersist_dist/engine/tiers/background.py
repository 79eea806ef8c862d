"""The threads that move tiered checkpoints while training goes on: one commits async saves to the local tiers
once written (``local_commit.py``), one replicates, one drains, one removes the local copies a node no longer
keeps, one removes the checkpoints a framework's retention gives up (``removal.py``), one writes a framework's
files that could not reach the persistent tier when written (:func:`after_copies`).

Each runs its jobs one after another, in the order of the saves, so a rank's
part of checkpoint N is done before its part of N+1, on every rank alike (the
replication's transfers are collective). Replication and drain run beside
each other: the drain does not wait for the replicas. A job that fails is
logged and the next one runs. A drain is queued when its save is prepared and
waits for that save's local commit; until then it does not count as a copy
under way.

A process that ends while copies are still under way waits for them at exit
(logging what it waits for), so a training script's last checkpoint still
becomes durable; ``FASTPERSIST_EXIT_WAIT_S`` bounds that wait. Local commits
still waiting for writers are given up first (on every rank: a save whose
every write is done is committed all the same), then the drains of saves never
committed. The replicas travel over a group of their own
(``topology.replication_group``), which a script's ``destroy_process_group()``
leaves alone: the exit still sends them. No thread can be started while the
process exits: the workers and their helpers are started with the first
tiered save (:func:`start_threads`).
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
        """Jobs submitted and not finished, but for local commits and the drains still waiting for their save's
        commit: copies of saves committed."""
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
    """The retention of one local commit, keeping what this process's replication has still to send or receive
    (asked when it runs: replications queued since are of newer checkpoints)."""
    retain(job.config, job.current, replicating())


POLL_S = 0.05  # how often a wait for background jobs looks again
SAY_WAITING_AFTER_S = 1.0  # a save that waits this long (for copies, for a removal under way) says so


def _until(done: Callable[[], bool], timeout: Optional[float] = None,
           slow: Callable[[], None] = lambda: None) -> bool:
    """Look at ``done()`` every ``POLL_S`` until it holds; whether it did within ``timeout`` s. ``slow`` is called
    once where that takes ``SAY_WAITING_AFTER_S``."""
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
    """Start the threads a tiered save's background work runs on (the replication's where ``replicas``), and their
    helpers (``util/beside.py``), unless running: its last checkpoint may be committed, replicated and drained
    while the process exits, when no thread can be started any more."""
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
    """The checkpoint ids whose replication this process has queued or running. Each ends with an all-reduce
    over the whole replication group, so where it is done here, every rank's transfers of it are done."""
    if not _replicator.made():
        return frozenset()
    return frozenset(job.manifest.checkpoint_id for job in _replicator.get().open_jobs())


def _workers() -> list[Worker[Any]]:
    """This process's workers made so far."""
    return [w.get() for w in (_committer, _replicator, _drainer, _retainer, _remover, _deferred) if w.made()]


def remove_checkpoint(path: str) -> None:
    """Remove the checkpoint directory ``path`` (or a directory holding one, as a NeMo checkpoint holds its
    ``weights/``), on any filesystem or an ``msc://`` prefix, once that loses no durable checkpoint; returns at
    once (``removal.py``). Call it on rank 0, where a framework's retention removes checkpoints: its drain
    commits each checkpoint on the persistent tier, so when it is done the checkpoint is durable or failed."""
    newest = _drainer.get().last if _drainer.made() else None
    _remover.get().submit(Removal(checkpoint_url(path), _open_drains(), newest, time.monotonic()))


def after_copies(write: Callable[[], None], what: str, retry_s: float) -> None:
    """``write()``, a framework's write to the persistent tier that failed just now (the tier down), made again in
    the background once the drains queued so far are done, and tried again until ``retry_s``: a file naming a
    checkpoint (Megatron-LM's tracker) is then never there before that checkpoint's files."""
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
    touches anything.

    Waits until this process's replication and drain of a tiered checkpoint
    saved there before are done, since the save removes and rewrites the files
    they read and write. Each rank waits for its own, before the save's first
    collective, so no rank removes a file another rank's copy still reads. A
    drain whose save is not committed yet is not waited for: its commit runs on
    the caller's thread (an async save still writing ``local`` is refused
    before this). Then records that the save began, so that a removal of the
    directory asked for before it keeps it (``removal.py``).
    """
    url = checkpoint_url(checkpoint_dir)
    jobs = _copies_of(url, local)
    if jobs:
        waiting = (f"fastpersist: {who}: saving {url} again: waiting for this process's copies (replicas, the copy "
                   "to the persistent tier) of the checkpoint saved there before to end first")
        logger.debug("%s (%d under way)", waiting, len(jobs), extra=event(WAITING_FOR_COPIES, checkpoint=url))
        start, said = time.monotonic(), threading.Event()

        def say() -> None:
            logger.info("%s (%d under way)", waiting, len(_copies_of(url, local)))
            said.set()

        _until(lambda: not _copies_of(url, local), slow=say)
        (logger.info if said.is_set() else logger.debug)(
            "fastpersist: %s: waited %.2f s for the copies of the checkpoint saved in %s before", who,
            time.monotonic() - start, url)
    saving_into(url, who)


def saving_into(checkpoint_dir: str, who: str) -> None:
    """Record that this process begins saving into ``checkpoint_dir`` (``removal.SavesBegun``): a removal of it
    asked for before keeps it; one removing it right now is waited for."""
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
    """Wait until this process's replicas, copies to the persistent tier, removals of local copies no longer
    kept and of checkpoints given up (``remove_checkpoint``), submitted so far, are done (at most ``timeout``
    s); whether they are."""
    return _until(lambda: not any(w.pending for w in _workers()), timeout)


def _give_up_uncommitted() -> None:
    """At exit, the saves not committed: nothing of them is kept, but for a save whose every write is done.

    Where a local commit waits for writes, the rank's writer first finishes
    the jobs handed to it and stops (a job reaching it later, from a forked
    async caller still running, fails rather than write a file no commit
    takes). Then each local commit still waiting is given up
    (``local_commit.py``: on every rank, unless every write is done by then),
    then the drains of saves whose local commit never came.
    """
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
