"""Where ``bench-train``'s checkpoints go and how they are cleared: each run's root (the bench directory,
the persistent tier, or a new prefix on an object store), the local tiers' copies and their manifests."""

from __future__ import annotations

import os
import shutil
import uuid

import torch.distributed as dist

from ...engine.directory import prepare_checkpoint_dir
from ...engine.tiers.state import read_manifest
from ...format.tiers import TierManifest, local_copy_dir
from ...storage.persistent import PosixDir, is_object_store
from .loop_checkpointers import Checkpointer, LoopConfig
from .nodes import node_of, ranks_per_node


def _remove(path: str) -> None:
    """A run's checkpoints removed (on an object store they stay: the run's prefix is new each time)."""
    if dist.get_rank() == 0 and not is_object_store(path):
        shutil.rmtree(path, ignore_errors=True)


def enable_object_store(loop: LoopConfig) -> None:
    """megatron-core's multi-storage-client support on (what Megatron-LM's ``--enable-msc`` does), for an
    ``msc://`` persistent tier."""
    if loop.persistent is not None and is_object_store(loop.persistent):
        from megatron.core.msc_utils import MultiStorageClientFeature

        MultiStorageClientFeature.enable()


def node_leader(loop: LoopConfig) -> bool:
    """Whether this rank tends its node's local tier (the node's first rank)."""
    return dist.get_rank() % ranks_per_node(loop.bench.ranks, loop.nodes) == 0


def remove_run(loop: LoopConfig, cp: Checkpointer, root: str) -> None:
    """Collective: a run's checkpoints removed, and for a tiered one their local copies (on every node)."""
    dist.barrier()
    _remove(root)
    if cp.tiered and loop.local_dir is not None and node_leader(loop):
        for name in [f"step{s}" for s in loop.save_steps] + ["sync"]:
            shutil.rmtree(local_copy_dir(os.path.abspath(loop.local_dir), f"{root}/{name}"), ignore_errors=True)


def run_root(loop: LoopConfig, cp: Checkpointer, run_name: str) -> str:
    """Collective: an empty directory for one run of a contender: in the bench directory, or for a tiered one in
    its persistent tier (on an object store a new prefix)."""
    if not (cp.tiered and loop.persistent is not None):
        root = os.path.join(loop.bench.directory, run_name)
    elif is_object_store(loop.persistent):
        tag = [uuid.uuid4().hex[:12]]
        dist.broadcast_object_list(tag, src=0)
        return f"{loop.persistent.rstrip('/')}/{tag[0]}/{run_name}"
    else:
        root = os.path.join(loop.persistent, run_name)
    _fresh_root(dist.get_rank(), root)
    return root


def local_manifest(loop: LoopConfig, ckpt: str) -> TierManifest:
    """The tiers manifest of this node's copy of ``ckpt`` (committed)."""
    assert loop.local_dir is not None
    manifest = read_manifest(PosixDir(local_copy_dir(os.path.abspath(loop.local_dir), ckpt)))
    if manifest is None:
        raise RuntimeError(f"bench-train: {ckpt} has no committed copy on this node")
    return manifest


def check_replicas(loop: LoopConfig, ckpt: str, manifest: TierManifest) -> None:
    """Raise unless this node's copy of ``ckpt`` holds the files it keeps for other nodes, once its replication
    ended: a failed replication is not timed as one that made its replicas."""
    assert loop.local_dir is not None
    copy = local_copy_dir(os.path.abspath(loop.local_dir), ckpt)
    node = node_of(dist.get_rank(), loop.bench.ranks, loop.nodes)
    missing = [f for n, holders in enumerate(manifest.replica_nodes) if node in holders
               for f in manifest.files_of_node(n) if not os.path.isfile(os.path.join(copy, f))]
    if missing:
        raise RuntimeError(f"bench-train: the replication of {ckpt} ended without node {node}'s replicas of "
                           f"{', '.join(missing)} in {copy} (see the ranks' errors)")


def prepare_checkpoint(ckpt: str) -> None:
    """A checkpoint directory made ready (an object store needs none)."""
    if not is_object_store(ckpt):
        prepare_checkpoint_dir(ckpt)


def _fresh_root(rank: int, root: str) -> None:
    """An empty ``root`` (made by rank 0), once every rank is here."""
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
    dist.barrier()
