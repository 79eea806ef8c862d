"""Tiered checkpoints across nodes when things fail: a lost node's only copies, a node killed mid-replication,
a full local tier, the object store as the persistent tier and its server killed during the drain (torchrun
twice on this machine, ``tests/cluster.py``; S3 from ``tests/object_store.py``).
"""

from __future__ import annotations

import os
import time
import uuid

import pytest

from fastpersist_dist import checkpoint_state
from fastpersist_dist.engine.tiers.replicate import CHUNK_WAIT_ENV
from fastpersist_dist.format.kinds import DCP_METADATA_FILE
from fastpersist_dist.format.records import INDEX_FILE
from fastpersist_dist.format.tiers import TIERS_FILE
from fastpersist_dist.storage.files import TMP_SUFFIX
from fastpersist_dist.storage.persistent import persistent_dir
from fastpersist_dist.tools.inspect import format_report, inspect_checkpoint
from fastpersist_dist.util.events import RETRYING

from .cluster import REPLICA_ROWS, ckpt_of, data_file, data_files, load_on, loads_on, node_copy, save_on, wipe
from .nodes import Nodes


@pytest.mark.engine
@pytest.mark.slow
def test_a_local_only_checkpoint_that_lost_a_node_is_refused_naming_the_newest_durable_one(cluster):
    """s3 was durable, then saved again local-only: its old commit markers left the persistent directory when
    that save started, so it is no longer the newest durable checkpoint; s1 is."""
    saved = save_on(cluster, {"name": "s1", "step": 1, "wait_durable": True},
                  {"name": "s2", "step": 2, "persistent": False},
                  {"name": "s3", "step": 3, "wait_durable": True}, {"name": "s3", "step": 4, "persistent": False})
    assert all(r["saves"][1]["state"] == "local" and r["saves"][2]["durable"] and r["saves"][3]["state"] == "local"
               for r in saved), saved
    left = set(os.listdir(ckpt_of(cluster, "s3")))
    assert TIERS_FILE in left and not left & {INDEX_FILE, DCP_METADATA_FILE}, left
    wipe(cluster, 1)  # s2's data of node 1 was never copied anywhere
    loaded = load_on(cluster, "s2", 2)
    error = loaded[1]["error"]
    assert "is kept only in the local tiers of nodes 1" in error and "no rank of this load holds" in error, error
    assert f"the newest durable checkpoint beside it is {ckpt_of(cluster, 's1')}" in error, error
    # rank 0 had its copy: it raises naming rank 1, instead of waiting for it
    assert "a rank sharing its reads failed: group rank 1" in loaded[0]["error"], loaded[0]


@pytest.mark.engine
@pytest.mark.slow
def test_a_node_killed_during_replication_loses_nothing(cluster):
    """Node 1 killed while a replica is on its way: the checkpoint never shows replicated, no partial replica
    is taken for a copy, and after the restart it loads from the local tiers, as does the durable one before."""
    args = {"saves": [
        {"checkpoint": ckpt_of(cluster, "s1"), "local_dir": cluster["local"], "step": 1, "wait_durable": True},
        {"checkpoint": ckpt_of(cluster, "s2"), "local_dir": cluster["local"], "step": 2, "rows": REPLICA_ROWS,
         "replicas": 1, "persistent": False, "wait_copies": True}], "meet_timeout": 5}  # node 1 never comes
    # where gloo does not notice the killed peer, the transfer to it ends once a chunk has not moved for this long
    nodes = Nodes("save", args, cluster["nodes"], cluster["local"], env={CHUNK_WAIT_ENV: "10"})
    replica_of_0 = os.path.join(node_copy(cluster, 1, "s2"), data_file(0))
    deadline = time.monotonic() + 240
    while not any(n.startswith(f"{data_file(0)}.") and n.endswith(TMP_SUFFIX) for n in _listdir(replica_of_0)):
        assert time.monotonic() < deadline and all(p.poll() is None for p in nodes.procs), "no replica on its way"
        time.sleep(0.002)
    nodes.kill(1)
    nodes.finish(check=False)
    assert checkpoint_state(ckpt_of(cluster, "s2")) == "local"
    assert not os.path.exists(replica_of_0)
    older, loaded = loads_on(cluster, "s1", 1, {}, {"checkpoint": ckpt_of(cluster, "s2"), "step": 2, "rows": REPLICA_ROWS})
    assert older[0]["equal"] and all(r.get("equal") for r in loaded), (older, loaded)


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(os.path.dirname(path))
    except FileNotFoundError:
        return []


