"""The persistent tier's two kinds, a directory and an S3 prefix (a real SeaweedFS server), alike."""

from __future__ import annotations

import filecmp
import os
import uuid

import numpy as np
import pytest

from fastpersist_dist.format.checksum import BlockHasher
from fastpersist_dist.format.records import ShardRecord
from fastpersist_dist.storage import persistent
from fastpersist_dist.storage.checked_read import check_file
from fastpersist_dist.storage.spans import Span, block_spans
from fastpersist_dist.storage.persistent import PersistentDir, persistent_dir, write_at_once
from fastpersist_dist.util.errors import CorruptCheckpointError

from .helpers import flip_bit

pytestmark = pytest.mark.engine


@pytest.fixture(params=["directory", "s3"])
def home(request, tmp_path) -> PersistentDir:
    if request.param == "directory":
        return persistent_dir(str(tmp_path / "ckpt"))
    request.getfixturevalue("s3")
    return persistent_dir(f"msc://s3/{uuid.uuid4().hex}/ckpt")


def test_files_written_at_once_are_each_whole(home):
    sub = home.sub("pending")
    writes = [(home, f"f{i}", bytes([i]) * (1000 * i + 1)) for i in range(6)] + [(sub, "index", b"x" * 70_000)]
    write_at_once(writes)
    for where, name, data in writes:
        assert where.read(name) == data
    assert sorted(home.names()) == [f"f{i}" for i in range(6)]
    assert sub.names() == ["index"]


def test_a_tree_removed_goes_whole_and_leaves_the_directory_beside_it(home):
    """A checkpoint removed (``remove_checkpoint``): every file under it, at any depth; a directory whose name
    it begins is untouched; removing it again, or one never made, is no error."""
    beside = persistent_dir(home.url + "2")
    write_at_once([(home, "metadata.json", b"{}"), (home.sub("weights"), "__0_0.distcp", b"x" * 70_000),
                   (home.sub("weights").sub("pending"), "fastpersist_index.json", b"{}"), (beside, "keep", b"k")])
    home.remove_tree(frozenset({"metadata.json", "fastpersist_index.json"}))
    assert home.names() == [] and home.sub("weights").names() == [] and not home.sub("weights").sub("pending").names()
    assert home.local_path is None or not os.path.exists(home.local_path)
    assert beside.read("keep") == b"k"
    home.remove_tree()
    persistent_dir(home.url + "-never").remove_tree()


def test_a_failed_write_among_them_is_raised_after_the_others_are_written(tmp_path):
    (tmp_path / "a-file").write_bytes(b"")
    good, bad = persistent_dir(str(tmp_path / "good")), persistent_dir(str(tmp_path / "a-file" / "sub"))
    with pytest.raises(OSError):
        write_at_once([(good, "one", b"1"), (bad, "two", b"2"), (good, "three", b"3")])
    assert sorted(good.names()) == ["one", "three"]


BLOCK = 4 << 20
DATA_BYTES = (16 << 20) * 4 + 12345  # past msc's multipart threshold (64 MiB): uploaded in parts


def _data_file(path: str) -> list[Span]:
    """A data file of two records at ``path``, as a drain finds one in a local tier; its checksum blocks."""
    data = np.random.default_rng(0).integers(0, 256, DATA_BYTES, dtype=np.uint8).tobytes()
    cut, records = 40 << 20, []
    for i, (lo, hi) in enumerate([(0, cut), (cut, DATA_BYTES)]):
        hasher = BlockHasher(BLOCK)
        hasher.update(data[lo:hi])
        records.append(ShardRecord(f"r{i}", "tensor", "uint8", (hi - lo,), (hi - lo,), (0,), None, 0, None, 0,
                                   "__0_0.distcp", lo, hi - lo, tuple(hasher.finish())))
    with open(path, "wb") as f:
        f.write(data)
    return block_spans(records, BLOCK, DATA_BYTES, path)


@pytest.fixture(params=["directory", "s3", "s3-rust"])
def data_home(request, tmp_path) -> PersistentDir:
    """Where a drain puts data files: a directory, or S3 through msc's boto3 client or its Rust client (which
    uploads a file by its path)."""
    if request.param == "directory":
        (tmp_path / "ckpt").mkdir()  # megatron's save() makes the checkpoint directory
        return persistent_dir(str(tmp_path / "ckpt"))
    request.getfixturevalue("s3")
    return persistent_dir(f"msc://{request.param}/{uuid.uuid4().hex}/ckpt")


def test_files_removed_at_once_are_gone_and_the_missing_ones_no_error(data_home):
    """Drain markers and stale files go in one call (on S3, a request per thousand names); names that are not
    there (removed meanwhile, or never written) are not an error."""
    names = [f".fastpersist_drained.c1.__{i}_0.distcp" for i in range(30)] + ["keep.distcp"]
    write_at_once([(data_home, n, b"") for n in names])
    data_home.remove_all(names[:-1] + ["never-written", names[0]])
    assert data_home.names() == ["keep.distcp"]
    data_home.remove_all([])


def test_a_data_file_put_and_fetched_back_is_the_same(data_home, tmp_path):
    src, back = str(tmp_path / "src.distcp"), str(tmp_path / "back.distcp")
    spans = _data_file(src)
    data_home.put("__0_0.distcp", src, spans, DATA_BYTES, "rank 0")
    data_home.fetch("__0_0.distcp", back, spans, DATA_BYTES, "rank 0")
    assert filecmp.cmp(src, back, shallow=False)


def test_a_damaged_block_is_not_put_and_the_error_names_it(data_home, tmp_path):
    src = str(tmp_path / "src.distcp")
    spans = _data_file(src)
    flip_bit(src, 5 * BLOCK + 7)
    with pytest.raises(CorruptCheckpointError, match=f"checksum mismatch in {src} at byte offset {5 * BLOCK}"):
        data_home.put("__0_0.distcp", src, spans, DATA_BYTES, "rank 0")
    assert "__0_0.distcp" not in data_home.names()


def test_a_data_file_of_another_size_than_its_index_says_is_not_put(data_home, tmp_path):
    src = str(tmp_path / "src.distcp")
    spans = _data_file(src)
    with open(src, "ab") as f:
        f.write(b"x")
    with pytest.raises(CorruptCheckpointError, match=f"rank 0: {src} has {DATA_BYTES + 1} bytes, the index says "
                       f"{DATA_BYTES}"):
        data_home.put("__0_0.distcp", src, spans, DATA_BYTES, "rank 0")
    assert "__0_0.distcp" not in data_home.names()


def test_a_block_damaged_while_the_rust_client_uploads_is_caught_and_the_object_removed(s3, tmp_path, monkeypatch):
    """The Rust client reads the file itself: a block that rots after the check before the upload is found by
    the check after it, and the object it uploaded is removed."""
    home = persistent_dir(f"msc://s3-rust/{uuid.uuid4().hex}/ckpt")
    src = str(tmp_path / "src.distcp")
    spans = _data_file(src)
    checks = []

    def check_then_rot(*args) -> None:
        check_file(*args)
        if not checks:
            flip_bit(src, 9 * BLOCK)
        checks.append(args)

    monkeypatch.setattr(persistent, "check_file", check_then_rot)
    with pytest.raises(CorruptCheckpointError, match=f"checksum mismatch in {src} at byte offset {9 * BLOCK}"):
        home.put("__0_0.distcp", src, spans, DATA_BYTES, "rank 0")
    assert len(checks) == 1 and home.names() == []
