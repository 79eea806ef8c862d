"""Tiered checkpoints across nodes: torchrun twice on this machine (``--nnodes 2``), each node with its own local
tier at one path (tests/nodes.py), the persistent tier a directory both see or an S3 bucket (tests/object_store.py).

The adapters' part (megatron's save() and load() around a tiered strategy) runs on every stack (``contract``);
the engine's behaviour (replicas, refusals, faults, object storage) on the main stack (``engine``).
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from pathlib import Path

import pytest

from fastpersist_dist import checkpoint_state, compat
from fastpersist_dist.engine.index_reader import read_index
from fastpersist_dist.engine.tiers.drain import AFTER_COMMIT, ONCE_WRITTEN
from fastpersist_dist.engine.tiers.replicate import CHUNK_WAIT_ENV
from fastpersist_dist.engine.tiers.state import read_manifest
from fastpersist_dist.format.kinds import DCP_METADATA_FILE, checkpoint_format
from fastpersist_dist.format.records import INDEX_FILE, is_data_file
from fastpersist_dist.format.tiers import DURABLE, LOCAL, PENDING_DIR, TIERS_FILE, local_copy_dir
from fastpersist_dist.storage.files import TMP_SUFFIX
from fastpersist_dist.storage.persistent import persistent_dir
from fastpersist_dist.storage.mounts import small_pages_in_memory
from fastpersist_dist.tools.inspect import format_report, inspect_checkpoint

from .helpers import flip_bit
from .nodes import Nodes, run_nodes

REPLICA_ROWS = 262144  # rows of w per rank: 256 MiB, so a replica is still on its way when a node is killed


def _cluster(tiers: Path, persistent: Path) -> dict:
    """Two nodes' local tiers in ``tiers`` (node n's at ``local``, in its own mount namespace) and a persistent
    directory."""
    local = tiers / "local-tier"  # the same path on every node
    local.mkdir()
    nodes = [tiers / f"node{n}" for n in range(2)]
    for d in nodes:
        d.mkdir()
    persistent.mkdir()
    return {"local": str(local), "nodes": [str(d) for d in nodes], "persistent": str(persistent)}


@pytest.fixture
def cluster(root, tmp_path: Path) -> dict:
    """Local tiers on the disk."""
    return _cluster(tmp_path, tmp_path / "persistent")


@pytest.fixture
def memory_cluster(root, shm_dir: str, tmp_path: Path) -> dict:
    """Local tiers in memory (tmpfs), where loads read unshared by default."""
    return _cluster(Path(shm_dir), tmp_path / "persistent")


def _ckpt(cluster: dict, name: str) -> str:
    return name if "://" in name else os.path.join(cluster["persistent"], name)


def _save(cluster: dict, *saves: dict, per_node: int = 1, **options) -> list[dict]:
    """Each save (``name``, ``step`` and the driver's options) in turn, in one run of the nodes (``per_node``
    ranks each)."""
    args = [{"checkpoint": _ckpt(cluster, s["name"]), "local_dir": cluster["local"], **s} for s in saves]
    return run_nodes("save", {"saves": args, **options}, cluster["nodes"], cluster["local"], per_node)


def _load(cluster: dict, name: str, step: int, per_node: int = 1, **options) -> list[dict]:
    return run_nodes("load", {"checkpoint": _ckpt(cluster, name), "step": step, **options}, cluster["nodes"],
                     cluster["local"], per_node)


def _loads(cluster: dict, name: str, step: int, *each: dict, per_node: int = 1, **options) -> list[list[dict]]:
    """Several loads in turn in one run of the nodes (``each``: their own options); each load's results."""
    ranks = _load(cluster, name, step, per_node, loads=list(each), **options)
    return [[r["loads"][i] for r in ranks] for i in range(len(each))]


def _node_copy(cluster: dict, node: int, name: str) -> str:
    """Node ``node``'s copy of checkpoint ``name``, as seen from outside the nodes' namespaces."""
    copy = local_copy_dir(cluster["local"], _ckpt(cluster, name))
    return os.path.join(cluster["nodes"][node], os.path.relpath(copy, cluster["local"]))


