"""Tiered checkpoints across nodes: torchrun twice on this machine (``--nnodes 2``), each node with its own local
tier at one path (tests/nodes.py), the persistent tier a directory both see or an S3 bucket (tests/object_store.py).

The adapters' part (megatron's save() and load() around a tiered strategy) runs on every stack (``contract``);
the engine's behaviour (replicas, refusals, faults, object storage) on the main stack (``engine``).
"""

from __future__ import annotations

import os
import shutil

import pytest

from fastpersist_dist import checkpoint_state
from fastpersist_dist.engine.index_reader import read_index
from fastpersist_dist.engine.tiers.state import read_manifest
from fastpersist_dist.format.kinds import DCP_METADATA_FILE
from fastpersist_dist.format.records import INDEX_FILE
from fastpersist_dist.format.tiers import DURABLE, LOCAL, PENDING_DIR, TIERS_FILE
from fastpersist_dist.storage.persistent import persistent_dir
from fastpersist_dist.storage.mounts import small_pages_in_memory
from fastpersist_dist.tools.inspect import format_report, inspect_checkpoint
from fastpersist_dist.util.events import NEXT_COPY

from .cluster import ckpt_of, data_file, data_files, load_on, loads_on, local_view, node_copy, save_on, wipe
from .helpers import flip_bit


@pytest.mark.contract
@pytest.mark.slow
def test_each_node_keeps_its_share_and_loads_it_from_its_own_copy(cluster):
    """Two async saves: each local once its call returns (durable already where the drain was as quick), then
    durable, each rank's data file copied to the persistent directory by its own drain. The second's node copies
    are removed, so it loads from the persistent tier alone; the first's persistent data files are removed, so it
    loads only from each node's own copy."""
    saved = save_on(cluster, {"name": "s1", "step": 1, "async": True, "wait_durable": True},
                  {"name": "s2", "step": 2, "async": True, "wait_durable": True})
    first = [r["saves"][0] for r in saved]
    assert all(save["state_after_save"] in (LOCAL, DURABLE) for save in first), first
    assert all(save["durable"] for r in saved for save in r["saves"]), saved
    for r in saved:
        mine = [os.path.join(os.path.abspath(ckpt_of(cluster, name)), data_file(r["rank"])) for name in ("s1", "s2")]
        assert r["drained"] == mine and not r["warnings"], r
    for node in (0, 1):  # s2 can only load from the persistent tier
        shutil.rmtree(node_copy(cluster, node, "s2"))
    for node in (0, 1):  # the node's own rank's data file and the whole index
        copy = node_copy(cluster, node, "s1")
        assert {TIERS_FILE, INDEX_FILE} <= set(os.listdir(copy)) and len(data_files(copy)) == 1, os.listdir(copy)
    ckpt = ckpt_of(cluster, "s1")
    assert checkpoint_state(ckpt) == "durable" and len(data_files(ckpt)) == 2
    manifest = read_manifest(persistent_dir(ckpt))
    assert manifest.created <= manifest.reached[DURABLE], manifest  # committed locally first
    assert not os.listdir(os.path.join(ckpt, PENDING_DIR))  # the pending index went with the commit there
    for name in data_files(ckpt):  # s1 only from the nodes' own copies
        os.unlink(os.path.join(ckpt, name))
    ranks = load_on(cluster, "s2", 2, loads=[{}, {"checkpoint": ckpt, "step": 1}])
    assert all(one.get("equal") for r in ranks for one in r["loads"]) and not any(r["warnings"] for r in ranks), ranks


@pytest.mark.engine
@pytest.mark.slow
def test_a_fresh_node_and_a_damaged_copy_read_the_persistent_tier(cluster):
    """Node 1's local tier is empty (a replaced machine); a byte of node 0's copy rotted: both load from the
    persistent tier, node 0 saying which copy failed its checksums."""
    saved = save_on(cluster, {"name": "s1", "step": 1, "wait_durable": True})
    assert all(r["saves"][0]["durable"] for r in saved), saved
    assert all(len(r["drained"]) == 1 for r in saved), saved
    wipe(cluster, 1)
    copy = node_copy(cluster, 0, "s1")
    damaged = data_files(copy)[0]
    flip_bit(os.path.join(copy, damaged), 4096)
    loaded = load_on(cluster, "s1", 1)
    assert all(r["equal"] for r in loaded), loaded
    left = [w for said, w in zip(loaded[0]["warned"], loaded[0]["warnings"]) if tuple(said) == (NEXT_COPY, damaged)]
    # left for the persistent copy, the warning naming the cause and the copy
    assert left and all("checksum mismatch in" in w and ckpt_of(cluster, "s1") in w for w in left), loaded[0]


