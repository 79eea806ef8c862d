"""Tiered checkpoints across nodes when the persistent tier is out of reach or a copy to it dies: the object store
stopped during a load and during a removal, its copy of a file lost or damaged while a node is replaced, and a
rank killed while its copy to the persistent tier is under way (torchrun twice on this machine,
``tests/cluster.py``; S3 from ``tests/object_store.py``).
"""

from __future__ import annotations

import os
import shutil
import time
import uuid

import pytest

from fastpersist_dist import checkpoint_state
from fastpersist_dist.format.tiers import DURABLE
from fastpersist_dist.storage.files import TMP_SUFFIX
from fastpersist_dist.storage.persistent import persistent_dir
from fastpersist_dist.util.events import RETRYING, UNREACHABLE

from .cluster import REPLICA_ROWS, ckpt_of, data_file, data_files, load_on, loads_on, node_copy, save_on, wipe
from .nodes import Nodes

pytestmark = [pytest.mark.engine, pytest.mark.slow]


def _durable_on_s3(cluster: dict, *names: str, **options) -> list[str]:
    """Checkpoints ``names`` (steps 1, 2, ...) saved one after another to S3 in one run, each with a replica on the
    other node, durable and its copies done; their URLs."""
    top = f"msc://s3/{uuid.uuid4().hex}"
    urls = [f"{top}/{name}" for name in names]
    saved = save_on(cluster, *({"name": url, "step": step, "replicas": 1, "keep_local": len(urls),
                                "wait_durable": True, "wait_copies": True, **options}
                               for step, url in enumerate(urls, 1)), msc=True)
    assert all(s["durable"] and s["copied"] for r in saved for s in r["saves"]), saved
    return urls


def _until(done, nodes: Nodes, what: str, timeout: float = 240) -> None:
    end = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < end and all(p.poll() is None for p in nodes.procs), f"no {what}"
        time.sleep(0.002)


def test_a_load_while_the_object_store_is_down_reads_the_local_tiers_of_one_checkpoint(cluster, s3, tmp_path):
    """A durable checkpoint on S3, each node holding its copy and the other's replica; S3 stopped: our strategy's
    load(), told where the local tier is, reads the local tiers, warning that the store is out of reach, and gets
    the values saved (megatron-core's own load() looks into the store first: docs/tiers.md). Then the checkpoint
    saved again into that URL, node 1's copy of the first save put back in place of its copy of the second (a
    node that missed the second save), S3 stopped again: the load refuses on every rank, naming the checkpoint,
    rather than mix the two saves."""
    url, = _durable_on_s3(cluster, "s1")
    copy = node_copy(cluster, 1, url)
    shutil.copytree(copy, tmp_path / "first")
    s3.stop()
    loaded = load_on(cluster, url, 1, msc=True, loader_local_dir=cluster["local"], direct=True)
    s3.start()
    for r in loaded:
        assert r.get("equal") and not r["fetched"], (r.get("error"), r.get("trace"))
        assert UNREACHABLE in [e for e, _ in r["warned"]], r["warned"]
    assert checkpoint_state(url) == DURABLE
    saved = save_on(cluster, {"name": url, "step": 2, "replicas": 1, "wait_durable": True}, msc=True)
    assert all(r["saves"][0]["durable"] for r in saved), saved
    shutil.rmtree(copy)
    shutil.copytree(tmp_path / "first", copy)
    s3.stop()
    loaded = load_on(cluster, url, 2, msc=True, loader_local_dir=cluster["local"], direct=True)
    s3.start()
    for r in loaded:
        assert "equal" not in r and r["error"].startswith("FastPersistError") and url in r["error"], r


def test_the_object_store_down_while_an_older_checkpoint_is_removed(cluster, s3, tmp_path):
    """s1 and s2 durable on S3; S3 stopped, then rank 0 asks for s1's removal (retention) and S3 is back 5 s
    later: s2 stays durable and loads from S3 alone with the values saved, and the removal is tried again and
    finished once S3 answers: nothing of s1 is left."""
    top = f"msc://s3/{uuid.uuid4().hex}"
    s1, s2 = f"{top}/s1", f"{top}/s2"
    gate = str(tmp_path / "remove")
    saves = [{"checkpoint": url, "local_dir": cluster["local"], "step": step, "wait_durable": True}
             for step, url in ((1, s1), (2, s2))]
    nodes = Nodes("save", {"msc": True, "saves": saves, "remove": {"checkpoint": s1, "gate": gate, "timeout": 240},
                           "meet_timeout": 270}, cluster["nodes"], cluster["local"])
    _until(lambda: os.path.exists(f"{gate}.waiting"), nodes, "save done")
    assert [checkpoint_state(u) for u in (s1, s2)] == [DURABLE, DURABLE]
    s3.stop()
    open(gate, "w").close()
    time.sleep(5)
    s3.start()
    saved = nodes.finish()
    assert all(s["durable"] for r in saved for s in r["saves"]) and saved[0]["removal"]["copied"], saved
    assert checkpoint_state(s2) == DURABLE
    wipe(cluster, 0)
    wipe(cluster, 1)
    assert all(r.get("equal") for r in load_on(cluster, s2, 2, msc=True))
    assert checkpoint_state(s1) is None and not persistent_dir(s1).names(), saved[0]["warnings"]
    assert any(event == RETRYING for event, _ in saved[0]["warned"]), saved[0]["warnings"]


