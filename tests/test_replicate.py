"""One replica's transfer between two ranks over gloo: it arrives whole and checked, or not at all.

Real ranks, a real process group and real files, on the disk (sent from
buffers) and on tmpfs (sent from the file's own pages, mapped). The file
spans three chunks (two of 64 MiB, a short one), so a damaged block in the
first leaves two more to receive and drop in step with the sender: a good
file sent next must still arrive.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch.distributed as dist

from fastpersist_dist.engine.tiers.replicate import Replication, _receive, _send
from fastpersist_dist.format.checksum import BlockHasher
from fastpersist_dist.format.records import ShardRecord
from fastpersist_dist.format.tiers import TierManifest
from fastpersist_dist.plan.replicas import ReplicaTransfer
from fastpersist_dist.storage.spans import CHUNK_BYTES, Span, block_spans
from fastpersist_dist.storage.files import TMP_SUFFIX
from fastpersist_dist.tools.ranks import run_ranks

from .helpers import logged

pytestmark = pytest.mark.engine

BLOCK = 4 << 20
SIZE = 2 * CHUNK_BYTES + 3 * BLOCK + 12_345  # three chunks, the last one short


def _data(seed: int) -> np.ndarray:
    return np.frombuffer(np.random.default_rng(seed).bytes(SIZE), dtype=np.uint8)


def _spans(name: str, data: np.ndarray, path: str) -> list[Span]:
    """The blocks of one record covering the whole file, with its checksums."""
    hasher = BlockHasher(BLOCK)
    hasher.update(data)
    record = ShardRecord("w", "tensor", "uint8", (SIZE,), (SIZE,), (0,), None, 0, None, 0, name, 0, SIZE,
                         tuple(hasher.finish()))
    return block_spans([record], BLOCK, SIZE, path)


def _transfer(rank: int, world: int, root: str, damaged_at: int) -> dict:
    """Rank 0 sends two files to rank 1: ``bad.distcp`` (one bit flipped at ``damaged_at`` after its
    checksums were taken), then ``good.distcp``."""
    node = os.path.join(root, f"node{rank}")
    os.makedirs(node, exist_ok=True)
    manifest = TierManifest("c", os.path.join(root, "persistent"), root, ((0,), (1,)),
                            {"bad.distcp": 0, "good.distcp": 0}, (), "", "local", 0.0)
    job = Replication(manifest, node, rank, f"node {rank}", dist.group.WORLD)
    records = logged(level=logging.DEBUG)
    results = {}
    for name, seed in (("bad.distcp", 1), ("good.distcp", 2)):
        data, path = _data(seed), os.path.join(node, name)
        spans = _spans(name, data, path)
        t = ReplicaTransfer(name, 0, 1)
        if rank == 0:
            sent = data.copy()
            if name == "bad.distcp":
                sent[damaged_at] ^= 0x10
            sent.tofile(path)
            results[name] = _send(t, path, spans, dist.group.WORLD, "rank 0")
        else:
            results[name] = _receive(t, path, spans, job, "rank 1")
            results[name + " whole"] = os.path.exists(path) and np.array_equal(np.fromfile(path, np.uint8), data)
    dist.barrier()
    return {"results": results, "left": sorted(os.listdir(node)),
            "logged": [r.getMessage() for r in records if r.name.endswith("replicate")]}


@pytest.fixture(params=["disk", "tmpfs"])
def nodes_dir(request, tmp_path) -> str:
    """Where both ranks' local tiers are: on the disk, or on tmpfs."""
    return str(tmp_path) if request.param == "disk" else request.getfixturevalue("shm_dir")


def test_a_replica_arrives_whole_or_is_dropped_in_step_with_its_sender(nodes_dir):
    damaged_at = BLOCK + 100  # in the first chunk's second block
    sender, receiver = run_ranks(2, _transfer, nodes_dir, damaged_at)
    assert sender["results"] == {"bad.distcp": True, "good.distcp": True}, sender  # both read whole
    assert receiver["results"] == {"bad.distcp": False, "bad.distcp whole": False, "good.distcp": True,
                                   "good.distcp whole": True}, receiver
    assert receiver["left"] == ["good.distcp"] and not any(n.endswith(TMP_SUFFIX) for n in receiver["left"])
    assert any("the replica of bad.distcp from rank 0 was not kept" in m and f"at byte offset {BLOCK} (block 1"
               in m for m in receiver["logged"]), receiver["logged"]
    assert sum("received the replica of good.distcp" in m for m in receiver["logged"]) == 1, receiver["logged"]
