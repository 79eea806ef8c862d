"""Saves into the directory of a tiered checkpoint by something else than a tiered save: never a load of the
checkpoint they replaced from its local copies.

A tiered save's manifest sends a load to the nodes' local copies of its checkpoint. Ours without tiers removes
it first, with the other commit markers; megatron's own ``torch_dist`` save does not know it, so a load checks
that what is committed in the directory is what the manifest names.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing

from fastpersist_dist import (CorruptCheckpointError, FastPersistError, FastPersistLoadStrategy,
                              FastPersistSaveStrategy, checkpoint_state, prepare_checkpoint_dir, wait_copies,
                              wait_durable)
from fastpersist_dist.engine.tiers.state import check_current
from fastpersist_dist.format.checksum import digest_bytes
from fastpersist_dist.format.kinds import DCP_METADATA_FILE
from fastpersist_dist.format.records import INDEX_FILE
from fastpersist_dist.format.tiers import DRAINED_PREFIX, LOCAL, PENDING_DIR, TIERS_FILE, TierManifest
from fastpersist_dist.storage.persistent import PosixDir
from fastpersist_dist.tools.bench.baselines import torch_dist_cpu_shims
from fastpersist_dist.tools.ranks import run_ranks

from .helpers import empty_like_request
from .tiers_driver import state

pytestmark = pytest.mark.engine


def _loaded(rank: int, world: int, ckpt: str, strategy: object = None) -> str:
    """Which save's state a load of ``ckpt`` gives: "first", "second", or the error (its type first)."""
    want = state(rank, world, 2)
    request = {k: empty_like_request(v) for k, v in want.items()}
    try:
        got = dist_checkpointing.load(request, ckpt, **({} if strategy is None else {"sharded_strategy": strategy}))
    except FastPersistError as e:
        return f"{type(e).__name__}: {e}"
    for name, step in (("second", 2), ("first", 1)):
        if all(torch.equal(got[k], v.data) for k, v in state(rank, world, step).items()):
            return name
    return "mixed"


def _state(ckpt: str) -> str:
    """``checkpoint_state``, or its refusal (its type first)."""
    try:
        return str(checkpoint_state(ckpt))
    except CorruptCheckpointError as e:
        return f"{type(e).__name__}: {e}"


def _tiered_then(rank: int, world: int, root: str, second: str) -> dict:
    ckpt, local = os.path.join(root, "persistent", "step"), os.path.join(root, "local")
    prepare_checkpoint_dir(ckpt)
    dist_checkpointing.save(state(rank, world, 1), ckpt, sharded_strategy=FastPersistSaveStrategy(local_dir=local))
    assert wait_durable(ckpt, timeout=120) and wait_copies(timeout=120)
    dist.barrier()
    with torch_dist_cpu_shims():  # megatron's own writer calls torch.cuda unconditionally
        dist_checkpointing.save(state(rank, world, 2), ckpt, sharded_strategy=(
            FastPersistSaveStrategy() if second == "ours" else ("torch_dist", 1)))
    dist.barrier()
    out = {"names": sorted(os.listdir(ckpt)), "state": _state(ckpt),
           "plain": _loaded(rank, world, ckpt), "from_local": _loaded(rank, world, ckpt, FastPersistLoadStrategy(
               local_dir=local))}
    dist.barrier()
    if second == "megatron" and rank == 0:  # as the refusal says
        for name in (TIERS_FILE, INDEX_FILE):
            os.unlink(os.path.join(ckpt, name))
    dist.barrier()
    out["after_removal"] = _loaded(rank, world, ckpt)
    return out


def test_our_save_without_tiers_over_a_tiered_checkpoint_removes_its_manifest_first(tmp_path):
    for result in run_ranks(2, _tiered_then, str(tmp_path), "ours"):
        assert not [n for n in result["names"] if n in (TIERS_FILE, PENDING_DIR) or n.startswith(DRAINED_PREFIX)]
        assert result["state"] == "durable"  # saved straight there
        assert result["plain"] == result["from_local"] == result["after_removal"] == "second", result


def test_megatrons_own_save_over_a_tiered_checkpoint_is_refused_not_read_from_the_local_copies(tmp_path):
    """Both loads and ``checkpoint_state`` (whose manifest still says durable) refuse, naming the files to remove:
    in a load, rank 0 checks and the other rank gives up with it, naming it and its reason."""
    for rank, result in enumerate(run_ranks(2, _tiered_then, str(tmp_path), "megatron")):
        assert TIERS_FILE in result["names"], result["names"]  # megatron's save leaves it
        assert result["state"].startswith("CorruptCheckpointError: "), result["state"]
        for refusal in (result["plain"], result["from_local"]):
            assert refusal.startswith("CorruptCheckpointError: " if rank == 0 else
                                      "FastPersistError: rank 1: load abandoned, a rank sharing its reads failed: "
                                      "group rank 0: CorruptCheckpointError: "), refusal
        for refusal in (result["state"], result["plain"], result["from_local"]):
            assert ("holds the tiers manifest of checkpoint" in refusal and f"a torch DCP {DCP_METADATA_FILE} that "
                    f"is not the one committed with its {INDEX_FILE}" in refusal
                    and f"remove {TIERS_FILE} and {INDEX_FILE} from it" in refusal), refusal
        assert result["after_removal"] == "second", result


def _manifest(home: str, index: bytes) -> TierManifest:
    return TierManifest(checkpoint_id="c1", checkpoint_dir=home, local_dir="/local", nodes=((0,),),
                        files={"__0_0.distcp": 0}, index_files=(INDEX_FILE, DCP_METADATA_FILE),
                        index_xxh3_64=digest_bytes(index), state=LOCAL, created=time.time())


def test_a_manifest_is_checked_against_the_markers_committed_beside_it(tmp_path):
    """Before its drain commits, a tiered checkpoint's directory holds no index and no .metadata; once it did,
    they are the ones the manifest names."""
    home = PosixDir(str(tmp_path))
    ours = b'{"not": "parsed while it is not there"}'
    check_current(home, _manifest(str(tmp_path), ours), "rank 0")  # nothing committed there yet
    (tmp_path / INDEX_FILE).write_bytes(b'{"another": "index"}')
    with pytest.raises(CorruptCheckpointError, match=f"a committed {INDEX_FILE} that is not the index the manifest "
                                                     f"names: .* remove {TIERS_FILE} from it"):
        check_current(home, _manifest(str(tmp_path), ours), "rank 0")
    (tmp_path / INDEX_FILE).unlink()
    (tmp_path / DCP_METADATA_FILE).write_bytes(b"megatron's")
    with pytest.raises(CorruptCheckpointError, match=f"a torch DCP {DCP_METADATA_FILE} but no {INDEX_FILE}"):
        check_current(home, _manifest(str(tmp_path), ours), "rank 0")
