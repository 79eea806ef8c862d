"""Several nodes on one machine for ``bench-train --nodes N``: each forked rank joins a node with a local tier of
its own.

A tiered save's local tier is one path on every node, each node's own
storage. Here the ranks are split into ``N`` nodes of consecutive ranks
(torchrun's ``GROUP_RANK``; ``LOCAL_WORLD_SIZE`` ranks each), and each rank
moves into a mount namespace of its own where the local tier's path is its
node's directory, ``LOCAL_DIR.nodes/node<n>`` bind-mounted there: each node
sees only its own copies, and replicas travel between them over
``torch.distributed`` as between machines. A mount namespace needs root
(``CAP_SYS_ADMIN``), as the tests' nodes do (tests/nodes.py).
"""

from __future__ import annotations

import ctypes
import os
import subprocess

CLONE_NEWNS = 0x00020000  # <sched.h>: a mount namespace of its own


def ranks_per_node(ranks: int, nodes: int) -> int:
    return ranks // nodes


def node_of(rank: int, ranks: int, nodes: int) -> int:
    """The node of ``rank``: nodes hold consecutive ranks, as torchrun's do."""
    return rank // ranks_per_node(ranks, nodes)


def node_dir(local_dir: str, node: int) -> str:
    """Where node ``node``'s local tier lives, seen from outside the nodes' namespaces."""
    return f"{local_dir.rstrip('/')}.nodes/node{node}"


def become_node(rank: int, ranks: int, nodes: int, local_dir: str) -> None:
    """This rank (before any checkpoint) as a rank of its node: torchrun's variables, and ``local_dir`` its node's
    own directory in a mount namespace of this process (its writer process inherits it)."""
    node = node_of(rank, ranks, nodes)
    os.environ["GROUP_RANK"] = str(node)
    os.environ["LOCAL_WORLD_SIZE"] = str(ranks_per_node(ranks, nodes))
    own = node_dir(local_dir, node)
    os.makedirs(own, exist_ok=True)
    os.makedirs(local_dir, exist_ok=True)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNS) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"bench-train --nodes: rank {rank} cannot have a mount namespace of its own for node "
                           f"{node}'s local tier ({os.strerror(err)}; it needs root)")
    for command in (["mount", "--make-rprivate", "/"], ["mount", "--bind", own, local_dir]):
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise OSError(f"bench-train --nodes: rank {rank} (node {node}): {' '.join(command)} failed: "
                          f"{done.stderr.strip()}")
