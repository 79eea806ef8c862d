"""Planning replicas of a tiered checkpoint, pure: which nodes keep copies of a node's data files, and who
sends which file to whom.

With ``replicas=K`` every node's data files are also kept in the local tiers
of K other nodes, chosen across failure domains (racks, power feeds: nodes of
another domain first, like nvidia-resiliency-ext's clique replication), so any
K lost nodes, or any lost domain when K >= 1 and there are several, leave a
copy of everything in the surviving local tiers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


def replica_nodes(domains: Sequence[str], replicas: int) -> tuple[tuple[int, ...], ...]:
    """For each node n (``domains[n]``: its failure domain), the ``replicas`` other nodes that copy its files.

    Nodes of other domains come before nodes of n's own, then the nearest after
    n in node order (wrapping), so the copies spread evenly: with one node per
    domain and K=1 each node sends to the next one and receives from the
    previous one. Raises ``ValueError`` where there are not enough other nodes.
    """
    count = len(domains)
    if not 0 <= replicas < max(count, 1):
        raise ValueError(f"replicas={replicas}: there are {count} nodes, so at most {count - 1} other nodes can keep "
                         "copies of a node's files")
    return tuple(tuple(sorted((m for m in range(count) if m != n),
                              key=lambda m: (domains[m] == domains[n], (m - n) % count))[:replicas])
                 for n in range(count))


@dataclass(frozen=True, order=True)
class ReplicaTransfer:
    """One data file sent from the rank that wrote it to one rank of a replica node (which writes it there)."""

    data_file: str
    src: int
    dst: int


def replica_transfers(nodes: Sequence[Sequence[int]], files: dict[str, int],
                      replicas: Sequence[Sequence[int]]) -> list[ReplicaTransfer]:
    """Every transfer of one replication, in the order both ends run them.

    ``nodes[n]``: node n's ranks; ``files``: data file -> the rank that wrote
    it; ``replicas[n]``: the nodes that copy node n's files. The i-th rank of
    its node sends to the (i mod size)-th rank of each replica node, so the
    receiving is spread over that node's ranks. Each rank runs its transfers
    in this (global, sorted) order one after another: whichever transfers are
    waiting, the first of them in the order has both its ends ready, so the
    ranks never wait on each other in a circle.
    """
    node_of = {r: n for n, ranks in enumerate(nodes) for r in ranks}
    out = []
    for data_file, rank in files.items():
        n = node_of[rank]
        i = list(nodes[n]).index(rank)
        out += [ReplicaTransfer(data_file, rank, nodes[m][i % len(nodes[m])]) for m in replicas[n]]
    return sorted(out)
