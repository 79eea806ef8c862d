"""A local tier is each node's own storage: nodes that see one directory as ``local_dir`` are refused before
anything is written (their first ranks would write the same index files into it), and a network filesystem
under it is warned of (only a file written on one node and looked for on another would tell)."""

from __future__ import annotations

import os

import pytest
from megatron.core import dist_checkpointing

from fastpersist_dist import FastPersistSaveStrategy, checkpoint_state, prepare_checkpoint_dir
from fastpersist_dist.engine.tiers.topology import LocalTierViews
from fastpersist_dist.storage.shared_dir import DirView
from fastpersist_dist.tools.ranks import run_ranks

from .tiers_driver import state

pytestmark = pytest.mark.engine


def _view(machine: str = "boot-a", fstype: str = "ext4", device: int = 0x801, inode: int = 7) -> DirView:
    return DirView(machine, f"host-{machine}", fstype, "/mnt", device, inode)


@pytest.mark.parametrize(
    "views,pair,mounts",
    [
        ({0: _view(), 1: _view(inode=8)}, None, []),  # a directory each on one machine (mount namespaces)
        ({0: _view(), 1: _view()}, (0, 1), []),  # one directory
        ({0: _view(), 2: _view(inode=9), 3: _view()}, (0, 3), []),  # node 1's view could not be made
        ({0: _view(), 1: _view("boot-b")}, None, []),  # each machine's own disk, the same numbers on both
        ({0: _view(fstype="nfs4", device=0x30), 1: _view("boot-b", fstype="nfs4", device=0x31)}, None,
         ["nfs4 at /mnt"]),
        ({0: _view(fstype="nfs4"), 1: _view(fstype="nfs4", inode=8)}, None, []),  # one mount, two directories
        ({0: _view(fstype="tmpfs"), 1: _view("boot-b", fstype="lustre"), 2: _view("boot-c", fstype="tmpfs")},
         None, []),  # one node's tier on a network filesystem: nothing to share it with
    ],
)
def test_which_nodes_see_one_local_tier(views, pair, mounts):
    tier = LocalTierViews(views)
    assert tier.one_directory() == pair and tier.network_mounts() == mounts


def _saved_as_two_nodes(rank: int, world: int, root: str) -> str:
    os.environ["GROUP_RANK"] = str(rank)  # torchrun's node rank: each rank a node of its own, on this machine
    ckpt = os.path.join(root, "persistent", "step_1")
    prepare_checkpoint_dir(ckpt)
    strategy = FastPersistSaveStrategy(local_dir=os.path.join(root, "local"), replicas=1)
    try:
        dist_checkpointing.save(state(rank, world, 1), ckpt, sharded_strategy=strategy)
    except ValueError as e:
        return str(e)
    return "saved"


def test_nodes_that_share_their_local_tier_are_refused_before_writing(tmp_path):
    """Two nodes on one machine given one ``local_dir`` (no directory of their own): every rank refuses alike."""
    results = run_ranks(2, _saved_as_two_nodes, str(tmp_path))
    local = tmp_path / "local"
    assert results[0] == results[1], results
    assert results[0].startswith(f"local_dir {local} is one directory for node 0 (first rank 0) and node 1 "
                                 "(first rank 1): ") and "each node a directory of its own" in results[0], results
    assert checkpoint_state(str(tmp_path / "persistent" / "step_1")) is None
    assert not [f for _, _, files in os.walk(local) for f in files], "nothing written into the local tier"
