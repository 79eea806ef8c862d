"""Functions run beside their caller on threads this process keeps, whose outcome the caller takes later.

The background work of tiered checkpoints (a copy's read-ahead, a
replication's sends, the files of a commit written at once) runs on a thread
beside the one that waits for it, also while the process exits: its last
checkpoint is committed, replicated and copied to the persistent tier then
(``engine/tiers/background.py``). But once the interpreter begins to exit, no
thread can be started (Python 3.12 and later refuse ``Thread.start``; on every
version ``concurrent.futures`` executors refuse work). So the threads are
kept: one is started while none is free (and while threads can be started),
then waits for the next function when done, and at exit a function waits for
one of them to be free.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable, Generic, Optional, TypeVar

from .per_process import PerProcess

logger = logging.getLogger(__name__)

T = TypeVar("T")
# Threads started ahead (:func:`keep_helpers`), by a process that will need them at its exit: one for a copy's
# read-ahead, one for a replication's sends, one for a drain's beat, and the files of a commit written at once
# beside them.
HELPERS_AHEAD = 5


class Beside(Generic[T]):
    """``fn()`` handed to a kept thread now; :meth:`result` waits for it. ``name``: what it does, for logs."""

    def __init__(self, fn: Callable[[], T], name: str):
        self.name = name
        self._fn = fn
        self._value: Optional[T] = None
        self._error: Optional[BaseException] = None
        self._done = threading.Event()
        _helpers.get().hand(self)

    def run(self) -> None:
        """Run ``fn`` (on the helper thread that took it)."""
        try:
            self._value = self._fn()
        except BaseException as e:  # noqa: BLE001 - raised by result(), in the caller's thread
            self._error = e
        finally:
            self._done.set()

    def join(self) -> None:
        """Wait for ``fn`` to end, whatever its outcome."""
        self._done.wait()

    def result(self) -> T:
        """What ``fn()`` returned, once it did; raises what it raised."""
        self.join()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]


def all_results(started: list[Beside[T]]) -> list[T]:
    """Every one's :meth:`Beside.result`, once all ended; raises the first one's error in the list's order."""
    errors: list[BaseException] = []
    values: list[T] = []
    for b in started:
        try:
            values.append(b.result())
        except BaseException as e:  # noqa: BLE001 - the first raised below
            errors.append(e)
    if errors:
        raise errors[0]
    return values


class _Helpers:
    """This process's kept threads and the functions handed to them."""

    def __init__(self) -> None:
        self._work: queue.SimpleQueue[Beside] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._free = 0  # threads waiting for work, less the work handed to them and not yet taken

    def hand(self, job: Beside) -> None:
        with self._lock:
            self._free -= 1
            short = self._free < 0
        if short:
            self._start()
        self._work.put(job)

    def keep(self, count: int) -> None:
        """Start threads until ``count`` are kept."""
        while self._threads < count and self._start():
            pass

    def _start(self) -> bool:
        """One more thread; False where none can be started (the interpreter exits: the work waits for one)."""
        thread = threading.Thread(target=self._loop, name=f"fastpersist-helper-{self._threads}", daemon=True)
        try:
            thread.start()
        except RuntimeError as e:  # "can't create new thread at interpreter shutdown"
            logger.debug("fastpersist: no helper thread can be started (%s): the work waits for a kept one", e)
            return False
        with self._lock:
            self._threads += 1
            self._free += 1
        return True

    def _loop(self) -> None:
        while True:
            job = self._work.get()
            job.run()
            del job  # holds nothing of a finished function while it waits
            with self._lock:
                self._free += 1


_helpers: PerProcess[_Helpers] = PerProcess(_Helpers)


def keep_helpers(count: int = HELPERS_AHEAD) -> None:
    """Start ``count`` kept threads now (where fewer are kept), for work this process hands them while it exits."""
    _helpers.get().keep(count)


def pools_refuse_work() -> bool:
    """Whether a new thread pool refuses work here and now (the interpreter exiting: no thread starts on Python
    3.12, and ``concurrent.futures`` takes no new work on any version), as it would refuse a library that makes
    its own (boto3's transfers): tried, not inferred from the version."""
    from concurrent.futures import ThreadPoolExecutor

    try:
        with ThreadPoolExecutor(1, thread_name_prefix="fastpersist-probe") as pool:
            pool.submit(int).result()
    except RuntimeError:
        return True
    return False
