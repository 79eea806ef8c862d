"""Small files made durable: fsync, atomic replacement, quiet removal, digests; room for copies; holes punched.

The commit protocol and the writers' status files rely on these: a reader
sees the old file or the whole new one, never a torn write, and a rename is
durable once its directory is fsynced.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import functools
import os
import random
import time
from typing import Callable, Iterable, Optional

from ..format.checksum import digest_bytes
from ..util.errors import FastPersistError

TMP_SUFFIX = ".fastpersist.tmp"  # atomic_write's temp files: only ours are removed when overwriting


def fsync_path(path: str) -> None:
    """Make ``path`` durable: a file's bytes, or a directory's renames and new entries."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def unlink_quietly(path: str) -> None:
    """Remove ``path`` if it can be removed; a file already gone, or one that cannot go, is not an error here."""
    try:
        os.unlink(path)
    except OSError:
        pass


# What a copy into a persistent directory leaves free on its filesystem, or it does not start: the
# checkpoint's own index, megatron's metadata and a framework's tracker file go there after it.
COPY_HEADROOM_BYTES = 64 << 20


def free_bytes(directory: str) -> int:
    """Bytes an unprivileged writer may still put on ``directory``'s filesystem (quotas aside)."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def _no_room_for(path: str, nbytes: int) -> Optional[str]:
    """Why a copy of ``nbytes`` to ``path`` does not start (its filesystem would keep under
    ``COPY_HEADROOM_BYTES`` free), or None."""
    try:
        free = free_bytes(os.path.dirname(path) or ".")
    except OSError:  # the directory missing, say: the copy's own error says so
        return None
    if free >= nbytes + COPY_HEADROOM_BYTES:
        return None
    return (f"no room for {path}: {nbytes} bytes to write, {free} free on its filesystem "
            f"({COPY_HEADROOM_BYTES >> 20} MiB of it kept free)")


# A copy that loses its room to copies allocating at the same moment (each finds the others' bytes taken)
# lets go of what it allocated and tries again after a random pause: the first back takes the room, the next
# finds it taken before allocating. Two collide again when the second starts while the first still allocates,
# so a pause is drawn from a window many times what the contended try took here (an allocation of a large copy
# on a busy machine takes a tenth of a second and more), at least 0.1 s, doubling at each try.
_CONTENDED_TRIES = 5
_CONTENDED_PAUSE_S = 0.1
_CONTENDED_WINDOW_PER_TRY = 8  # the pause window, in multiples of the contended try's own duration


def _contended_pause(attempt: int, took: float) -> float:
    """The random pause before try ``attempt + 1`` after a contended try that took ``took`` seconds."""
    window = max(_CONTENDED_PAUSE_S, _CONTENDED_WINDOW_PER_TRY * took) * 2 ** attempt
    return random.uniform(0, window)  # the random module reseeds itself in forked children


def _allocate(fd: int, path: str, nbytes: int) -> tuple[Optional[str], bool]:
    """One try of ``reserve_room``: why the copy does not start (None if its bytes are allocated), and whether
    other copies allocating at the same moment may be why (the room was there before allocating)."""
    full = _no_room_for(path, nbytes)
    if full is not None or not nbytes:
        return full, False
    # KEEP_SIZE: the file stays empty to its writer (DeepSpeed's FastFileWriter appends its unaligned tail).
    err = 0 if _fallocate()(fd, _FALLOC_FL_KEEP_SIZE, 0, nbytes) == 0 else ctypes.get_errno()
    if err in _UNSUPPORTED:
        return None, False
    if err:
        return f"no room for {path}: allocating its {nbytes} bytes failed: {os.strerror(err)}", err == errno.ENOSPC
    free = free_bytes(os.path.dirname(path) or ".")
    if free < COPY_HEADROOM_BYTES:
        return (f"no room for {path}: its {nbytes} bytes allocated left {free} free on its filesystem, "
                f"under the {COPY_HEADROOM_BYTES >> 20} MiB kept free (other copies took the room)"), True
    return None, False


def reserve_room(fd: int, path: str, nbytes: int, who: str) -> None:
    """Allocate the ``nbytes`` of a copy to ``path`` (its new, empty temporary file open as ``fd``) before they are
    written, keeping ``COPY_HEADROOM_BYTES`` free on the filesystem, or raise ``FastPersistError`` (naming
    ``who``) with nothing allocated.

    Why: the ranks' copies into a persistent directory start at once, and a copy that fills a shared filesystem
    fails what everything else writes there (the checkpoint's commit among it) and the copies themselves midway,
    then fills it again at every retry. Each finding room for its own file is not enough: together they can
    overfill it. Allocated up front, a copy that does not fit (or exceeds a quota, which statvfs does not show)
    is refused before it writes. An allocation is not atomic (a filesystem takes the blocks a few at a time), so
    copies allocating at the same moment can each find the others' blocks taken and all be refused where one
    would fit: each lets go and tries again after a random pause scaled to how long its try took, and the
    first back takes the room. Where the
    filesystem cannot allocate ahead (NFS before 4.2), the check alone.
    """
    for attempt in range(_CONTENDED_TRIES):
        began = time.monotonic()
        full, contended = _allocate(fd, path, nbytes)
        if full is None:
            return
        os.ftruncate(fd, 0)
        if not contended or attempt == _CONTENDED_TRIES - 1:
            raise FastPersistError(f"{who}: {full}")
        time.sleep(_contended_pause(attempt, time.monotonic() - began))


def process_temporary(path: str) -> str:
    """``path``'s temporary name for this process (several processes of a node may write one file at once)."""
    return f"{path}.{os.getpid()}{TMP_SUFFIX}"


def replace_durably(tmp: str, path: str) -> None:
    """Rename the complete (fsynced) file ``tmp`` over ``path``, the rename made durable: readers see the old
    file, or the whole new one, after a crash too."""
    os.replace(tmp, path)
    fsync_path(os.path.dirname(path) or ".")


def atomic_write(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file, or the whole new one."""
    tmp = f"{path}{TMP_SUFFIX}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        replace_durably(tmp, path)
    except BaseException:
        unlink_quietly(tmp)  # e.g. a full disk: leave no half-written temp file behind
        raise


MAKING_PREFIX = ".fastpersist_making."  # made_once's lock file beside each file it makes


def made_once(path: str, make: Callable[[], None], since: float) -> bool:
    """``make()``, which writes ``path`` and puts it in place whole (a rename), unless another process already put
    one written since ``since`` (a ``time.time()``) in place; whether this process made it.

    The processes of a machine that need the same file (the ranks of a node
    fetching one file of a checkpoint for a load that started at ``since``)
    make it one at a time (an ``flock`` on a file beside it): the first makes
    it, the others find it new and use it. An older file (one found damaged)
    is made again.
    """
    head, tail = os.path.split(path)
    fd = os.open(os.path.join(head, MAKING_PREFIX + tail), os.O_RDONLY | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if os.stat(path).st_mtime >= since:
                return False
        except FileNotFoundError:
            pass
        make()
        return True
    finally:
        os.close(fd)


def file_digest(path: str, who: str) -> Optional[str]:
    """XXH3 of the file at ``path``, None if there is none; ``who`` (e.g. "rank 3") starts any error."""
    try:
        with open(path, "rb") as f:
            return digest_bytes(f.read())
    except FileNotFoundError:
        return None
    except OSError as e:
        raise FastPersistError(f"{who}: cannot read {path}: {e}") from e


_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02  # linux/falloc.h
# What fallocate fails with where the filesystem cannot do what it is asked (rather than that it failed).
_UNSUPPORTED = (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


@functools.cache
def _fallocate() -> ctypes._CFuncPtr:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    fn = libc.fallocate
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    return fn


def punch_holes(path: str, ranges: Iterable[tuple[int, int]]) -> None:
    """Free the bytes of each ``(offset, length)`` of ``path`` (they read as zeros after); size and other bytes stay.

    Linux ``fallocate(PUNCH_HOLE | KEEP_SIZE)``: ext4, XFS, btrfs, tmpfs, and
    NFS 4.2 and Lustre 2.14 and later. Raises ``OSError`` (``EOPNOTSUPP``) where
    the filesystem cannot, having punched nothing after the first range.
    """
    fd = os.open(path, os.O_WRONLY)
    try:
        for offset, length in ranges:
            if length and _fallocate()(fd, _FALLOC_FL_KEEP_SIZE | _FALLOC_FL_PUNCH_HOLE, offset, length) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"cannot punch bytes {offset}+{length} out of {path}: {os.strerror(err)}")
        os.fsync(fd)
    finally:
        os.close(fd)


def cannot_punch(error: OSError) -> bool:
    """Whether ``error`` says the filesystem does not punch holes (rather than that something failed)."""
    return error.errno in _UNSUPPORTED
