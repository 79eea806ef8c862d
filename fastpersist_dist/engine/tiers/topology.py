"""Nodes (torchrun's ``GROUP_RANK``, else the machine), their failure domains (``FASTPERSIST_FAILURE_DOMAIN``),
and the process groups and store the background work uses.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import uuid
from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist

from ...storage.shared_dir import LOCAL_FILESYSTEMS, DirView, view_of
from ...util.per_process import PerProcess

logger = logging.getLogger(__name__)

FAILURE_DOMAIN_ENV = "FASTPERSIST_FAILURE_DOMAIN"
# How long a replica transfer waits for its peer: a node that died makes it fail at once (its connections
# close); one that hangs this long is given up on, and the checkpoint is not replicated.
REPLICATION_TIMEOUT = datetime.timedelta(minutes=30)


def node_key() -> str:
    """This process's node: torchrun's node rank where torchrun started it, else the machine."""
    group = os.environ.get("GROUP_RANK")
    if group is not None:
        return f"node {group}"
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f"machine {f.read().strip()}"
    except OSError:
        return f"host {socket.gethostname()}"


def describe_node() -> str:
    """This node for messages: torchrun's node rank and the host name."""
    return f"{node_key()} ({socket.gethostname()})"


@dataclass(frozen=True)
class Topology:
    """Each node's ranks (nodes in the order of their first rank) and failure domain."""

    nodes: tuple[tuple[int, ...], ...]
    domains: tuple[str, ...]
    hosts: tuple[str, ...]

    def node_of(self, rank: int) -> int:
        return next(n for n, ranks in enumerate(self.nodes) if rank in ranks)

    def describe(self) -> str:
        """Each node, its host and its ranks, for errors that name ranks."""
        return "; ".join(f"node {n} ({host}): ranks {', '.join(map(str, ranks))}"
                         for n, (ranks, host) in enumerate(zip(self.nodes, self.hosts)))


def _gather_topology() -> Topology:
    keys: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(keys, (node_key(), os.environ.get(FAILURE_DOMAIN_ENV), socket.gethostname()))
    nodes: dict[str, list[int]] = {}
    domains: dict[str, str] = {}
    hosts: dict[str, str] = {}
    for rank, (key, domain, host) in enumerate(keys):
        nodes.setdefault(key, []).append(rank)
        domains.setdefault(key, domain or key)
        hosts.setdefault(key, host)
    return Topology(tuple(tuple(r) for r in nodes.values()), tuple(domains[k] for k in nodes),
                    tuple(hosts[k] for k in nodes))


_topologies: PerProcess[dict[int, Topology]] = PerProcess(dict)


def topology() -> Topology:
    """Collective on first use in a process (per world size): the nodes and their domains."""
    known = _topologies.get()
    world = dist.get_world_size()
    if world not in known:
        known[world] = _gather_topology()
    return known[world]


_node_local: PerProcess[set[tuple[int, str]]] = PerProcess(set)


@dataclass(frozen=True)
class LocalTierViews:
    """Each node's view of the local tier (its first rank's), for :func:`check_node_local`. Pure."""

    views: dict[int, DirView]  # node -> view; a node whose view could not be made is left out

    def one_directory(self) -> Optional[tuple[int, int]]:
        """Two nodes that surely see one directory (one machine, one inode), or None."""
        seen: dict[tuple[str, int, int], int] = {}
        for node, view in self.views.items():
            other = seen.setdefault((view.machine, view.device, view.inode), node)
            if other != node:
                return other, node
        return None

    def network_mounts(self) -> list[str]:
        """Where two nodes or more may see one directory: a network filesystem on each, mounted apart (only a
        file written on one and looked for on the other would tell, ``shared_dir.same_directory``); else []."""
        network = {(v.machine, v.device): v for v in self.views.values() if v.fstype not in LOCAL_FILESYSTEMS}
        return sorted({f"{v.fstype} at {v.mount_point}" for v in network.values()}) if len(network) > 1 else []


def check_node_local(local_dir: str, topo: Topology) -> None:
    """Collective on first use in a process (per world size and ``local_dir``): raises ``ValueError`` on every
    rank alike where two nodes see one directory ``local_dir``; rank 0 warns where they may."""
    key = (dist.get_world_size(), local_dir)
    if key in _node_local.get():
        return
    views: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(views, view_of(local_dir))
    # None where a view could not be made: the checks before the write say why
    tier = LocalTierViews({n: views[ranks[0]] for n, ranks in enumerate(topo.nodes) if views[ranks[0]] is not None})
    pair = tier.one_directory()
    if pair is not None:
        view = tier.views[pair[1]]
        raise ValueError(
            f"local_dir {local_dir} is one directory for node {pair[0]} (first rank {topo.nodes[pair[0]][0]}) and "
            f"node {pair[1]} (first rank {topo.nodes[pair[1]][0]}): {view.describe()} on host {view.host}; a local "
            "tier must be each node's own storage (its NVMe, its memory); for several nodes on one machine, give "
            "each node a directory of its own there (docs/tiers.md)")
    unsure = tier.network_mounts()
    if unsure and dist.get_rank() == 0:
        logger.warning("fastpersist: local_dir %s is on a network filesystem on several nodes (%s): if it is one "
                       "directory for all of them, their copies collide and the tiers bring neither node-local "
                       "speed nor a copy per node; a local tier is meant to be each node's own storage (its NVMe, "
                       "its memory)", local_dir, ", ".join(unsure))
    _node_local.get().add(key)


_groups: PerProcess[dict[int, dist.ProcessGroup]] = PerProcess(dict)


def replication_group() -> dist.ProcessGroup:
    """Collective on first use in a process (per world size): a gloo group of every rank for the replicas, beside
    the training's collectives, made outside torch's registry of groups so that a script's
    ``destroy_process_group()`` leaves it to the replicas still queued; :func:`release_replication_groups`."""
    known = _groups.get()
    world = dist.get_world_size()
    if world not in known:
        name: list[Any] = [uuid.uuid4().hex if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(name, src=0)  # a fresh prefix: the store may hold an earlier group's keys
        store = dist.PrefixStore(f"fastpersist-replication/{name[0]}/", dist.distributed_c10d._get_default_store())
        known[world] = dist.ProcessGroupGloo(store, dist.get_rank(), world, REPLICATION_TIMEOUT)
    return known[world]


def drain_store() -> dist.Store:
    """Where each rank's drain counts itself done (``drain.py``): the default group's store (torchrun's, or the
    one rank 0 serves), under a prefix of its own; held by the drain jobs, it outlives a script's
    ``destroy_process_group()``, as the replication group does."""
    return dist.PrefixStore("fastpersist-drain/", dist.distributed_c10d._get_default_store())


def release_replication_groups() -> None:
    """Let this process's replication groups go (once its replicas are done, at exit): a gloo group still held
    when the interpreter finalizes can abort the process."""
    _groups.get().clear()
