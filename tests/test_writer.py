"""One rank's data file: the same bytes whatever the sink and its bounce-buffer settings."""

from __future__ import annotations

import os

from fastpersist_dist.config import MiB, WriteConfig
from fastpersist_dist.storage.writer import write_rank_file

from .multiproc import run_ranks
from .test_faults import _records


def _same_file_every_way(rank: int, world: int, root: str) -> None:
    # In a forked process: the aio handle stays out of the pytest process.
    lengths = [3 * MiB + 7, 0, 5 * MiB + 1, 11]  # many buffer drains, pieces across drains, an unaligned tail
    items = _records(lengths, rank)
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
