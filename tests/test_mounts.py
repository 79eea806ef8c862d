"""Which mount holds a path, as /proc/self/mountinfo says, and whether a tmpfs gives its files huge pages."""

from __future__ import annotations

import pytest

from fastpersist_dist.storage.mounts import Mount, mount_of, parse_mountinfo, tmpfs_huge_pages

pytestmark = pytest.mark.engine

MOUNTINFO = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
30 22 0:25 / /dev/shm rw,nosuid,nodev shared:2 - tmpfs tmpfs rw
31 22 0:40 / /mnt/data rw,relatime shared:3 - nfs4 srv:/export rw,vers=4.2
32 22 259:0 / /mnt/data2 rw,relatime shared:4 - xfs /dev/nvme0n1 rw
33 31 0:41 / /mnt/data/my\\040ckpts rw,relatime - lustre 10.0.0.1@tcp:/fs rw
34 22 0:26 / /dev/shm rw,nosuid,nodev - tmpfs tmpfs rw,size=1024k
35 22 0:27 / /mnt/ckpt rw,relatime - tmpfs tmpfs rw,size=8g,huge=within_size
"""


def test_the_filesystem_of_a_path_is_its_deepest_mount_the_top_one_of_a_point():
    mounts = parse_mountinfo(MOUNTINFO)
    assert mount_of("/work/ckpt", mounts) == Mount("/", "ext4", ("rw",))
    assert mount_of("/mnt/data/step_1", mounts) == Mount("/mnt/data", "nfs4", ("rw", "vers=4.2"))
    assert mount_of("/mnt/data2/step_1", mounts).point == "/mnt/data2"  # not under /mnt/data
    assert mount_of("/mnt/data/my ckpts/step_1", mounts)[:2] == ("/mnt/data/my ckpts", "lustre")
    assert mount_of("/dev/shm", mounts) == Mount("/dev/shm", "tmpfs", ("rw", "size=1024k"))
    assert mount_of("/mnt/ckpt", mounts) == Mount("/mnt/ckpt", "tmpfs", ("rw", "size=8g", "huge=within_size"))
    assert len(mounts) == 7


def test_a_tmpfs_gives_files_huge_pages_as_its_mount_says_unless_the_system_forces_or_denies_them():
    mounts = parse_mountinfo(MOUNTINFO)
    plain, huge = mount_of("/dev/shm", mounts), mount_of("/mnt/ckpt", mounts)
    default = "always within_size advise [never] deny force"
    assert (tmpfs_huge_pages(plain, default), tmpfs_huge_pages(huge, default)) == ("never", "within_size")
    assert tmpfs_huge_pages(huge, "") == "within_size"  # no such file (an older kernel)
    assert tmpfs_huge_pages(plain, "always within_size advise never deny [force]") == "force"
    assert tmpfs_huge_pages(huge, "always within_size advise never [deny] force") == "deny"
