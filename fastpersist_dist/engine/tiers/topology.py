"""Which ranks share a node (and its local tier), which failure domain each node is in, and the process group
replicas travel over.

"Node" is torchrun's (``GROUP_RANK``: ``torchrun --nnodes N --node-rank n``),
else the machine. A node's failure domain (what may fail together with it: a
rack, a power feed, a switch) comes from ``FASTPERSIST_FAILURE_DOMAIN`` on its
ranks; without it every node is a domain of its own.
"""

from __future__ import annotations

import datetime
import os
import socket
import uuid
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ...util.per_process import PerProcess

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


_groups: PerProcess[dict[int, dist.ProcessGroup]] = PerProcess(dict)


def replication_group() -> dist.ProcessGroup:
    """Collective on first use in a process (per world size): a gloo group of every rank for the replicas.

    Its own group, so that the background transfers never interleave with the
    training's collectives (which may run on NCCL meanwhile), on host memory.
    Made beside torch's registry of groups, not through ``new_group``: a
    training script that ends with ``destroy_process_group()`` while the last
    checkpoint's replicas are still queued (each process waits for them at
    exit) would otherwise take it away from under them. Its ranks are the
    world's; :func:`release_replication_groups` lets it go.
    """
    known = _groups.get()
    world = dist.get_world_size()
    if world not in known:
        name: list[Any] = [uuid.uuid4().hex if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(name, src=0)  # a fresh prefix: the store may hold an earlier group's keys
        store = dist.PrefixStore(f"fastpersist-replication/{name[0]}/", dist.distributed_c10d._get_default_store())
        known[world] = dist.ProcessGroupGloo(store, dist.get_rank(), world, REPLICATION_TIMEOUT)
    return known[world]


def release_replication_groups() -> None:
    """Let this process's replication groups go (once its replicas are done, at exit): a gloo group still held
    when the interpreter finalizes can abort the process."""
    _groups.get().clear()