@pytest.mark.engine
@pytest.mark.slow
def test_a_full_local_tier_fails_the_save_naming_node_and_path(cluster, small_fs):
    """Node 1's local tier is an 8 MiB filesystem; a save of 16 MiB per rank fails on every rank with an error
    naming node 1 and the path, and the durable checkpoint before it still loads."""
    cluster["nodes"][1] = small_fs
    saved = save_on(cluster, {"name": "s1", "step": 1, "wait_durable": True},
                  {"name": "s2", "step": 2, "rows": 16384})
    for r in saved:
        error = r["saves"][1].get("error", "")
        assert "No space left on device" in error and "node 1" in error and cluster["local"] in error, r
    assert load_on(cluster, "s1", 1)[0]["equal"]


@pytest.mark.engine
@pytest.mark.slow
def test_drained_to_object_storage_and_restarted_from_it(cluster, s3):
    """The persistent tier an S3 bucket (msc://), two ranks a node: durable there; both local tiers lost, a load
    fetches the index (once a node) and every file a rank reads from S3 (checked) into the local tiers, and the
    next load reads those."""
    url = f"msc://s3/{uuid.uuid4().hex}/s1"
    saved = save_on(cluster, {"name": url, "step": 1, "replicas": 1, "wait_durable": True}, msc=True, per_node=2)
    assert all(r["saves"][0]["durable"] for r in saved), saved
    report = inspect_checkpoint(url)
    assert report.ok and report.index == "committed" and report.tiers is not None, report
    assert (report.tiers.state, report.tiers.drained, report.tiers.data_files) == ("durable", 4, 4), report.tiers
    assert report.tiers.after_local_s["durable"] > 0, report.tiers  # the upload took time after the local commit
    assert f"; durable {report.tiers.after_local_s['durable']:.2f} s later" in format_report(report)
    wipe(cluster, 0)
    wipe(cluster, 1)
    loaded, again = loads_on(cluster, url, 1, {}, {}, msc=True, per_node=2)
    assert all(r.get("equal") for r in loaded + again), (loaded, again)
    for node in (0, 1):  # at least the files of the node's ranks
        copy = node_copy(cluster, node, url)
        assert {data_file(2 * node), data_file(2 * node + 1)} <= set(data_files(copy)), os.listdir(copy)
    # the first load fetched each rank's file into its node's local tier, and the index once a node; the second
    # read them there
    index_fetches = [r["fetched"].count(INDEX_FILE) for r in loaded]
    assert sorted(index_fetches[:2]) == sorted(index_fetches[2:]) == [0, 1], loaded
    assert all(r["fetched"] for r in loaded) and not any(r["fetched"] for r in again), (loaded, again)


@pytest.mark.engine
@pytest.mark.slow
def test_the_s3_server_killed_during_the_drain(cluster, s3, tmp_path):
    """S3 killed once every rank's save() returned (the checkpoint committed locally, megatron's metadata.json
    written), back 5 s later: the drain tries again and finishes; it is never durable before; it then loads from
    S3 alone. Not at the first sight of metadata.json: the local commit writes it, and megatron's save() writes
    it again just before a barrier, which a rank 0 refused there by a stopped S3 never reaches, leaving the other
    ranks waiting in it."""
    url = f"msc://s3/{uuid.uuid4().hex}/s1"
    returned = tmp_path / "returned"
    returned.mkdir()
    args = {"msc": True, "saves": [{"checkpoint": url, "local_dir": cluster["local"], "step": 1, "rows": 65536,
                                    "wait_durable": True, "timeout": 240, "returned": str(returned)}]}
    nodes = Nodes("save", args, cluster["nodes"], cluster["local"])
    deadline = time.monotonic() + 240
    while len(os.listdir(returned)) < 2 or (state := _state_or_none(url)) is None:
        assert time.monotonic() < deadline and all(p.poll() is None for p in nodes.procs), "no save returned"
        time.sleep(0.01)
    assert persistent_dir(url).read("metadata.json") is not None
    s3.stop()
    assert state == "local"
    time.sleep(5)
    s3.start()
    saved = nodes.finish()
    assert all(r["saves"][0]["durable"] for r in saved), saved
    assert any(event == RETRYING for r in saved for event, _ in r["warned"]), saved
    wipe(cluster, 0)
    wipe(cluster, 1)
    loaded = load_on(cluster, url, 1, rows=65536, msc=True)
    assert all(r.get("equal") for r in loaded), loaded


def _state_or_none(url: str):
    try:
        return checkpoint_state(url)
    except Exception:  # noqa: BLE001 - not there yet
        return None
