"""Whether every rank of a save sees one and the same checkpoint directory.

A distributed checkpoint is one directory: every rank writes its data file
into it and rank 0 commits an index naming all of them. When the path lies on
storage each machine has for itself (a local NVMe mount, tmpfs, a container's
own volume), every node gets its own directory of that name, the save
succeeds on every rank, and no node holds a loadable checkpoint; nobody learns
of it before the resume. So before anything is written each rank compares its
view of the directory with rank 0's (:func:`why_not_shared`):

* on rank 0's machine (same kernel boot id): the same inode on the same device
  (not another mount namespace, bind mount or container volume), and, where
  the devices differ, not a filesystem only one machine can mount on either side;
* on another machine: neither side on such a filesystem (``LOCAL_FILESYSTEMS``).

Network and parallel filesystems (NFS, Lustre, GPFS, fuse, ...) pass across
machines: their device numbers differ from client to client, and some number
inodes per client, so nothing more can be compared without writing a file.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple, Optional

# Filesystems a single machine mounts: a directory on one is never another machine's.
LOCAL_FILESYSTEMS = frozenset({
    "ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "bcachefs", "zfs", "jfs", "reiserfs", "nilfs2",
    "tmpfs", "ramfs", "devtmpfs", "overlay", "vfat", "msdos", "exfat", "ntfs", "ntfs3", "hfsplus",
})
OPT_OUT = "require_shared_dir=False"


@dataclass(frozen=True)
class DirView:
    """How one process sees a directory: which machine, filesystem and inode."""

    machine: str  # the kernel's boot id (the host name where there is none)
    host: str
    fstype: str
    mount_point: str
    device: int
    inode: int

    def describe(self) -> str:
        return f"{self.fstype} mounted at {self.mount_point} (device {self.device:#x}, inode {self.inode})"


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


@lru_cache(maxsize=1)
def _machine() -> tuple[str, str]:
    host = socket.gethostname()
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or host, host
    except OSError:
        return host, host


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


def small_pages_in_memory(path: str) -> Optional[Mount]:
    """The tmpfs mount holding ``path`` where its files' pages are allocated and freed 4 KiB at a time (no
    ``huge=always`` or ``huge=within_size``), else None: writing a file there costs a page allocation per
    4 KiB, on the cores training uses."""
    mount = mounted_filesystem(path)
    if mount is None or mount.fstype != "tmpfs":
        return None
    try:
        with open(SHMEM_ENABLED) as f:
            system = f.read()
    except OSError:
        system = ""
    return None if tmpfs_huge_pages(mount, system) in HUGE_WRITES else mount


def view_of(path: str) -> Optional[DirView]:
    """This process's view of directory ``path``, or None where it cannot be seen (missing)."""
    real = os.path.realpath(path)
    try:
        st = os.stat(real)
    except OSError:
        return None
    point, fstype, _ = mounted_filesystem(real) or Mount("/", "unknown")
    machine, host = _machine()
    return DirView(machine, host, fstype, point, st.st_dev, st.st_ino)


def why_not_shared(mine: Optional[DirView], first: Optional[DirView], rank: int, path: str) -> Optional[str]:
    """Why rank ``rank`` (view ``mine``) does not share directory ``path`` with rank 0 (view ``first``), or None.

    None also where a view is missing: the directory checks say why.
    """
    if mine is None or first is None or rank == 0:
        return None
    who = f"rank {rank} (host {mine.host})"
    local = [f"{name}'s is on {v.fstype}" for name, v in ((f"rank {rank}", mine), ("rank 0", first))
             if v.fstype in LOCAL_FILESYSTEMS]
    if mine.machine == first.machine:
        if (mine.device, mine.inode) == (first.device, first.inode):
            return None
        if mine.device != first.device and not local:
            return None  # e.g. the same NFS export mounted twice: device numbers differ, inodes may too
        return (f"{who} sees {path} as a different directory than rank 0 on the same machine: "
                f"{mine.describe()} against {first.describe()} (another mount namespace, bind mount or "
                f"container volume?); {_consequence()}")
    if not local:
        return None
    return (f"{who} and rank 0 (host {first.host}) are on different machines, and {' and '.join(local)}, "
            f"a filesystem only one machine mounts, so they cannot see one directory {path} "
            f"(rank {rank}: {mine.describe()}; rank 0: {first.describe()}); {_consequence()}")


def _consequence() -> str:
    return ("rank 0 would commit an index naming data files it cannot see, and no node would hold a loadable "
            "checkpoint. Save to a directory every rank shares (NFS, Lustre, GPFS, ...), or, to write "
            f"node-local parts on purpose and gather them yourself, pass {OPT_OUT}")