@pytest.mark.engine
@pytest.mark.slow
def test_replicas_let_a_replaced_node_resume_from_the_local_tiers(memory_cluster):
    """replicas=1, local checkpoints only, local tiers in memory, five saves with keep_local=1, each one's copies
    made before the next: each node also keeps the other's file (inspect shows it, from the persistent directory
    and from a node's copy); each node says once whether its tier allocates its
    pages one base page at a time (a tmpfs without huge pages); the nodes renumbered load from their own
    tiers; node 1 lost, the job on node 0 alone loads from its tier; node 1 replaced by a fresh machine loads its
    share of the last checkpoint from node 0's replica (the persistent tier has no data file to read; the reads
    unshared, as on any memory tier, but for these), also where the load's group is not the whole job (a
    parallel_group of each node's ranks, as a job of more than 64 ranks has none by default); with
    share_reads="off" (loads independent of each other) node 1 is refused, saying so."""
    cluster = memory_cluster
    saves = [{"name": f"s{i}", "step": i, "replicas": 1, "persistent": False, "keep_local": 1, "wait_copies": True}
             for i in range(5)]
    saved = save_on(cluster, *saves)
    # rank 0 records the state once the replication's last collective is done: another rank's own copies may end
    # (its wait_copies return) just before that, so the states are asked once every node is done
    assert [checkpoint_state(ckpt_of(cluster, s["name"])) for s in saves] == ["replicated"] * len(saves)
    for r in saved:
        assert all(s["copied"] for s in r["saves"]) and not r["warnings"], r
        assert len(r["received"]) == 5, r
        # each node's rank says once, of all five saves, where its tier allocates its pages one base page at a time
        assert len(r["advice"]) == (small_pages_in_memory(cluster["nodes"][int(r["node"])]) is not None), r
    for node in (0, 1):
        assert len(data_files(node_copy(cluster, node, "s4"))) == 2, os.listdir(node_copy(cluster, node, "s4"))
    ckpt = ckpt_of(cluster, "s4")
    assert not data_files(ckpt) and INDEX_FILE in os.listdir(os.path.join(ckpt, PENDING_DIR))
    for where in (ckpt, node_copy(cluster, 0, "s4")):
        report = inspect_checkpoint(where)
        assert report.tiers is not None and report.tiers.state == "replicated", report
        assert (report.tiers.nodes, report.tiers.replica_nodes) == ([[0], [1]], [[1], [0]]), report.tiers
        assert not report.tiers.persistent and report.tiers.drained == 0 and report.tiers.data_files == 2
    report = inspect_checkpoint(ckpt)
    assert report.ok and report.index == "pending" and len(report.files) == 2, report.problems
    text = format_report(report)
    assert "tiers: replicated" in text and "node 1: ranks 1; replicas on nodes 0" in text, text
    # on the machines that saved it, their node numbers swapped (torchrun's rendezvous numbers nodes by address,
    # and a replaced machine can move the others), the load asks the persistent tier for its manifest and
    # megatron's files only
    loaded = load_on({**cluster, "nodes": cluster["nodes"][::-1]}, "s4", 4, audit=True)
    assert all(r.get("equal") and not r["warnings"] for r in loaded), loaded
    for r in loaded:
        ours = [io for io in r["persistent_io"] if io.startswith("list") or ".fastpersist" in io]
        assert ours == [], r["persistent_io"]
    # one rank looks for an index and a .metadata committed beside the manifest (none yet: not durable)
    markers = [[io for io in r["persistent_io"] if io in (f"open {INDEX_FILE}", f"open {DCP_METADATA_FILE}")]
               for r in loaded]
    assert sorted(markers) == [[], [f"open {INDEX_FILE}", f"open {DCP_METADATA_FILE}"]], loaded
    wipe(cluster, 1)
    # node 1 lost and not replaced: the job restarts on node 0 alone, both ranks there reading its copy and replica
    alone = load_on({**cluster, "nodes": cluster["nodes"][:1]}, "s4", 4, per_node=2, audit=True)
    assert all(r.get("equal") and not r["warnings"] for r in alone), alone
    assert not any(".fastpersist" in io for r in alone for io in r["persistent_io"]), alone
    ranks = load_on(cluster, "s4", 4, loads=[{"audit": True}, {"node_group": True}, {"share_reads": "off"}])
    loaded, node_groups, independent = ([r["loads"][i] for r in ranks] for i in range(3))
    assert all(r.get("equal") for r in loaded + node_groups) and not any(r["warnings"] for r in ranks), ranks
    # the replaced node's rank looks for its file's drain marker (not there: it reads node 0's replica)
    assert "open .fastpersist_drained." in " ".join(loaded[1]["persistent_io"]), loaded[1]["persistent_io"]
    assert independent[0].get("equal") and "share_reads='off'" in independent[1].get("error", ""), independent


