"""Where a load finds the copies of a tiered checkpoint that is not durable yet (``engine/tiers/copies.py``):
this node's copies at once, the persistent tier's only where a rank needs them. Real directories, one process."""

from __future__ import annotations

import os
import time

import pytest

from fastpersist_dist.engine.tiers.copies import Copies
from fastpersist_dist.engine.tiers.state import drained_marker
from fastpersist_dist.format.records import INDEX_FILE
from fastpersist_dist.format.tiers import DURABLE, LOCAL, TIERS_FILE, TierManifest
from fastpersist_dist.storage.persistent import PosixDir

pytestmark = pytest.mark.engine

FILES = {"__0_0.distcp": 0, "__1_0.distcp": 1, "__2_0.distcp": 2}  # ranks 0 and 1 on node 0, rank 2 on node 1


@pytest.fixture
def tiered(tmp_path) -> tuple[Copies, str, str]:
    """Node 0's view: its copy holds ranks 0 and 1's files; the drain copied rank 0's and rank 2's to the
    persistent directory (their markers there), not yet rank 1's."""
    home, local = tmp_path / "persistent" / "iter_1", tmp_path / "local" / "iter_1-copy"
    home.mkdir(parents=True)
    local.mkdir(parents=True)
    manifest = TierManifest(checkpoint_id="c" * 32, checkpoint_dir=str(home), local_dir=str(tmp_path / "local"),
                            nodes=((0, 1), (2,)), files=dict(FILES), index_files=(INDEX_FILE,),
                            index_xxh3_64="0" * 16, state=LOCAL, created=time.time())
    (home / TIERS_FILE).write_bytes(manifest.to_json_bytes())
    for name in ("__0_0.distcp", "__1_0.distcp"):
        (local / name).write_bytes(b"x")
    for name in ("__0_0.distcp", "__2_0.distcp"):
        (home / name).write_bytes(b"x")
        (home / drained_marker(manifest, name)).write_bytes(b"")
    return Copies(str(home), manifest, str(local), str(local), local_ok=True), str(home), str(local)


def test_the_persistent_tier_is_looked_up_only_for_requested_files_this_node_lacks(tiered):
    copies, home, local = tiered
    copies.locate(["__0_0.distcp", "__2_0.distcp"])  # rank 0's file is here: its drained copy is not looked for
    assert copies.dirs == {"__0_0.distcp": (local,), "__1_0.distcp": (local,), "__2_0.distcp": (home,)}


def test_a_failed_local_copy_finds_the_persistent_one_where_the_drain_put_it(tiered):
    copies, home, local = tiered
    copies.locate(["__0_0.distcp", "__1_0.distcp"])
    assert copies.further("__0_0.distcp") and copies.of("__0_0.distcp") == (local, home)
    assert not copies.further("__0_0.distcp")  # looked up once
    assert not copies.further("__1_0.distcp") and copies.of("__1_0.distcp") == (local,)  # not drained yet


def test_a_file_out_of_reach_says_which_nodes_keep_it(tiered):
    copies, home, local = tiered
    os.unlink(os.path.join(home, drained_marker(copies.manifest, "__2_0.distcp")))
    copies.locate(["__2_0.distcp"])
    assert copies.of("__2_0.distcp") == ()
    why = copies.why_missing("__2_0.distcp")
    assert why.startswith(f"__2_0.distcp (rank 2) of checkpoint {home}, which is not durable, is kept only in the "
                          "local tiers of nodes 1, and no rank of this load holds an intact copy"), why


def test_markers_gone_because_the_checkpoint_became_durable_meanwhile_find_every_file_there(tiered):
    copies, home, local = tiered
    copies.locate(["__0_0.distcp"])
    for name in os.listdir(home):  # what the drain's commit does: the state durable, the markers removed
        if name.startswith(".fastpersist_drained."):
            os.unlink(os.path.join(home, name))
    PosixDir(home).write(TIERS_FILE, copies.manifest.with_state(DURABLE, time.time()).to_json_bytes())
    assert copies.further("__1_0.distcp") and copies.of("__1_0.distcp") == (local, home)
