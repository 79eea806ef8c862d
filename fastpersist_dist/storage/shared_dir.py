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
from typing import Optional

from .mounts import Mount, mounted_filesystem

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


@lru_cache(maxsize=1)
def _machine() -> tuple[str, str]:
    host = socket.gethostname()
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or host, host
    except OSError:
        return host, host


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


def same_directory(a: DirView, b: DirView) -> Optional[bool]:
    """Whether two processes' views of one path are of one directory: True where surely (one machine, one
    inode), False where surely not, None where only a file written on one side and looked for on the other would
    tell (a network filesystem on both sides: device numbers differ from client to client, inodes may too)."""
    if a.machine == b.machine and (a.device, a.inode) == (b.device, b.inode):
        return True
    if a.fstype in LOCAL_FILESYSTEMS or b.fstype in LOCAL_FILESYSTEMS:
        return False
    if a.machine == b.machine and a.device == b.device:
        return False  # one mount, another inode
    return None  # e.g. the same NFS export mounted twice, or on two machines


def why_not_shared(mine: Optional[DirView], first: Optional[DirView], rank: int, path: str) -> Optional[str]:
    """Why rank ``rank`` (view ``mine``) does not share directory ``path`` with rank 0 (view ``first``), or None.

    None also where a view is missing: the directory checks say why.
    """
    if mine is None or first is None or rank == 0 or same_directory(mine, first) is not False:
        return None
    who = f"rank {rank} (host {mine.host})"
    local = [f"{name}'s is on {v.fstype}" for name, v in ((f"rank {rank}", mine), ("rank 0", first))
             if v.fstype in LOCAL_FILESYSTEMS]
    if mine.machine == first.machine:
        return (f"{who} sees {path} as a different directory than rank 0 on the same machine: "
                f"{mine.describe()} against {first.describe()} (another mount namespace, bind mount or "
                f"container volume?); {_consequence()}")
    return (f"{who} and rank 0 (host {first.host}) are on different machines, and {' and '.join(local)}, "
            f"a filesystem only one machine mounts, so they cannot see one directory {path} "
            f"(rank {rank}: {mine.describe()}; rank 0: {first.describe()}); {_consequence()}")


def _consequence() -> str:
    return ("rank 0 would commit an index naming data files it cannot see, and no node would hold a loadable "
            "checkpoint. Save to a directory every rank shares (NFS, Lustre, GPFS, ...), or, to write "
            f"node-local parts on purpose and gather them yourself, pass {OPT_OUT}")