@pytest.mark.engine
@pytest.mark.slow
def test_a_replaced_node_reads_a_peers_replica_whatever_befell_the_persistent_copy(cluster):
    """Three durable checkpoints with replicas=1; node 1 replaced by a fresh machine and, at the same time, the
    persistent tier's copy of its file missing (s1), cut short (s2) or with a byte flipped (s3): each load reads
    every file from the nearest intact copy, node 0's replica of node 1's file before the persistent tier, so every
    rank loads the values saved. Where the load's group is not the whole job (each node's ranks, as a job of more
    than 64 ranks has by default), a copy that does not open (missing, cut short) is left for a rank holding one."""
    faults = {"s1": "missing", "s2": "truncated", "s3": "damaged"}
    saved = save_on(cluster, *({"name": name, "step": step, "replicas": 1, "keep_local": 3, "wait_durable": True,
                              "wait_copies": True} for step, name in enumerate(faults, 1)))
    assert all(s["durable"] and s["copied"] for r in saved for s in r["saves"]), saved
    wipe(cluster, 1)
    for name, fault in faults.items():
        lost = os.path.join(ckpt_of(cluster, name), data_file(1))
        if fault == "missing":
            os.rename(lost, os.path.join(cluster["persistent"], f"{name}-elsewhere"))
        elif fault == "truncated":
            os.truncate(lost, os.path.getsize(lost) // 2)
        else:
            flip_bit(lost, 4096)
    each = [{"checkpoint": ckpt_of(cluster, name), "step": step} for step, name in enumerate(faults, 1)]
    each += [{**load, "node_group": True} for load in each[:2]]
    for loaded in loads_on(cluster, "s1", 1, *each):
        assert all(r.get("equal") for r in loaded), loaded


@pytest.mark.engine
def test_saves_that_outrun_their_replication_keep_the_copies_it_still_sends(cluster):
    """Local checkpoints saved back to back with replicas=1 and keep_local=1: each commit's retention would take
    the older copies, and their replicas are still queued behind. Every checkpoint becomes replicated, and each
    node holds both files of the newest."""
    saves = [{"name": f"s{i}", "step": i, "replicas": 1, "persistent": False, "keep_local": 1, "rows": 32768}
             for i in range(1, 7)]
    saves[-1]["wait_copies"] = True
    saved = save_on(cluster, *saves)
    assert all(r["saves"][-1]["copied"] and not r["warnings"] for r in saved), saved
    assert [checkpoint_state(ckpt_of(cluster, s["name"])) for s in saves] == ["replicated"] * len(saves)
    for node in (0, 1):
        assert len(data_files(node_copy(cluster, node, "s6"))) == 2, os.listdir(node_copy(cluster, node, "s6"))


@pytest.mark.engine
@pytest.mark.slow
def test_replicas_still_queued_when_the_script_destroys_its_process_groups_are_sent_at_exit(cluster):
    """The script saves and calls destroy_process_group() at once, its replicas (64 MiB a node) still queued: each
    process's exit sends them, over the replication's own group, and exits cleanly; the checkpoint is replicated."""
    saved = save_on(cluster, {"name": "s1", "step": 1, "replicas": 1, "persistent": False, "rows": 65536},
                  exit_with_copies=True)
    assert all(r["saves"][0]["state_after_save"] == "local" and not r["warnings"] for r in saved), saved
    assert checkpoint_state(ckpt_of(cluster, "s1")) == "replicated"
    wipe(cluster, 0)
    loaded = load_on(cluster, "s1", 1, rows=65536)
    assert all(r.get("equal") and not r["warnings"] for r in loaded), loaded


@pytest.mark.engine
@pytest.mark.slow
def test_a_damaged_replica_is_detected_and_the_next_copy_used(cluster):
    """Node 0 lost; the replica of its file on node 1 rotted. Every rank loads all of ``w`` reading for itself
    (a resharding, reads not shared), so node 1 reads node 0's file from its replica: the checksums catch it,
    the persistent copy serves, and the warning names the damaged replica."""
    saved = save_on(cluster, {"name": "s1", "step": 1, "replicas": 1, "wait_durable": True, "wait_copies": True})
    assert all(r["saves"][0]["durable"] for r in saved), saved
    wipe(cluster, 0)
    replica_dir, replica = node_copy(cluster, 1, "s1"), data_file(0)
    w = next(r for r in read_index(ckpt_of(cluster, "s1"), "test").records if r.file == replica and r.key == "w")
    flip_bit(os.path.join(replica_dir, replica), w.offset + w.data_offset + 100)  # in rank 0's rows of w
    loaded = load_on(cluster, "s1", 1, whole=True, share_reads="off")
    assert all(r.get("equal") for r in loaded), loaded
    left = [w for r in loaded for said, w in zip(r["warned"], r["warnings"]) if tuple(said) == (NEXT_COPY, replica)]
    assert left and all("checksum mismatch in" in w and os.path.join(local_view(cluster, replica_dir), replica) in w
                        for w in left), loaded
