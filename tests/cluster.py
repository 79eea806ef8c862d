"""Two nodes on this machine for the tiered-checkpoint tests: their local tiers, the persistent tier, and runs of
``tests/tiers_driver.py`` on them (``tests/nodes.py``); the fixtures ``cluster`` and ``memory_cluster`` are in
``tests/conftest.py``."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from fastpersist_dist import compat
from fastpersist_dist.format.kinds import checkpoint_format
from fastpersist_dist.format.records import is_data_file
from fastpersist_dist.format.tiers import local_copy_dir

from .nodes import run_nodes

REPLICA_ROWS = 262144  # rows of w per rank: 256 MiB, so a replica is still on its way when a node is killed


def make_cluster(tiers: Path, persistent: Path) -> dict:
    """Two nodes' local tiers in ``tiers`` (node n's at ``local``, in its own mount namespace) and a persistent
    directory."""
    local = tiers / "local-tier"  # the same path on every node
    local.mkdir()
    nodes = [tiers / f"node{n}" for n in range(2)]
    for d in nodes:
        d.mkdir()
    persistent.mkdir()
    return {"local": str(local), "nodes": [str(d) for d in nodes], "persistent": str(persistent)}


def ckpt_of(cluster: dict, name: str) -> str:
    return name if "://" in name else os.path.join(cluster["persistent"], name)


def save_on(cluster: dict, *saves: dict, per_node: int = 1, **options) -> list[dict]:
    """Each save (``name``, ``step`` and the driver's options) in turn, in one run of the nodes (``per_node``
    ranks each)."""
    args = [{"checkpoint": ckpt_of(cluster, s["name"]), "local_dir": cluster["local"], **s} for s in saves]
    return run_nodes("save", {"saves": args, **options}, cluster["nodes"], cluster["local"], per_node)


def load_on(cluster: dict, name: str, step: int, per_node: int = 1, **options) -> list[dict]:
    return run_nodes("load", {"checkpoint": ckpt_of(cluster, name), "step": step, **options}, cluster["nodes"],
                     cluster["local"], per_node)


def loads_on(cluster: dict, name: str, step: int, *each: dict, per_node: int = 1, **options) -> list[list[dict]]:
    """Several loads in turn in one run of the nodes (``each``: their own options); each load's results."""
    ranks = load_on(cluster, name, step, per_node, loads=list(each), **options)
    return [[r["loads"][i] for r in ranks] for i in range(len(each))]


def node_copy(cluster: dict, node: int, name: str) -> str:
    """Node ``node``'s copy of checkpoint ``name``, as seen from outside the nodes' namespaces."""
    copy = local_copy_dir(cluster["local"], ckpt_of(cluster, name))
    return os.path.join(cluster["nodes"][node], os.path.relpath(copy, cluster["local"]))


def wipe(cluster: dict, node: int) -> None:
    """Node ``node`` replaced by a fresh machine: its local tier empty."""
    shutil.rmtree(cluster["nodes"][node])
    os.makedirs(cluster["nodes"][node])


def data_file(rank: int) -> str:
    """The name of ``rank``'s data file in this stack's default format."""
    return checkpoint_format(compat.DEFAULT_FORMAT).data_file(rank)


def data_files(directory: str) -> list[str]:
    return sorted(n for n in os.listdir(directory) if is_data_file(n))


def local_view(cluster: dict, outside: str) -> str:
    """A path of a node's directory as the node sees it (at the local-tier path)."""
    node_dir = next(d for d in cluster["nodes"] if outside.startswith(d))
    return os.path.join(cluster["local"], os.path.relpath(outside, node_dir))
