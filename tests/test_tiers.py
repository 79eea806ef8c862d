"""Tiered checkpoints across nodes: torchrun twice on this machine (``--nnodes 2``), each node with its own local
tier at one path (tests/nodes.py), the persistent tier a directory both see."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from fastpersist_dist import checkpoint_state
from fastpersist_dist.format.records import INDEX_FILE, is_data_file
from fastpersist_dist.format.tiers import TIERS_FILE, local_copy_dir

from .helpers import flip_bit
from .nodes import run_nodes

pytestmark = pytest.mark.contract  # megatron-core's save() and load() around a tiered strategy


@pytest.fixture
def cluster(root, tmp_path: Path) -> dict:
    """Two nodes' local tiers (node n's at ``local``, in its own mount namespace) and a persistent directory."""
    local = tmp_path / "local-tier"  # the same path on every node
    local.mkdir()
    nodes = [tmp_path / f"node{n}" for n in range(2)]
    for d in nodes:
        d.mkdir()
    persistent = tmp_path / "persistent"
    persistent.mkdir()
    return {"local": str(local), "nodes": [str(d) for d in nodes], "persistent": str(persistent)}


def _ckpt(cluster: dict, name: str) -> str:
    return os.path.join(cluster["persistent"], name)


def _save(cluster: dict, *saves: dict) -> list[dict]:
    """Each save (``name``, ``step`` and the driver's options) in turn, in one run of the nodes."""
    args = [{"checkpoint": _ckpt(cluster, s["name"]), "local_dir": cluster["local"], **s} for s in saves]
    return run_nodes("save", {"saves": args}, cluster["nodes"], cluster["local"])


def _load(cluster: dict, name: str, step: int) -> list[dict]:
    return run_nodes("load", {"checkpoint": _ckpt(cluster, name), "step": step}, cluster["nodes"], cluster["local"])


def _node_copy(cluster: dict, node: int, name: str) -> str:
    """Node ``node``'s copy of checkpoint ``name``, as seen from outside the nodes' namespaces."""
    copy = local_copy_dir(cluster["local"], _ckpt(cluster, name))
    return os.path.join(cluster["nodes"][node], os.path.relpath(copy, cluster["local"]))


def _data_files(directory: str) -> list[str]:
    return sorted(n for n in os.listdir(directory) if is_data_file(n))


def test_each_node_keeps_its_share_and_loads_it_from_its_own_copy(cluster):
    """An async save: local at once, then durable; the persistent tier's data files are then removed, so the
    load can only have read each node's own copy."""
    (first, second) = (r["saves"][0] for r in _save(cluster, {"name": "s1", "step": 1, "async": True,
                                                              "wait_durable": True}))
    assert [first["state_after_save"], second["state_after_save"]] == ["local", "local"]
    assert first["durable"] and second["durable"]
    for node in (0, 1):  # the node's own rank's data file and the whole index
        copy = _node_copy(cluster, node, "s1")
        assert {TIERS_FILE, INDEX_FILE} <= set(os.listdir(copy)) and len(_data_files(copy)) == 1, os.listdir(copy)
    ckpt = _ckpt(cluster, "s1")
    assert checkpoint_state(ckpt) == "durable" and len(_data_files(ckpt)) == 2
    for name in _data_files(ckpt):
        os.unlink(os.path.join(ckpt, name))
    loaded = _load(cluster, "s1", 1)
    assert all(r.get("equal") and not r["warnings"] for r in loaded), loaded


def test_a_fresh_node_and_a_damaged_copy_read_the_persistent_tier(cluster):
    """Node 1's local tier is empty (a replaced machine); a byte of node 0's copy rotted: both load from the
    persistent tier, node 0 saying which copy failed its checksums."""
    saved = _save(cluster, {"name": "s1", "step": 1, "wait_durable": True})
    assert all(r["saves"][0]["durable"] for r in saved), saved
    shutil.rmtree(_node_copy(cluster, 1, "s1"))
    copy = _node_copy(cluster, 0, "s1")
    flip_bit(os.path.join(copy, _data_files(copy)[0]), 4096)
    loaded = _load(cluster, "s1", 1)
    assert all(r["equal"] for r in loaded), loaded
    assert any("checksum mismatch in" in w and "from its next copy" in w and _ckpt(cluster, "s1") in w
               for w in loaded[0]["warnings"]), loaded[0]["warnings"]


def test_a_local_only_checkpoint_that_lost_a_node_is_refused_naming_the_newest_durable_one(cluster):
    saved = _save(cluster, {"name": "s1", "step": 1, "wait_durable": True},
                  {"name": "s2", "step": 2, "persistent": False})
    assert all(r["saves"][1]["state"] == "local" for r in saved), saved
    shutil.rmtree(_node_copy(cluster, 1, "s2"))  # lost with node 1: it was never copied anywhere
    loaded = _load(cluster, "s2", 2)
    assert "this node's copy" in loaded[1]["error"] and "is missing" in loaded[1]["error"], loaded[1]
    newest = _ckpt(cluster, "s1")
    assert f"the newest durable checkpoint beside it is {newest}" in loaded[1]["error"], loaded[1]
    # rank 0 had its copy: it raises naming rank 1, instead of waiting for it
    assert "a rank sharing its reads failed: group rank 1" in loaded[0]["error"], loaded[0]