def _wipe(cluster: dict, node: int) -> None:
    """Node ``node`` replaced by a fresh machine: its local tier empty."""
    shutil.rmtree(cluster["nodes"][node])
    os.makedirs(cluster["nodes"][node])


def _data_file(rank: int) -> str:
    """The name of ``rank``'s data file in this stack's default format."""
    return checkpoint_format(compat.DEFAULT_FORMAT).data_file(rank)


def _data_files(directory: str) -> list[str]:
    return sorted(n for n in os.listdir(directory) if is_data_file(n))


@pytest.mark.contract
@pytest.mark.slow
def test_each_node_keeps_its_share_and_loads_it_from_its_own_copy(cluster):
    """Two async saves: each local once its call returns (durable already where the drain was as quick), then
    durable, each rank's data file copied to the persistent directory once its writer wrote it, before the local
    commit. The second's node copies are removed, so it loads from the persistent tier alone; the first's
    persistent data files are removed, so it loads only from each node's own copy."""
    saved = _save(cluster, {"name": "s1", "step": 1, "async": True, "wait_durable": True},
                  {"name": "s2", "step": 2, "async": True, "wait_durable": True})
    first = [r["saves"][0] for r in saved]
    assert all(save["state_after_save"] in (LOCAL, DURABLE) for save in first), first
    assert all(save["durable"] for r in saved for save in r["saves"]), saved
    for r in saved:
        assert r["drained"] == [ONCE_WRITTEN, ONCE_WRITTEN] and not r["warnings"], r
    for node in (0, 1):  # s2 can only load from the persistent tier
        shutil.rmtree(_node_copy(cluster, node, "s2"))
    for node in (0, 1):  # the node's own rank's data file and the whole index
        copy = _node_copy(cluster, node, "s1")
        assert {TIERS_FILE, INDEX_FILE} <= set(os.listdir(copy)) and len(_data_files(copy)) == 1, os.listdir(copy)
    ckpt = _ckpt(cluster, "s1")
    assert checkpoint_state(ckpt) == "durable" and len(_data_files(ckpt)) == 2
    manifest = read_manifest(persistent_dir(ckpt))
    assert manifest.created <= manifest.reached[DURABLE], manifest  # committed locally first
    assert not os.listdir(os.path.join(ckpt, PENDING_DIR))  # the pending index went with the commit there
    for name in _data_files(ckpt):  # s1 only from the nodes' own copies
        os.unlink(os.path.join(ckpt, name))
    ranks = _load(cluster, "s2", 2, loads=[{}, {"checkpoint": ckpt, "step": 1}])
    assert all(one.get("equal") for r in ranks for one in r["loads"]) and not any(r["warnings"] for r in ranks), ranks


