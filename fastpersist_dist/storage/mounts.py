"""Which filesystem holds a path, and how it is mounted, as ``/proc/self/mountinfo`` says.

The facts the storage layer decides by: whether every rank sees one directory
(``shared_dir.py``), whether a path is memory (tmpfs: plain writes and reads
there, no bounce through the locked buffer), and whether a tmpfs hands its
files huge pages (a local tier in memory without them allocates and frees a
page per base page written: 4 KiB on x86).
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash in paths as octal escapes."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


class Mount(NamedTuple):
    """One line of ``/proc/<pid>/mountinfo``: where, which filesystem, and its superblock's options."""

    point: str
    fstype: str
    options: tuple[str, ...] = ()  # e.g. ("rw", "size=8g", "huge=within_size")


def parse_mountinfo(text: str) -> list[Mount]:
    """Each mount of ``/proc/<pid>/mountinfo``, in order."""
    mounts = []
    for line in text.splitlines():
        fields = line.split(" ")
        if " - " not in line or len(fields) < 5:
            continue
        after = line.split(" - ", 1)[1].split(" ")
        mounts.append(Mount(_unescape(fields[4]), after[0], tuple(after[2].split(",")) if len(after) > 2 else ()))
    return mounts


def mount_of(path: str, mounts: list[Mount]) -> Mount:
    """The mount holding absolute ``path``: the longest mount point above it, the last one listed where several
    are mounted on the same point (the one on top)."""
    best = Mount("/", "unknown")
    best_len = -1
    for mount in mounts:
        point = mount.point
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= best_len:
            best, best_len = mount, len(point)
    return best


def mounted_filesystem(path: str) -> Optional[Mount]:
    """The mount holding ``path`` for this process, or None where mountinfo is unreadable."""
    try:
        with open("/proc/self/mountinfo") as f:
            return mount_of(os.path.realpath(path), parse_mountinfo(f.read()))
    except OSError:
        return None


# Filesystems whose files are memory: O_DIRECT there is a copy like any other, and plain
# reads and writes straight from and into the tensors save the bounce through the locked buffer.
IN_MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})


def filesystem_type(path: str) -> Optional[str]:
    """Type of the filesystem holding ``path`` (see :func:`mounted_filesystem`), or None if unknown."""
    found = mounted_filesystem(path)
    return None if found is None else found.fstype


def on_memory_filesystem(path: str) -> bool:
    """Whether ``path`` is on an in-memory filesystem (tmpfs), where a read or a write is a memory copy."""
    return filesystem_type(path) in IN_MEMORY_FILESYSTEMS


SHMEM_ENABLED = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
# tmpfs ``huge=`` modes (and the system-wide "force") under which a file's pages written with write()
# come 2 MiB at a time ("advise" gives them only to memory mappings that ask with madvise).
HUGE_WRITES = frozenset({"always", "within_size", "force"})


def tmpfs_huge_pages(mount: Mount, shmem_enabled: str = "") -> str:
    """The ``huge=`` mode of tmpfs ``mount`` ("never" where its options name none), or the system-wide
    "force" or "deny" of ``shmem_enabled`` (the text of :data:`SHMEM_ENABLED`, the choice in brackets),
    which override every tmpfs mount."""
    chosen = next((w[1:-1] for w in shmem_enabled.split() if w.startswith("[") and w.endswith("]")), "")
    if chosen in ("force", "deny"):
        return chosen
    return next((o.split("=", 1)[1] for o in mount.options if o.startswith("huge=")), "never")


def _system_huge_pages() -> str:
    """The text of :data:`SHMEM_ENABLED` ("" where the kernel has none)."""
    try:
        with open(SHMEM_ENABLED) as f:
            return f.read()
    except OSError:
        return ""


def _tmpfs_mode(mount: Mount) -> Optional[str]:
    """The huge-page mode of ``mount`` as this kernel applies it (:func:`tmpfs_huge_pages`); None where it is not
    a tmpfs."""
    return tmpfs_huge_pages(mount, _system_huge_pages()) if mount.fstype == "tmpfs" else None


def small_pages_in_memory(path: str) -> Optional[tuple[Mount, str]]:
    """The tmpfs mount holding ``path`` and its huge-page mode (:func:`tmpfs_huge_pages`) where its files'
    pages are allocated and freed one base page at a time, else None: writing a file there costs a page
    allocation per base page (4 KiB on x86), on the cores training uses."""
    mount = mounted_filesystem(path)
    mode = None if mount is None else _tmpfs_mode(mount)
    return None if mode is None or mode in HUGE_WRITES else (mount, mode)


def describe_filesystem(path: str) -> str:
    """What holds ``path``, for a report beside figures measured there: its filesystem type and mount point,
    and for a tmpfs its huge-page mode (e.g. "tmpfs at /dev/shm, huge=never")."""
    mount = mounted_filesystem(path)
    if mount is None:
        return "unknown"
    mode = _tmpfs_mode(mount)
    return f"{mount.fstype} at {mount.point}" + ("" if mode is None else f", huge={mode}")