def test_a_replaced_node_reads_a_peers_replica_whatever_befell_its_object_on_s3(cluster, s3):
    """Three durable checkpoints on S3 with replicas=1; node 1 replaced by a fresh machine and, at the same time,
    the object of its data file deleted (s1), cut short (s2) or with a byte flipped (s3): each load reads node 0's
    replica of node 1's file, so every rank loads the values saved, also where the load's group is not the whole
    job (each node's ranks)."""
    faults = {"s1": "missing", "s2": "truncated", "s3": "damaged"}
    urls = dict(zip(faults, _durable_on_s3(cluster, *faults, keep_local=3)))
    wipe(cluster, 1)
    for name, fault in faults.items():
        home, lost = persistent_dir(urls[name]), data_file(1)
        if fault == "missing":
            home.remove(lost)
            assert home.read(lost) is None
        else:
            data = bytearray(home.read(lost) or b"")
            if fault == "truncated":
                del data[len(data) // 2:]
            else:
                data[4096] ^= 1
            home.write(lost, bytes(data))
    each = [{"checkpoint": urls[name], "step": step} for step, name in enumerate(faults, 1)]
    each += [{**load, "node_group": True} for load in each]
    for loaded in loads_on(cluster, urls["s1"], 1, *each, msc=True):
        assert all(r.get("equal") for r in loaded), [(r.get("error"), r.get("trace")) for r in loaded]


def test_a_rank_killed_while_it_copies_to_the_persistent_tier_loses_nothing(cluster):
    """s1 durable; s2 (256 MiB a rank) saved, and rank 1 SIGKILLed while its copy of s2 to the persistent directory
    is under way, then the job ends: s2 never shows durable and its partial copy is no data file there; the job
    restarted loads s2 from the local tiers and s1 with the values saved, and a new save, s3, becomes durable and
    loads from the persistent tier alone."""
    args = {"saves": [
        {"checkpoint": ckpt_of(cluster, "s1"), "local_dir": cluster["local"], "step": 1, "wait_durable": True},
        {"checkpoint": ckpt_of(cluster, "s2"), "local_dir": cluster["local"], "step": 2, "rows": REPLICA_ROWS,
         "wait_durable": True}]}
    nodes = Nodes("save", args, cluster["nodes"], cluster["local"])
    s2, copying = ckpt_of(cluster, "s2"), f"{data_file(1)}."
    _until(lambda: any(n.startswith(copying) and n.endswith(TMP_SUFFIX) for n in _names(s2)), nodes,
           "copy of rank 1's file to the persistent directory under way")
    nodes.kill_ranks(1)
    nodes.kill(0)  # the job ends, as its scheduler ends it once a rank died
    nodes.kill(1)
    nodes.finish(check=False)
    assert checkpoint_state(s2) != DURABLE and data_file(1) not in data_files(s2), os.listdir(s2)
    older, loaded = loads_on(cluster, "s1", 1, {}, {"checkpoint": s2, "step": 2, "rows": REPLICA_ROWS})
    assert all(r.get("equal") for r in older + loaded), (older, loaded)
    saved = save_on(cluster, {"name": "s3", "step": 3, "wait_durable": True})
    assert all(r["saves"][0]["durable"] for r in saved), saved
    assert checkpoint_state(s2) != DURABLE and checkpoint_state(ckpt_of(cluster, "s1")) == DURABLE
    wipe(cluster, 0)
    wipe(cluster, 1)
    older, newest = loads_on(cluster, "s1", 1, {}, {"checkpoint": ckpt_of(cluster, "s3"), "step": 3})
    assert all(r.get("equal") for r in older + newest), (older, newest)


def _names(directory: str) -> list[str]:
    try:
        return os.listdir(directory)
    except FileNotFoundError:
        return []
