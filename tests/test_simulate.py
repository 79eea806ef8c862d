"""The scale simulation on a small layout: its layout plans completely group by group, its derived totals hold."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fastpersist_dist.format.coverage import coverage_errors
from fastpersist_dist.plan.writes import PlanCache
from fastpersist_dist.tools.bench.sim_layout import Layout
from fastpersist_dist.tools.bench.simulate import format_table, paged_index, placed_index_records, simulate

pytestmark = pytest.mark.engine

SMALL = {"tp": 2, "pp": 3, "layers": 6, "hidden": 256, "vocab": 512}


def plan_every_group(layout: Layout) -> list:
    """Every DP group planned apart, as ``parallel_group`` does: the index records of the whole checkpoint."""
    records = []
    for p in range(layout.pp):
        for t in range(layout.tp):
            held = [layout.held(t, d, p) for d in range(layout.dp)]
            plan = PlanCache().plan([("-", h) for h in held], True, layout.dp_group(t, p))
            for d, written in enumerate(plan):  # a rank writes only what it holds
                holds = {(r.key, r.global_offset) for r in held[d]}
                assert all((r.key, r.global_offset) in holds for r in written)
            per_rank = [sum(r.length for r in written) for written in plan]
            assert max(per_rank) <= 1.05 * sum(per_rank) / layout.dp, (t, p, per_rank)
            records += placed_index_records(layout, t, p, plan)
    return records


@pytest.mark.parametrize("dist_opt", [True, False])
def test_groups_planned_apart_store_every_element_once(dist_opt):
    layout = Layout(dp=4, dist_opt=dist_opt, **SMALL)
    records = plan_every_group(layout)
    assert coverage_errors(records) == []
    row = simulate(layout, world_plan_max=layout.world, central_max=layout.world)
    assert row["index_records"] == len(records)  # tensor ranks and middle stages are alike, as assumed
    assert row["group_recv_mib"] < row["world_recv_mib"]
    assert row["group_again_recv_kib"] * 1024 < row["group_recv_mib"] * 2**20
    assert 0 < row["parts_read_mib"] < row["index_mib"]
    # The paged index of the groups run, extrapolated to the like groups, is that of every group committed.
    top, parts = paged_index(layout)
    whole = len(top.to_json_bytes()) + sum(map(len, parts.values()))
    assert abs(row["paged_mib"] * 2**20 - whole) < 0.02 * whole, (row["paged_mib"] * 2**20, whole)
    assert abs(row["parts_top_mib"] * 2**20 - len(top.to_json_bytes())) < 0.02 * len(top.to_json_bytes())
    assert 0 < row["parts_pages_read"] < len(top.pages) / 4 and row["parts_read_pct"] < 100
    assert not row["world_plan_s_estimated"] and not row["dcp_estimated"]


def test_simulate_command_extrapolates_beyond_the_limits(tmp_path):
    out = tmp_path / "rows.json"
    proc = subprocess.run(
        [sys.executable, "-m", "fastpersist_dist_cli", "simulate", "--dp", "2", "4", "--dist-opt", "on",
         "--tp", "2", "--pp", "3", "--layers", "6", "--hidden", "256", "--vocab", "512",
         "--world-plan-max", "12", "--central-max", "12", "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [r["world"] for r in rows] == [12, 24]
    assert [r["dcp_estimated"] for r in rows] == [False, True]
    assert proc.stdout.strip() == format_table(rows)
    assert "| 24 | 4 | on |" in proc.stdout and "~" in proc.stdout.splitlines()[-1]


def test_layout_must_split_over_dp():
    with pytest.raises(ValueError, match="do not split over DP=3"):
        Layout(dp=3, **SMALL).held(0, 0, 0)
