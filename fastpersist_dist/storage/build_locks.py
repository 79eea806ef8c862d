"""The build locks of DeepSpeed's JIT ops: one left by a dead process is cleared, a live one waited for, boundedly.

torch's JIT build (``torch.utils.cpp_extension.load``, which DeepSpeed's op
builders call on every load, built or not) takes ``<TORCH_EXTENSIONS_DIR>/<op>/lock``
(torch's ``FileBaton``: a file created with ``O_EXCL``, removed when done),
and every other process polls for it to go, without end. A process killed
while holding it leaves it behind, and every later save on that machine hangs
in its first load of the ops, silently.

While our processes load the ops (:func:`loading_ops`), a build lock they
take is also ``flock``-ed through the descriptor torch keeps open, so the
kernel drops that lock the moment the holder dies, however it dies. A lock
file is then held (:func:`judge`) while a process holds that flock, has the
file open or compiles in its directory (the compiler processes of a killed
build run on); with none of them it is stale: removed, with a warning naming
it. A held lock is waited for, said at INFO after a few seconds, for at most
``FASTPERSIST_BUILD_LOCK_WAIT_S`` (default ``WAIT_S``); then the load fails
with an error naming the lock and how to clear it. A build by a process that
does not run this package, on another machine sharing the directory, cannot
be seen: keep ``TORCH_EXTENSIONS_DIR`` per machine or per venv (the default).
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

from ..util.errors import FastPersistError

logger = logging.getLogger(__name__)

LOCK_NAME = "lock"  # torch.utils.cpp_extension's FileBaton in each op's build directory
WAIT_S = 30 * 60  # a first build of the aio op takes minutes on a few cores; a held lock is waited for this long
SAY_AFTER_S = 5.0  # a wait this long is logged at INFO
POLL_S = 0.5
WAIT_ENV = "FASTPERSIST_BUILD_LOCK_WAIT_S"


@dataclass(frozen=True)
class Verdict:
    """A lock that is there: ``stale`` (no process holds it), or held by ``holders`` (the ones this process saw)."""

    path: str
    stale: bool
    holders: tuple[int, ...]

    def describe(self) -> str:
        """Who holds the lock, for a message."""
        if self.holders:
            return f"held by pid {', '.join(map(str, self.holders))} (a build of DeepSpeed's ops running)"
        return "held by a live process (its flock on the file), on this machine or another"


def wait_limit_s() -> float:
    """How long a held lock is waited for: ``FASTPERSIST_BUILD_LOCK_WAIT_S``, else ``WAIT_S``."""
    value = os.environ.get(WAIT_ENV)
    return float(value) if value else float(WAIT_S)


def holders_of(lock: str) -> tuple[int, ...]:
    """The processes this one can look at that have ``lock`` open or compile in its directory."""
    try:
        st = os.stat(lock)
    except FileNotFoundError:
        return ()
    lock_id = (st.st_dev, st.st_ino)
    directory = os.path.realpath(os.path.dirname(lock))
    found = []
    for pid in (int(name) for name in os.listdir("/proc") if name.isdigit()):
        if pid == os.getpid():
            continue
        try:
            if os.path.realpath(f"/proc/{pid}/cwd") == directory:
                found.append(pid)
                continue
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    fd_st = os.stat(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue  # closed meanwhile, or not a file
                if (fd_st.st_dev, fd_st.st_ino) == lock_id:
                    found.append(pid)
                    break
        except (FileNotFoundError, PermissionError):
            continue  # ended meanwhile, or not this one's to look at: the flock tells for our processes
    return tuple(found)


def flocked(lock: str) -> bool:
    """Whether a live process holds the flock on ``lock`` (see the module)."""
    try:
        fd = os.open(lock, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def judge(lock: str) -> Optional[Verdict]:
    """The verdict on ``lock``, or None where it is gone (see the module)."""
    if not os.path.exists(lock):
        return None
    holders = holders_of(lock)
    return Verdict(lock, not holders and not flocked(lock), holders)


def _inode(path: str) -> Optional[int]:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return None


def _confirmed(lock: str) -> Optional[Verdict]:
    """:func:`judge`, and a stale verdict judged again ``POLL_S`` later on the same file.

    A holder that releases its lock closes it, then removes it: judged in
    between, the lock looks stale, and removing it would fail the holder's own
    removal. By the second look it is gone; a new lock in its place is judged
    on a later round.
    """
    first = judge(lock)
    if first is None or not first.stale:
        return first
    inode = _inode(lock)
    time.sleep(POLL_S)
    again = judge(lock)
    if again is not None and again.stale and _inode(lock) != inode:
        return Verdict(lock, False, ())
    return again


def _locks(root: str) -> list[str]:
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    return [path for name in sorted(names) if os.path.exists(path := os.path.join(root, name, LOCK_NAME))]


def clear_stale(root: str, who: str) -> list[Verdict]:
    """Remove every stale build lock under ``root``; the verdicts on the held ones."""
    held = []
    for lock in _locks(root):
        verdict = _confirmed(lock)
        if verdict is None:
            continue
        if not verdict.stale:
            held.append(verdict)
            continue
        try:
            os.unlink(lock)
        except FileNotFoundError:
            continue
        logger.warning("fastpersist: %s: removed %s, a build lock of DeepSpeed's ops left by a process that died "
                       "while building them (no process holds it); the op is loaded again", who, lock)
    return held


def wait_for_builds(root: str, who: str, limit_s: Optional[float] = None) -> None:
    """Clear the stale build locks under ``root`` and wait for the held ones to go, at most ``limit_s``
    (default :func:`wait_limit_s`); then raise ``FastPersistError`` naming the lock and how to clear it."""
    limit = wait_limit_s() if limit_s is None else limit_s
    start, said = time.monotonic(), False
    while held := clear_stale(root, who):
        waited = time.monotonic() - start
        if waited > limit:
            lock = held[0]
            raise FastPersistError(
                f"{who}: waited more than {limit:g} s for {lock.path}, {lock.describe()}: DeepSpeed's ops cannot "
                f"be loaded while it is there. If no build of them is running (no compiler working in "
                f"{os.path.dirname(lock.path)}), it was left by a process that died: remove it (rm {lock.path}) "
                f"and retry; {WAIT_ENV} sets how long to wait")
        if waited > SAY_AFTER_S and not said:
            logger.info("fastpersist: %s: waiting for %s, %s", who, held[0].path, held[0].describe())
            said = True
        time.sleep(POLL_S)


@contextmanager
def _batons_flocked() -> Iterator[None]:
    """torch's ``FileBaton`` flocks the lock file it creates, through the descriptor it keeps open until done."""
    from torch.utils.file_baton import FileBaton

    original: Callable[[FileBaton], Optional[bool]] = FileBaton.try_acquire

    def try_acquire(baton: FileBaton) -> Optional[bool]:
        acquired = original(baton)
        if acquired:
            fcntl.flock(baton.fd, fcntl.LOCK_EX)  # a new file: nobody else can hold it yet
        return acquired

    FileBaton.try_acquire = try_acquire  # type: ignore[method-assign]
    try:
        yield
    finally:
        FileBaton.try_acquire = original  # type: ignore[method-assign]


@contextmanager
def loading_ops(root: str, who: str) -> Iterator[None]:
    """Around a load of DeepSpeed's ops: wait for the builds first, flock any build lock taken, and clear
    stale locks beside the load (one another process takes meanwhile and leaves when it dies would hold
    torch's own wait inside the load forever)."""
    wait_for_builds(root, who)
    done = threading.Event()

    def watch() -> None:
        while not done.wait(1.0):
            clear_stale(root, who)

    watcher = threading.Thread(target=watch, name="fastpersist-build-locks", daemon=True)
    watcher.start()
    try:
        with _batons_flocked():
            yield
    finally:
        done.set()
        watcher.join()
