"""Small files made durable: fsync, atomic replacement, quiet removal, digests.

The commit protocol and the writers' status files rely on these: a reader
sees the old file or the whole new one, never a torn write, and a rename is
durable once its directory is fsynced.
"""

from __future__ import annotations

import os
from typing import Optional

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


def atomic_write(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file, or the whole new one."""
    tmp = f"{path}{TMP_SUFFIX}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        unlink_quietly(tmp)  # e.g. a full disk: leave no half-written temp file behind
        raise
    fsync_path(os.path.dirname(path) or ".")


def file_digest(path: str, who: str) -> Optional[str]:
    """XXH3 of the file at ``path``, None if there is none; ``who`` (e.g. "rank 3") starts any error."""
    try:
        with open(path, "rb") as f:
            return digest_bytes(f.read())
    except FileNotFoundError:
        return None
    except OSError as e:
        raise FastPersistError(f"{who}: cannot read {path}: {e}") from e
