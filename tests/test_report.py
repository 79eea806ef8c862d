"""``fastpersist-dist report``: the tables rendered from a report's JSON, the docs' blocks filled and nothing
else touched, broken blocks refused naming their file, and one real run end to end on a tiny state."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fastpersist_dist.tools.bench.gpt_state import GptShape
from fastpersist_dist.tools.bench.loop_checkpointers import LoopConfig
from fastpersist_dist.tools.bench.loop_report import LoopRun
from fastpersist_dist.tools.bench.loop_report import report as loop_report
from fastpersist_dist.tools.bench.runner import BenchConfig, Result
from fastpersist_dist.tools.bench.runner import report as bench_report
from fastpersist_dist.tools.report.blocks import BlockError, find_blocks, replace_blocks, update_pages
from fastpersist_dist.tools.report.render import BLOCKS, BENCH_ROWS, DETAIL_ROWS, bench_contenders, render

pytestmark = pytest.mark.engine

GiB = 2**30
STAMP = {
    "date": "2026-12-07T14:03:12Z", "duration_s": 512.3,
    "commit": {"sha": "a421c00" + "0" * 33, "dirty": True},
    "machine": {"hostname": "vm1", "cpu_model": "AMD EPYC", "cores": 2, "usable_cores": 2, "memory_bytes": 24 * GiB,
                "gpus": []},
    "storage": {"disk": {"path": "/work/fpb", "filesystem": "ext4 at /", "type": "ext4", "mount": "/",
                         "device": "/dev/vda"},
                "shm": {"path": "/dev/shm/fpb", "filesystem": "tmpfs at /dev/shm", "type": "tmpfs",
                        "mount": "/dev/shm", "device": "tmpfs"}},
    "versions": {"python": "3.12.3", "torch": "2.13.0", "megatron_core": "0.19.2", "deepspeed": "0.19.8",
                 "fastpersist_dist": "0.1.0"},
}


def _bench(ranks: int, directory: str, scale: float) -> dict:
    """A bench report as runner.report makes it, from made-up timings (the device bound twice as fast)."""
    cfg = BenchConfig(ranks=ranks, tp=ranks, gib=0.5, reps=3, directory=directory, contenders=bench_contenders(ranks))
    results = []
    for name in cfg.contenders:
        factor = scale * (1.0 if name.startswith("device_bound") else 2.0)
        reshard = [] if name.startswith("device_bound") or name == "torch_save" else [0.9 * factor, 1.0 * factor]
        results.append(Result(name, save_s=[0.4 * factor, 0.5 * factor, 0.6 * factor], load_s=[0.3 * factor] * 3,
                              reshard_s=reshard, save_cpu_s=[0.1 * factor] * 3))
    return {"where": "shm" if directory.startswith("/dev/shm") else "disk",
            "report": bench_report(cfg, GptShape.for_bytes(GiB // 2, ranks), results)}


def _train() -> dict:
    """A bench-train report as loop_report.report makes it, from made-up runs."""
    cfg = LoopConfig(BenchConfig(ranks=2, tp=1, gib=0.5, reps=2, directory="/work/fpb"), steps=30, every=10,
                     local_dir="/dev/shm/fpb/local-tier")
    saves = {"calls_s": [0.05, 0.06], "durable_s": [0.6, 0.7], "overlapped": [False, False], "sync_s": 0.5}
    runs = {"none": [LoopRun(loop_s=2.0), LoopRun(loop_s=2.2)],
            "torch_dist": [LoopRun(loop_s=4.0, **saves)] * 2,
            "fastpersist_megatron_queue": [LoopRun(loop_s=3.2, **saves)] * 2,
            "fastpersist": [LoopRun(loop_s=3.0, **saves)] * 2,
            "fastpersist_tiered": [LoopRun(loop_s=3.1, persisted_s=[1.2, 1.4], **saves),
                                   LoopRun(loop_s=3.3, persisted_s=[1.3, 1.3], **saves,
                                           restart={"from_local_s": 0.22, "from_persistent_s": 0.9})]}
    return loop_report(cfg, GiB // 2, runs, {name: GiB for name in runs if name != "none"})


def _result() -> dict:
    bench = [_bench(ranks, directory, scale) for directory, scale in (("/work/fpb", 1.0), ("/dev/shm/fpb", 0.5))
             for ranks in (1, 2)]
    return json.loads(json.dumps({"format": 1, "stamp": STAMP, "settings": {}, "bench": bench,
                                  "bench_train": _train()}))  # as read back from the file


def test_render_gives_each_table_with_the_stamp():
    result = _result()
    rendered = render(result)
    assert list(rendered) == list(BLOCKS)
    for text in rendered.values():
        stamp, blank, header, rule, *rows = text.split("\n")
        assert stamp.startswith("Measured by `fastpersist-dist report` on 2026-12-07 14:03 UTC, commit a421c00 "
                                "with uncommitted changes; vm1: AMD EPYC, 2 cores, 24.0 GiB memory, no GPU; "), stamp
        assert ("; disk /work/fpb (ext4 at /, /dev/vda); memory /dev/shm/fpb (tmpfs at /dev/shm); Python 3.12.3, "
                "torch 2.13.0, megatron-core 0.19.2, DeepSpeed 0.19.8.") in stamp
        assert blank == "" and header.startswith("| ") and set(rule) == {"|", "-"} and rows
        assert all(row.count("|") == header.count("|") for row in rows)
    bench = rendered["bench"].split("\n")
    assert "2 ranks (TP=2), 0.43 GiB GPT-shaped state" in bench[0] and "median of 3 (min..max)" in bench[0]
    assert bench[2] == "| where | contender | save s | x device | load s | x device | CPU s/GiB of a save |"
    assert len(bench) == 4 + 2 * len(BENCH_ROWS)
    assert bench[4] == "| disk | device bound (O_DIRECT aio, no copy, no checksum) | 0.50 (0.40..0.60) | 1.00x | " \
                       "0.30 (0.30..0.30) | 1.00x | 0.23 |"  # 0.1 CPU s over the 0.43 GiB state
    assert bench[5] == "| disk | FastPersist, native format | 1.00 (0.80..1.20) | 0.50x | 0.60 (0.60..0.60) | 0.50x | 0.46 |"
    assert bench[-1].startswith("| /dev/shm | torch.save + fsync | 0.50 (0.40..0.60) | 0.50x | ")
    detail = rendered["bench-detail"].split("\n")
    assert "1 rank (TP=1), 0.43 GiB; 2 ranks (TP=2), 0.43 GiB; median of 3 (min..max)" in detail[0]
    assert detail[2] == ("| where, ranks | contender | save s | x device | CPU s/GiB | load s (x device) | "
                         "reshard s (x device) |")
    assert len(detail) == 4 + 2 * (2 * len(DETAIL_ROWS) - 1)  # fastpersist_unshared at 2 ranks only
    assert detail[4] == "| disk, 1 | device bound | 0.50 (0.40..0.60) | 1.00 | 0.23 | 0.30 (1.00x) | - |"
    # a reshard's bound is the bound's plain load
    assert "| disk, 2 | FastPersist, native | 1.00 (0.80..1.20) | 0.50 | 0.46 | 0.60 (0.50x) | 1.90 (0.16x) |" in detail
    assert detail[-1].startswith("| /dev/shm, 2 | FastPersist, loads unshared | ")
    train = rendered["bench-train"].split("\n")
    assert "2 ranks (TP=1 x DP=2)" in train[0] and "checkpoints at steps 10, 20, median of 2" in train[0]
    assert "the loop alone 2.10 s (2.00..2.20)" in train[0]
    assert train[2] == ("| | loop slowdown | lost per checkpoint | call | to local commit | to durable | "
                        "extra host memory per rank | restart from local / persistent |")
    assert train[4:] == [  # 'call': the median of the calls after the process's first
        "| megatron torch_dist async, straight to the disk | 90.5 % | 0.95 s | 0.060 s | - | 0.65 s | 1.00 GiB | - |",
        "| ours on megatron's `AsyncCallsQueue`, straight to the disk | 52.4 % | 0.55 s | 0.060 s | - | 0.65 s | "
        "1.00 GiB | - |",
        "| ours, straight to the disk | 42.9 % | 0.45 s | 0.060 s | - | 0.65 s | 1.00 GiB | - |",
        "| ours tiered: `/dev/shm`, then the disk | 52.4 % | 0.55 s | 0.060 s | 0.65 s | 1.30 s | 1.00 GiB | "
        "0.22 s / 0.90 s |",
    ]
    assert render(result) == rendered  # pure: the same JSON, the same markdown


def test_render_leaves_out_the_tables_a_report_has_no_figures_for():
    result = _result()
    result["bench"] = [run for run in result["bench"] if run["report"]["config"]["ranks"] == 1]
    del result["bench_train"]
    assert list(render(result)) == ["bench-detail"]
    result["stamp"]["commit"] = None
    assert "outside a git checkout" in render(result)["bench-detail"]


PAGE = """# A page

