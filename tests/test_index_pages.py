"""Index version 3: part files per planning group, pages read by what a rank requests, damage refused loudly."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from fastpersist_dist import FastPersistLoadStrategy, FastPersistSaveStrategy
from fastpersist_dist.engine.index_reader import read_index
from fastpersist_dist.engine.load import requested_boxes
from fastpersist_dist.format.index_pages import (
    PAGED_VERSION,
    is_paged,
    meets,
    parse_page,
    parse_top,
    part_file_name,
    record_bounds,
    select_pages,
)
from fastpersist_dist.format.records import INDEX_FILE
from fastpersist_dist.format.tiers import local_copy_dir
from fastpersist_dist.tools.bench.sim_layout import Layout
from fastpersist_dist.tools.bench.simulate import loader_requests, paged_index
from fastpersist_dist.tools.ranks import run_ranks
from fastpersist_dist.tools.verify import verify_checkpoint
from fastpersist_dist.util.errors import FastPersistError

from .helpers import load, save
from .states import SHAPES, TP, check_loaded, dp_group, template, tp_dp_state

pytestmark = pytest.mark.contract

SMALL = {"tp": 2, "pp": 3, "layers": 6, "hidden": 256, "vocab": 512}


def _top(path: str):
    with open(os.path.join(path, INDEX_FILE), "rb") as f:
        doc = json.load(f)
    assert is_paged(doc) and doc["body"]["format_version"] == PAGED_VERSION
    return parse_top(doc, path)


@pytest.mark.parametrize("dist_opt", [True, False])
def test_a_resuming_rank_selects_every_record_it_needs_and_little_else(dist_opt):
    """Pure: every planning group's real part file, then one loading rank's page selection."""
    layout = Layout(dp=8, dist_opt=dist_opt, **SMALL)
    top, parts = paged_index(layout)
    wants = loader_requests(layout)
    chosen = {(p.key, p.group, p.offset) for p in select_pages(top, wants)}
    needed = set()
    for page in top.pages:
        _, records = parse_page(top, page, parts[page.part_file][page.offset : page.offset + page.length], "test")
        if any(meets(record_bounds(r), box) for r in records for box in wants.get(r.key, ())):
            needed.add((page.key, page.group, page.offset))
    assert needed == chosen  # every page it needs, and no other
    assert len(chosen) < len(top.pages) / 4, (len(chosen), len(top.pages))


def _save_groups_and_select(rank: int, world: int, root: str, checkpoint_format: str) -> tuple[int, int]:
    save(tp_dp_state(rank, 1), root, FastPersistSaveStrategy(checkpoint_format, parallel_group=dp_group(rank)))
    request = template(tp_dp_state(rank, 1))
    check_loaded(load(request, root), rank, 1)
    top = _top(root)
    chosen = select_pages(top, requested_boxes(tp_dp_state(rank, 1).values()))
    assert read_index(root, f"rank {rank}", requested_boxes(tp_dp_state(rank, 1).values())).records
    tp_keys = {"qkv", "proj", "emb", "uneven"}  # each DP group writes its own tensor-parallel slice of these
    assert {p.group for p in chosen if p.key in tp_keys} == {rank % TP}, chosen
    return len(chosen), len(top.pages)


@pytest.mark.parametrize("checkpoint_format", ["fastpersist", "torch_dist"])
def test_loading_ranks_read_only_their_pages(tmp_path, checkpoint_format):
    """4 ranks, TP=2 x DP=2, two DP groups: two part files; a rank reads the pages of its own slice."""
    root = str(tmp_path / "ckpt")
    counts = run_ranks(4, _save_groups_and_select, root, checkpoint_format)
    assert all(chosen < total for chosen, total in counts), counts
    assert sorted(n for n in os.listdir(root) if n.startswith("fastpersist_index.g")) == [part_file_name(0),
                                                                                          part_file_name(1)]
    assert verify_checkpoint(root).ok


def _load_outcome(rank: int, world: int, root: str) -> str:
    """"loaded", or the message of the error this rank's load raised.

    The load shares reads, so it is collective: a rank whose own requests are
    fine raises an error naming the rank that failed, never its own problem.
    """
    try:
        check_loaded(load(template(tp_dp_state(rank, 1)), root), rank, 1)
    except FastPersistError as e:
        return str(e)
    return "loaded"


def _abandoned_for(outcome: str, rank: int, failed: list[int]) -> bool:
    """Whether ``rank`` gave up its load because of the ranks ``failed`` (and of no problem of its own)."""
    return (outcome.startswith(f"rank {rank}: load abandoned, a rank sharing its reads failed")
            and all(f"group rank {r}: CorruptCheckpointError: rank {r}:" in outcome for r in failed))


@pytest.fixture(scope="module")
def grouped(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("pages") / "ckpt")
    run_ranks(4, _save_groups_and_select, root, "fastpersist")
    return root


def _damage_page(index_dir: str, key: str, group: int) -> str:
    """One character in the middle of the page of ``key`` in ``group``'s part file; that part file's name."""
    page = next(p for p in _top(index_dir).pages if p.key == key and p.group == group)
    with open(os.path.join(index_dir, page.part_file), "r+b") as f:
        f.seek(page.offset + page.length // 2)
        byte = f.read(1)
        f.seek(page.offset + page.length // 2)
        f.write(b"7" if byte != b"7" else b"8")
    return page.part_file


def _refused_by_1_and_3_alone(outcomes: list[str], part_file: str) -> None:
    """Tensor rank 0 never reads the pages of group {1, 3}: ranks 0 and 2 fail only because 1 and 3 did."""
    assert all(_abandoned_for(outcomes[r], r, [1, 3]) for r in (0, 2)), outcomes
    for rank, refused in ((1, outcomes[1]), (3, outcomes[3])):
        assert f"rank {rank}" in refused and "checksum mismatch" in refused and part_file in refused \
            and "'qkv'" in refused, refused


def test_a_damaged_page_is_refused_naming_the_part_file_and_key(grouped, tmp_path):
    path = str(tmp_path / "damaged")
    shutil.copytree(grouped, path)
    part_file = _damage_page(path, "qkv", 1)
    _refused_by_1_and_3_alone(run_ranks(4, _load_outcome, path), part_file)
    problems = verify_checkpoint(path).problems
    assert any(part_file in p and "checksum mismatch" in p for p in problems), problems


def _save_tiered(rank: int, world: int, root: str, local: str) -> None:
    save(tp_dp_state(rank, 1), root, FastPersistSaveStrategy(parallel_group=dp_group(rank), local_dir=local,
                                                             persistent=False))


def test_a_tiered_checkpoints_load_reads_only_its_pages_too(tmp_path):
    """A load of a tiered checkpoint reads the index from the node's copy, also only the pages its requests meet
    (every page would be half a GiB or more per rank at 16k ranks): a page of the other group damaged there
    fails ranks 1 and 3 alone."""
    root, local = str(tmp_path / "ckpt"), str(tmp_path / "local-tier")
    run_ranks(4, _save_tiered, root, local)
    part_file = _damage_page(local_copy_dir(local, root), "qkv", 1)
    _refused_by_1_and_3_alone(run_ranks(4, _load_outcome, root), part_file)


def test_a_missing_part_file_is_refused_naming_it(grouped, tmp_path):
    path = str(tmp_path / "missing")
    shutil.copytree(grouped, path)
    os.unlink(os.path.join(path, part_file_name(1)))
    outcomes = run_ranks(4, _load_outcome, path)
    assert _abandoned_for(outcomes[0], 0, [1, 2, 3]), outcomes[0]  # no box rank 0 requests meets a page of group {1, 3}
    for rank, refused in enumerate(outcomes[1:], 1):  # rank 2's rank_obj cell lies in the box of group 1's page
        assert f"rank {rank}" in refused and part_file_name(1) in refused and "is missing" in refused, refused
    problems = verify_checkpoint(path).problems
    assert any(part_file_name(1) in p and "is missing" in p for p in problems), problems
    meta = FastPersistLoadStrategy().load_tensors_metadata(path)  # from the top level alone: no part file read
    assert {k: m.global_shape for k, m in meta.items()} == SHAPES


def _load_only(rank: int, world: int, root: str) -> None:
    check_loaded(load(template(tp_dp_state(rank, 1)), root), rank, 1)


def test_a_version_1_index_still_loads(grouped, tmp_path):
    """A checkpoint committed with one whole JSON index (as before version 3) loads and verifies as before."""
    path = str(tmp_path / "v1")
    shutil.copytree(grouped, path)
    whole = read_index(path, "test")
    for name in os.listdir(path):
        if name.startswith("fastpersist_index.g"):
            os.unlink(os.path.join(path, name))
    with open(os.path.join(path, INDEX_FILE), "wb") as f:
        f.write(whole.to_json_bytes())
    assert json.loads(whole.to_json_bytes())["body"]["format_version"] == 1
    run_ranks(4, _load_only, path)
    assert verify_checkpoint(path).ok
