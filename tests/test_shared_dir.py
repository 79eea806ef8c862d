"""A save refuses, before writing anything, where the ranks do not see one checkpoint directory."""

from __future__ import annotations

import ctypes
import os

import pytest
from megatron.core.dist_checkpointing.core import CheckpointingException

from fastpersist_dist import SaveFailedError, prepare_checkpoint_dir
from fastpersist_dist.format.records import data_file_name
from fastpersist_dist.storage.shared_dir import DirView, view_of, why_not_shared
from fastpersist_dist.tools.ranks import run_ranks
from fastpersist_dist.tools.verify import verify_checkpoint

from .helpers import global_tensor, native_strategy, save, sharded

pytestmark = pytest.mark.contract

def _view(machine: str = "boot-a", fstype: str = "ext4", device: int = 0x801, inode: int = 7) -> DirView:
    return DirView(machine, f"host-{machine}", fstype, "/mnt", device, inode)


@pytest.mark.parametrize(
    "mine,first,needle",
    [
        (_view(), _view(), None),  # the same directory
        (_view(inode=8), _view(), "as a different directory than rank 0 on the same machine"),
        (_view(device=0x802), _view(), "as a different directory than rank 0 on the same machine"),
        (_view(fstype="nfs4", device=0x30), _view(fstype="nfs4", device=0x31), None),  # one export mounted twice
        (_view(fstype="nfs4", inode=8), _view(fstype="nfs4"), "different directory"),  # same mount, other inode
        (_view("boot-b"), _view(), "rank 1's is on ext4 and rank 0's is on ext4, a filesystem only one machine"),
        (_view("boot-b", fstype="nfs4"), _view(fstype="xfs"), "rank 0's is on xfs"),
        (_view("boot-b", fstype="tmpfs"), _view(fstype="lustre"), "rank 1's is on tmpfs"),
        (_view("boot-b", fstype="lustre", device=1, inode=2), _view(fstype="lustre"), None),
        (_view("boot-b", fstype="fuse.weka"), _view(fstype="fuse.weka", inode=99), None),  # per-client inodes
        (None, _view(), None),  # missing: the directory check says so
    ],
)
def test_a_rank_shares_rank_0s_directory_unless_evidently_not(mine, first, needle):
    why = why_not_shared(mine, first, 1, "/mnt/step_1")
    if needle is None:
        assert why is None, why
    else:
        assert why is not None and needle in why and "rank 1 (host host-" in why and "/mnt/step_1" in why, why
        assert "require_shared_dir=False" in why, why
    assert why_not_shared(mine, first, 0, "/mnt/step_1") is None


def test_a_view_names_this_machine_filesystem_and_inode(tmp_path):
    view = view_of(str(tmp_path))
    st = os.stat(tmp_path)
    assert view is not None and (view.device, view.inode) == (st.st_dev, st.st_ino)
    assert view.fstype != "unknown" and str(tmp_path).startswith(view.mount_point)
    assert view_of(str(tmp_path / "missing")) is None


CLONE_NEWNS, MS_BIND, MS_REC, MS_PRIVATE = 0x00020000, 4096, 1 << 14, 1 << 18


def _own_directory_at(path: str, other: str) -> None:
    """Give this process its own mount namespace with ``other`` bind-mounted over ``path``:
    what a rank in another container (or on another node's local disk) sees."""
    libc = ctypes.CDLL(None, use_errno=True)
    steps = [("unshare", lambda: libc.unshare(CLONE_NEWNS)),
             ("make / private", lambda: libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None)),
             ("bind mount", lambda: libc.mount(other.encode(), path.encode(), None, MS_BIND, None))]
    for what, step in steps:
        if step() != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")


def _save_where_rank_1_sees_another_directory(rank: int, world: int, root: str, require: bool) -> list[str]:
    mine = os.path.join(root, "ckpts")
    if rank == 1:
        _own_directory_at(mine, os.path.join(root, "elsewhere"))
    path = os.path.join(mine, "step_1")
    sd = {"w": sharded("w", global_tensor("w", (8, 4)), rank, world, 0)}
    if require:
        errors = []
        for attempt in (lambda: prepare_checkpoint_dir(path),
                        lambda: save(sd, path, native_strategy())):
            with pytest.raises(CheckpointingException) as info:
                attempt()
            assert isinstance(info.value, SaveFailedError), repr(info.value)
            errors.append(str(info.value))
        return errors
    prepare_checkpoint_dir(path, require_shared_dir=False)
    save(sd, path, native_strategy(require_shared_dir=False))
    return []


def test_a_save_where_a_rank_sees_another_directory_is_refused_before_writing(root, tmp_path):
    """Rank 1 gets its own mount namespace (CAP_SYS_ADMIN: the ``root`` need) with another directory bound there."""
    for sub in ("ckpts/step_1", "elsewhere/step_1"):  # each "node" has the directory, as after a mkdir -p on each
        (tmp_path / sub).mkdir(parents=True)
    ckpt, other = tmp_path / "ckpts" / "step_1", tmp_path / "elsewhere" / "step_1"
    for rank, errors in enumerate(run_ranks(2, _save_where_rank_1_sees_another_directory, str(tmp_path), True)):
        for m in errors:  # the same error on both ranks, from prepare_checkpoint_dir and from the save
            assert f"rank 1 (host {os.uname().nodename}) sees {ckpt} as a different directory than rank 0" in m, m
            assert "nothing was written" in m and "require_shared_dir=False" in m, m
    for d in (ckpt, other):
        assert not [n for n in os.listdir(d) if "fastpersist" in n], os.listdir(d)
    # Told to go on, each rank writes where it is, and rank 0's directory lacks rank 1's file: not a checkpoint.
    run_ranks(2, _save_where_rank_1_sees_another_directory, str(tmp_path), False)
    assert os.path.exists(other / data_file_name(1)) and not os.path.exists(ckpt / data_file_name(1))
    report = verify_checkpoint(str(ckpt))
    assert not report.ok and any(data_file_name(1) in p for p in report.problems), report.problems