Prose before, kept\twith its tabs.

<!-- report: bench begin -->
stale stamp
| old | table |
<!-- report: bench end -->

Between the blocks.
```markdown
<!-- report: nothing begin -->
(an example in fenced code is no block)
```
  <!-- report: bench-train begin -->
<!-- report: bench-train end -->
After, without a final newline"""


def test_blocks_are_replaced_inside_their_markers_only():
    rendered = {"bench": "STAMP\n\n| new |\n|---|", "bench-train": "TRAIN", "bench-detail": "unused"}
    out = replace_blocks(PAGE, rendered, "page.md", BLOCKS)
    first_begin = PAGE.index("<!-- report: bench begin -->\n") + len("<!-- report: bench begin -->\n")
    assert out[:first_begin] == PAGE[:first_begin]
    assert out[first_begin:].startswith("\nSTAMP\n\n| new |\n|---|\n\n<!-- report: bench end -->\n\nBetween")
    assert "stale stamp" not in out and "| old | table |" not in out
    tail = PAGE[PAGE.index("<!-- report: bench end -->"):PAGE.index("  <!-- report: bench-train begin -->\n")]
    assert tail in out  # the prose and the fenced example between the blocks, byte for byte
    assert out.endswith("  <!-- report: bench-train begin -->\n\nTRAIN\n\n<!-- report: bench-train end -->\n"
                        "After, without a final newline")
    assert replace_blocks(out, rendered, "page.md", BLOCKS) == out  # filling again changes nothing
    assert [(b.name, b.line) for b in find_blocks(PAGE, "page.md")] == [("bench", 5), ("bench-train", 15)]
    crlf = PAGE.replace("\n", "\r\n")
    assert replace_blocks(crlf, rendered, "page.md", BLOCKS) == out.replace("\n", "\r\n")
    assert replace_blocks("no blocks\n", rendered, "page.md", BLOCKS) == "no blocks\n"


@pytest.mark.parametrize("text, says", [
    ("a\n<!-- report: bench begin -->\nb\n", "page.md:2: block 'bench' begins here and never ends"),
    ("<!-- report: bench end -->\n", "page.md:1: end of block 'bench' without its begin"),
    ("<!-- report: bench begin -->\n<!-- report: bench end -->\n<!-- report: bench begin -->\n"
     "<!-- report: bench end -->\n", "page.md:3: block 'bench' appears twice (also at line 1)"),
    ("<!-- report: bench begin -->\n<!-- report: bench-train begin -->\n",
     "page.md:2: block 'bench-train' begins inside block 'bench' (begun at line 1, not ended)"),
    ("<!-- report: bench begin -->\n<!-- report: bench-train end -->\n",
     "page.md:2: end of block 'bench-train' inside block 'bench'"),
    ("<!-- report: bench -->\n", "page.md:1: malformed report marker '<!-- report: bench -->'"),
    ("<!-- report: benchx begin -->\n<!-- report: benchx end -->\n",
     "page.md:1: unknown report block 'benchx' (the report renders: bench, bench-detail, bench-train)"),
    ("<!-- report: bench-train begin -->\n<!-- report: bench-train end -->\n",
     "page.md:1: block 'bench-train' has no results in this report (it holds: bench)"),
])
def test_broken_blocks_are_refused_naming_the_file_and_block(text, says):
    with pytest.raises(BlockError) as err:
        replace_blocks(text, {"bench": "x"}, "page.md", BLOCKS)
    assert says in str(err.value)


def test_pages_are_all_checked_before_any_is_written(tmp_path):
    good, bad = tmp_path / "good.md", tmp_path / "bad.md"
    good.write_text("<!-- report: bench begin -->\nold\n<!-- report: bench end -->\n")
    bad.write_text("<!-- report: bench-detail begin -->\n")
    with pytest.raises(BlockError, match=f"{bad}:1: block 'bench-detail' begins here and never ends"):
        update_pages([str(good), str(bad)], {"bench": "new", "bench-detail": "new"}, BLOCKS)
    assert "old" in good.read_text()
    bad.write_text("<!-- report: bench begin -->\n<!-- report: bench end -->\n")
    with pytest.raises(BlockError, match=f"{bad}:1: block 'bench' appears twice \\(also in {good}\\)"):
        update_pages([str(good), str(bad)], {"bench": "new"}, BLOCKS)
    assert update_pages([str(good)], {"bench": "new"}, BLOCKS) == {str(good): ["bench"]}
    assert good.read_text() == "<!-- report: bench begin -->\n\nnew\n\n<!-- report: bench end -->\n"


def _report(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fastpersist_dist_cli", "report", *args], capture_output=True,
                          text=True, timeout=900)


def test_report_refuses_an_unknown_block_before_measuring(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("x\n<!-- report: benchmark begin -->\n<!-- report: benchmark end -->\n")
    proc = _report(str(page), "--dir", str(tmp_path / "disk"), "--json", str(tmp_path / "r.json"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"report: {page}:2: unknown report block 'benchmark'" in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "r.json").exists() and not (tmp_path / "disk").exists()  # nothing measured
    proc = _report(str(page), "--from-json", str(tmp_path / "none.json"))
    assert proc.returncode == 2 and f"--from-json {tmp_path / 'none.json'}: no such file" in proc.stderr


@pytest.mark.slow
def test_report_measures_writes_json_and_fills_the_pages(tmp_path, shm_dir):
    """A real run on a tiny state: the JSON records where and with what it measured, the pages' blocks hold the
    stamp and the tables, the rest of each page is untouched, and the directories the run made are gone."""
    readme, perf = tmp_path / "README.md", tmp_path / "performance.md"
    readme.write_text("# Readme\n\n<!-- report: bench begin -->\n<!-- report: bench end -->\n\nText.\n\n"
                      "<!-- report: bench-train begin -->\nold\n<!-- report: bench-train end -->\n")
    perf.write_text("# Performance\n<!-- report: bench-detail begin -->\n<!-- report: bench-detail end -->\nEnd.\n")
    out, disk, shm = tmp_path / "report.json", tmp_path / "disk" / "fpb", Path(shm_dir) / "report"
    proc = _report(str(readme), str(perf), "--gib", "0.02", "--reps", "1", "--dir", str(disk), "--shm-dir", str(shm),
                   "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"report: {readme}: filled bench, bench-train" in proc.stdout, proc.stdout
    assert f"report: {perf}: filled bench-detail" in proc.stdout and "report: 5/5: bench-train" in proc.stderr
    result = json.loads(out.read_text())
    stamp = result["stamp"]
    assert stamp["date"].endswith("Z") and stamp["duration_s"] > 0
    assert stamp["machine"]["hostname"] and stamp["machine"]["cpu_model"] and stamp["machine"]["cores"] >= 1
    assert stamp["machine"]["memory_bytes"] > 0 and isinstance(stamp["machine"]["gpus"], list)
    assert stamp["storage"]["shm"]["type"] == "tmpfs" and stamp["storage"]["shm"]["path"] == str(shm)
    assert stamp["storage"]["disk"]["path"] == str(disk) and stamp["storage"]["disk"]["device"]
    assert all(stamp["versions"][k] for k in ("python", "torch", "megatron_core", "deepspeed"))
    assert len(stamp["commit"]["sha"]) == 40 and isinstance(stamp["commit"]["dirty"], bool)
    assert [(run["where"], run["report"]["config"]["ranks"]) for run in result["bench"]] == \
        [("disk", 1), ("disk", 2), ("shm", 1), ("shm", 2)]
    assert [row["name"] for row in result["bench_train"]["rows"]] == [
        "none", "torch_dist", "fastpersist_megatron_queue", "fastpersist", "fastpersist_tiered"]
    text = readme.read_text()
    assert text.startswith("# Readme\n\n<!-- report: bench begin -->\n\nMeasured by `fastpersist-dist report` on ")
    assert "\n\nText.\n\n<!-- report: bench-train begin -->\n\nMeasured by" in text and "old" not in text
    assert "| disk | FastPersist, native format | " in text and "| ours tiered: `/dev/shm`, then the disk | " in text
    assert f"commit {stamp['commit']['sha'][:7]}" in text
    assert perf.read_text().startswith("# Performance\n<!-- report: bench-detail begin -->\n\nMeasured by")
    assert "| /dev/shm, 2 | FastPersist, loads unshared | " in perf.read_text()
    assert not (tmp_path / "disk").exists() and not shm.exists()  # made by the run, removed by it
    filled = {page: page.read_text() for page in (readme, perf)}
    proc = _report(str(readme), str(perf), "--from-json", str(out))  # re-rendered from the JSON alone: the same
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {page: page.read_text() for page in (readme, perf)} == filled