@pytest.mark.engine
@pytest.mark.slow
def test_a_fresh_node_and_a_damaged_copy_read_the_persistent_tier(cluster):
    """Node 1's local tier is empty (a replaced machine); a byte of node 0's copy rotted: both load from the
    persistent tier, node 0 saying which copy failed its checksums."""
    saved = _save(cluster, {"name": "s1", "step": 1, "wait_durable": True})
    assert all(r["saves"][0]["durable"] for r in saved), saved
    # a synchronous save's caller waits for its write: the drain copies after the commit, not beside the write
    assert all(r["drained"] == [AFTER_COMMIT] for r in saved), saved
    _wipe(cluster, 1)
    copy = _node_copy(cluster, 0, "s1")
    flip_bit(os.path.join(copy, _data_files(copy)[0]), 4096)
    loaded = _load(cluster, "s1", 1)
    assert all(r["equal"] for r in loaded), loaded
    assert any("checksum mismatch in" in w and "from its next copy" in w and _ckpt(cluster, "s1") in w
               for w in loaded[0]["warnings"]), loaded[0]["warnings"]


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
    saved = _save(cluster, *saves)
    # rank 0 records the state once the replication's last collective is done: another rank's own copies may end
    # (its wait_copies return) just before that, so the states are asked once every node is done
    assert [checkpoint_state(_ckpt(cluster, s["name"])) for s in saves] == ["replicated"] * len(saves)
    for r in saved:
        assert all(s["copied"] for s in r["saves"]) and not r["warnings"], r
        assert len(r["received"]) == 5, r
        # each node's rank says once, of all five saves, where its tier allocates its pages one base page at a time
        assert len(r["advice"]) == (small_pages_in_memory(cluster["nodes"][int(r["node"])]) is not None), r
    for node in (0, 1):
        assert len(_data_files(_node_copy(cluster, node, "s4"))) == 2, os.listdir(_node_copy(cluster, node, "s4"))
    ckpt = _ckpt(cluster, "s4")
    assert not _data_files(ckpt) and INDEX_FILE in os.listdir(os.path.join(ckpt, PENDING_DIR))
    for where in (ckpt, _node_copy(cluster, 0, "s4")):
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
    loaded = _load({**cluster, "nodes": cluster["nodes"][::-1]}, "s4", 4, audit=True)
    assert all(r.get("equal") and not r["warnings"] for r in loaded), loaded
    for r in loaded:
        ours = [io for io in r["persistent_io"] if io.startswith("list") or ".fastpersist" in io]
        assert ours == [], r["persistent_io"]
    # one rank looks for an index and a .metadata committed beside the manifest (none yet: not durable)
    markers = [[io for io in r["persistent_io"] if io in (f"open {INDEX_FILE}", f"open {DCP_METADATA_FILE}")]
               for r in loaded]
    assert sorted(markers) == [[], [f"open {INDEX_FILE}", f"open {DCP_METADATA_FILE}"]], loaded
    _wipe(cluster, 1)
    # node 1 lost and not replaced: the job restarts on node 0 alone, both ranks there reading its copy and replica
    alone = _load({**cluster, "nodes": cluster["nodes"][:1]}, "s4", 4, per_node=2, audit=True)
    assert all(r.get("equal") and not r["warnings"] for r in alone), alone
    assert not any(".fastpersist" in io for r in alone for io in r["persistent_io"]), alone
    ranks = _load(cluster, "s4", 4, loads=[{"audit": True}, {"node_group": True}, {"share_reads": "off"}])
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
    saved = _save(cluster, *({"name": name, "step": step, "replicas": 1, "keep_local": 3, "wait_durable": True,
                              "wait_copies": True} for step, name in enumerate(faults, 1)))
    assert all(s["durable"] and s["copied"] for r in saved for s in r["saves"]), saved
    _wipe(cluster, 1)
    for name, fault in faults.items():
        lost = os.path.join(_ckpt(cluster, name), _data_file(1))
        if fault == "missing":
            os.rename(lost, os.path.join(cluster["persistent"], f"{name}-elsewhere"))
        elif fault == "truncated":
            os.truncate(lost, os.path.getsize(lost) // 2)
        else:
            flip_bit(lost, 4096)
    each = [{"checkpoint": _ckpt(cluster, name), "step": step} for step, name in enumerate(faults, 1)]
    each += [{**load, "node_group": True} for load in each[:2]]
    for loaded in _loads(cluster, "s1", 1, *each):
        assert all(r.get("equal") for r in loaded), loaded


@pytest.mark.engine
def test_saves_that_outrun_their_replication_keep_the_copies_it_still_sends(cluster):
    """Local checkpoints saved back to back with replicas=1 and keep_local=1: each commit's retention would take
    the older copies, and their replicas are still queued behind. Every checkpoint becomes replicated, and each
    node holds both files of the newest."""
    saves = [{"name": f"s{i}", "step": i, "replicas": 1, "persistent": False, "keep_local": 1, "rows": 32768}
             for i in range(1, 7)]
    saves[-1]["wait_copies"] = True
    saved = _save(cluster, *saves)
    assert all(r["saves"][-1]["copied"] and not r["warnings"] for r in saved), saved
    assert [checkpoint_state(_ckpt(cluster, s["name"])) for s in saves] == ["replicated"] * len(saves)
    for node in (0, 1):
        assert len(_data_files(_node_copy(cluster, node, "s6"))) == 2, os.listdir(_node_copy(cluster, node, "s6"))


@pytest.mark.engine
@pytest.mark.slow
def test_replicas_still_queued_when_the_script_destroys_its_process_groups_are_sent_at_exit(cluster):
    """The script saves and calls destroy_process_group() at once, its replicas (64 MiB a node) still queued: each
    process's exit sends them, over the replication's own group, and exits cleanly; the checkpoint is replicated."""
    saved = _save(cluster, {"name": "s1", "step": 1, "replicas": 1, "persistent": False, "rows": 65536},
                  exit_with_copies=True)
    assert all(r["saves"][0]["state_after_save"] == "local" and not r["warnings"] for r in saved), saved
    assert checkpoint_state(_ckpt(cluster, "s1")) == "replicated"
    _wipe(cluster, 0)
    loaded = _load(cluster, "s1", 1, rows=65536)
    assert all(r.get("equal") and not r["warnings"] for r in loaded), loaded


@pytest.mark.engine
@pytest.mark.slow
def test_a_damaged_replica_is_detected_and_the_next_copy_used(cluster):
    """Node 0 lost; the replica of its file on node 1 rotted. Every rank loads all of ``w`` reading for itself
    (a resharding, reads not shared), so node 1 reads node 0's file from its replica: the checksums catch it,
    the persistent copy serves, and the warning names the damaged replica."""
    saved = _save(cluster, {"name": "s1", "step": 1, "replicas": 1, "wait_durable": True, "wait_copies": True})
    assert all(r["saves"][0]["durable"] for r in saved), saved
    _wipe(cluster, 0)
    replica_dir, replica = _node_copy(cluster, 1, "s1"), _data_file(0)
    w = next(r for r in read_index(_ckpt(cluster, "s1"), "test").records if r.file == replica and r.key == "w")
    flip_bit(os.path.join(replica_dir, replica), w.offset + w.data_offset + 100)  # in rank 0's rows of w
    loaded = _load(cluster, "s1", 1, whole=True, share_reads="off")
    assert all(r.get("equal") for r in loaded), loaded
    assert any("checksum mismatch in" in w and os.path.join(_local_view(cluster, replica_dir), replica) in w
               and "from its next copy" in w for r in loaded for w in r["warnings"]), loaded


def _local_view(cluster: dict, outside: str) -> str:
    """A path of a node's directory as the node sees it (at the local-tier path)."""
    node_dir = next(d for d in cluster["nodes"] if outside.startswith(d))
    return os.path.join(cluster["local"], os.path.relpath(outside, node_dir))


@pytest.mark.engine
@pytest.mark.slow
def test_a_local_only_checkpoint_that_lost_a_node_is_refused_naming_the_newest_durable_one(cluster):
    """s3 was durable, then saved again local-only: its old commit markers left the persistent directory when
    that save started, so it is no longer the newest durable checkpoint; s1 is."""
    saved = _save(cluster, {"name": "s1", "step": 1, "wait_durable": True},
                  {"name": "s2", "step": 2, "persistent": False},
                  {"name": "s3", "step": 3, "wait_durable": True}, {"name": "s3", "step": 4, "persistent": False})
    assert all(r["saves"][1]["state"] == "local" and r["saves"][2]["durable"] and r["saves"][3]["state"] == "local"
               for r in saved), saved
    left = set(os.listdir(_ckpt(cluster, "s3")))
    assert TIERS_FILE in left and not left & {INDEX_FILE, DCP_METADATA_FILE}, left
    _wipe(cluster, 1)  # s2's data of node 1 was never copied anywhere
    loaded = _load(cluster, "s2", 2)
    error = loaded[1]["error"]
    assert "is kept only in the local tiers of nodes 1" in error and "no rank of this load holds" in error, error
    assert f"the newest durable checkpoint beside it is {_ckpt(cluster, 's1')}" in error, error
    # rank 0 had its copy: it raises naming rank 1, instead of waiting for it
    assert "a rank sharing its reads failed: group rank 1" in loaded[0]["error"], loaded[0]


@pytest.mark.engine
@pytest.mark.slow
def test_a_node_killed_during_replication_loses_nothing(cluster):
    """Node 1 killed while a replica is on its way: the checkpoint never shows replicated, no partial replica
    is taken for a copy, and after the restart it loads from the local tiers, as does the durable one before."""
    args = {"saves": [
        {"checkpoint": _ckpt(cluster, "s1"), "local_dir": cluster["local"], "step": 1, "wait_durable": True},
        {"checkpoint": _ckpt(cluster, "s2"), "local_dir": cluster["local"], "step": 2, "rows": REPLICA_ROWS,
         "replicas": 1, "persistent": False, "wait_copies": True}], "meet_timeout": 5}  # node 1 never comes
    # where gloo does not notice the killed peer, the transfer to it ends once a chunk has not moved for this long
    nodes = Nodes("save", args, cluster["nodes"], cluster["local"], env={CHUNK_WAIT_ENV: "10"})
    replica_of_0 = os.path.join(_node_copy(cluster, 1, "s2"), _data_file(0))
    deadline = time.monotonic() + 240
    while not any(n.startswith(f"{_data_file(0)}.") and n.endswith(TMP_SUFFIX) for n in _listdir(replica_of_0)):
        assert time.monotonic() < deadline and all(p.poll() is None for p in nodes.procs), "no replica on its way"
        time.sleep(0.002)
    nodes.kill(1)
    nodes.finish(check=False)
    assert checkpoint_state(_ckpt(cluster, "s2")) == "local"
    assert not os.path.exists(replica_of_0)
    older, loaded = _loads(cluster, "s1", 1, {}, {"checkpoint": _ckpt(cluster, "s2"), "step": 2, "rows": REPLICA_ROWS})
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
    saved = _save(cluster, {"name": "s1", "step": 1, "wait_durable": True},
                  {"name": "s2", "step": 2, "rows": 16384})
    for r in saved:
        error = r["saves"][1].get("error", "")
        assert "No space left on device" in error and "node 1" in error and cluster["local"] in error, r
    assert _load(cluster, "s1", 1)[0]["equal"]


@pytest.mark.engine
@pytest.mark.slow
def test_drained_to_object_storage_and_restarted_from_it(cluster, s3):
    """The persistent tier an S3 bucket (msc://), two ranks a node: durable there; both local tiers lost, a load
    fetches the index (once a node) and every file a rank reads from S3 (checked) into the local tiers, and the
    next load reads those."""
    url = f"msc://s3/{uuid.uuid4().hex}/s1"
    saved = _save(cluster, {"name": url, "step": 1, "replicas": 1, "wait_durable": True}, msc=True, per_node=2)
    assert all(r["saves"][0]["durable"] for r in saved), saved
    report = inspect_checkpoint(url)
    assert report.ok and report.index == "committed" and report.tiers is not None, report
    assert (report.tiers.state, report.tiers.drained, report.tiers.data_files) == ("durable", 4, 4), report.tiers
    assert report.tiers.after_local_s["durable"] > 0, report.tiers  # the upload took time after the local commit
    assert f"; durable {report.tiers.after_local_s['durable']:.2f} s later" in format_report(report)
    _wipe(cluster, 0)
    _wipe(cluster, 1)
    loaded, again = _loads(cluster, url, 1, {}, {}, msc=True, per_node=2)
    assert all(r.get("equal") for r in loaded + again), (loaded, again)
    for node in (0, 1):  # at least the files of the node's ranks
        copy = _node_copy(cluster, node, url)
        assert {_data_file(2 * node), _data_file(2 * node + 1)} <= set(_data_files(copy)), os.listdir(copy)
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
    assert any("trying again" in w for r in saved for w in r["warnings"]), saved
    _wipe(cluster, 0)
    _wipe(cluster, 1)
    loaded = _load(cluster, url, 1, rows=65536, msc=True)
    assert all(r.get("equal") for r in loaded), loaded


def _state_or_none(url: str):
    try:
        return checkpoint_state(url)
    except Exception:  # noqa: BLE001 - not there yet
        return None
