"""The persistent tier's two kinds, a directory and an S3 prefix (a real SeaweedFS server), alike."""

from __future__ import annotations

import uuid

import pytest

from fastpersist_dist.storage.persistent import PersistentDir, persistent_dir, write_at_once

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


def test_a_failed_write_among_them_is_raised_after_the_others_are_written(tmp_path):
    (tmp_path / "a-file").write_bytes(b"")
    good, bad = persistent_dir(str(tmp_path / "good")), persistent_dir(str(tmp_path / "a-file" / "sub"))
    with pytest.raises(OSError):
        write_at_once([(good, "one", b"1"), (bad, "two", b"2"), (good, "three", b"3")])
    assert sorted(good.names()) == ["one", "three"]
