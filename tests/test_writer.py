"""One rank's data file: the same bytes whatever the sink and its bounce-buffer settings."""

from __future__ import annotations

import os

import pytest
import torch
from megatron.core.dist_checkpointing import ShardedTensor

from fastpersist_dist.storage.writer import HOST_COPY_BYTES, write_rank_file
from fastpersist_dist.tools.ranks import run_ranks
from fastpersist_dist.util.config import MiB, WriteConfig

from .faults import random_records
from .helpers import load, proc_status_kib, save

pytestmark = pytest.mark.contract


def _same_file_every_way(rank: int, world: int, root: str) -> None:
    # In a forked process: the aio handle stays out of the pytest process.
    lengths = [3 * MiB + 7, 0, 5 * MiB + 1, 11]  # many buffer drains, pieces across drains, an unaligned tail
    items = random_records(lengths, rank)
    expected = b"".join(bytes(item.data.numpy()) for item in items)
    checksums = None
    for name, cfg in (("double", WriteConfig(io_buffer_mb=1, checksum_block_mb=1)),
                      ("single", WriteConfig(io_buffer_mb=1, double_buffer=False, checksum_block_mb=1)),
                      ("buffered", WriteConfig(direct_io="off", checksum_block_mb=1))):
        path = os.path.join(root, f"{name}.bin")
        result = write_rank_file(path, items, cfg, rank)
        assert result.mode == ("buffered" if name == "buffered" else "direct"), name
        with open(path, "rb") as f:
            assert f.read() == expected, name
        assert oct(os.stat(path).st_mode & 0o777) == oct(0o644), name
        sums = [r.checksums for r in result.records]
        assert checksums is None or sums == checksums, name
        checksums = sums
    assert len(checksums[2]) == 6  # 5 MiB + 1 in 1 MiB blocks


def test_same_bytes_with_double_single_and_buffered_sinks(tmp_path):
    run_ranks(1, _same_file_every_way, str(tmp_path))


def _save_strided_state(rank: int, world: int, root: str) -> list[int]:
    """Two synchronous saves of 1 GiB of transposed views (each needs a host copy); each save's peak extra RSS, KiB."""
    side, count = 4096, 16  # 16 x 64 MiB of float32
    bases = [torch.arange(side * side, dtype=torch.float32).add_(i).reshape(side, side) for i in range(count)]
    sd = {f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", b.T, replica_id=0) for i, b in enumerate(bases)}
    warm = {"w": ShardedTensor.from_rank_offsets("w", torch.ones(1024), replica_id=0)}
    save(warm, os.path.join(root, "warm"))  # ops, aio handle and bounce buffer made: not this save's growth
    growths = []
    for name in ("ckpt", "again"):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak RSS (VmHWM) restarts from the current RSS
        before = proc_status_kib("VmRSS")
        save(sd, os.path.join(root, name))
        growths.append(proc_status_kib("VmHWM") - before)
        loaded = load({k: ShardedTensor.from_rank_offsets(k, torch.empty(side, side), replica_id=0) for k in sd},
                      os.path.join(root, name))
        for k, b in zip(sd, bases):
            assert torch.equal(loaded[k], b.T), (name, k)
        del loaded
    return growths


def test_a_synchronous_save_copies_strided_records_to_the_host_a_bounded_amount_at_a_time(tmp_path):
    """Records that are not contiguous host memory (strided views here, accelerator tensors on a GPU) are
    copied as the write reaches them, at most HOST_COPY_BYTES ahead: not the whole 1 GiB share first;
    into host memory the process keeps, so the next save takes none."""
    ((first_kib, again_kib),) = run_ranks(1, _save_strided_state, str(tmp_path))
    limit = HOST_COPY_BYTES + 2 * 64 * MiB + 64 * MiB  # the bounded copies, two chunks and some slack
    assert first_kib * 1024 < limit, f"the save grew the process by {first_kib / 1024:.0f} MiB"
    assert again_kib * 1024 < 32 * MiB, f"the next save grew the process by {again_kib / 1024:.0f} MiB"
