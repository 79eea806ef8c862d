"""The main job runs end to end on a tiny state (no timing assertions)."""

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from fastpersist_dist.storage.mounts import filesystem_type
from fastpersist_dist.tools.bench import loop_report, training_loop
from fastpersist_dist.tools.bench.baselines import CHECKSUMMED_BOUND, CONTENDERS
from fastpersist_dist.tools.bench.gpt_state import GptShape, gpt_sharded_state_dict
from fastpersist_dist.tools.bench.runner import (
    BenchConfig,
    _cpu_timed,
    balanced_order,
    on_ranks,
    process_group_backend,
    run,
)
from fastpersist_dist.tools.bench.sweep import SEARCH, format_sweep
from fastpersist_dist.tools.bench.training_loop import DEFAULT_LOOP_CONTENDERS, LoopConfig
from fastpersist_dist.tools.ranks import RanksFailed, run_ranks
from fastpersist_dist.util.config import WriteConfig
from fastpersist_dist.util.quiet import LOGGED, QUIET_ENV, WARNINGS
from fastpersist_dist_cli import DEFAULT_CONTENDERS, main

pytestmark = pytest.mark.engine


def test_gpt_shape_sizes():
    shape = GptShape.for_bytes(2 << 30, tp=2)
    assert shape.hidden % 128 == 0 and 0.5 < shape.total_bytes() / (2 << 30) <= 1.0


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 7])
def test_repetitions_balance_order_and_neighbours(n):
    """Every contender runs once per round, takes every position, and follows every other one equally often."""
    names = [f"c{i}" for i in range(n)]
    cycle = n if n % 2 == 0 else 2 * n  # rounds after which the design is balanced
    rounds = [balanced_order(names, rep) for rep in range(cycle)]
    assert all(sorted(row) == names for row in rounds)
    for name in names:
        positions = sorted(row.index(name) for row in rounds)
        assert positions == sorted(list(range(n)) * (cycle // n))
    pairs = Counter(pair for row in rounds for pair in zip(row, row[1:]))  # (before, after) back to back
    assert set(pairs) == {(a, b) for a in names for b in names if a != b}
    assert set(pairs.values()) == {cycle // n}
    assert balanced_order(names, cycle + 1) == rounds[1]


def test_balanced_order_of_sweep_settings_and_nothing():
    assert balanced_order([("aio_block_mb", 8), ("aio_block_mb", 32)], 1) == [("aio_block_mb", 32), ("aio_block_mb", 8)]
    assert balanced_order((), 2) == [] and balanced_order(["only"], 3) == ["only"]


def test_bench_command_tiny(tmp_path):
    """Every default contender runs, values are checked, JSON and PNG are written, knobs reach the writer."""
    out, chart = tmp_path / "report.json", tmp_path / "chart.png"
    proc = subprocess.run(
        [sys.executable, "-m", "fastpersist_dist_cli", "bench", "--gib", "0.02", "--reps", "1", "--tp", "1",
         "--dir", str(tmp_path / "b"), "--json", str(out), "--plot", str(chart), "--io-buffer-mb", "16",
         "--aio-queue-depth", "4", "--log-level", "DEBUG"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = {r["name"]: r for r in report["results"]}
    assert list(rows) == list(DEFAULT_CONTENDERS)
    assert report["config"]["write"]["io_buffer_mb"] == 16 and report["config"]["write"]["aio_queue_depth"] == 4
    assert rows["fastpersist_async"]["blocking"]["median_s"] > 0
    # CPU seconds per GiB for every contender; the async one's forked writer is reaped and counted
    assert all(r["save"]["cpu_s_per_gib"] > 0 for r in rows.values())
    assert "CPU s/GiB" in proc.stdout
    assert "reshard" not in rows["device_bound"] and rows["device_bound"]["save"]["x_device"] == 1.0
    # what holds the directory, beside the figures measured there
    assert report["filesystem"].startswith(f"{filesystem_type(str(tmp_path))} at ")
    assert f"in {tmp_path / 'b'} ({report['filesystem']})" in proc.stdout, proc.stdout
    checksummed = rows["device_bound_checksummed"]
    assert "reshard" not in checksummed and checksummed["save"]["x_device"] > 0 and checksummed["load"]["x_device"] > 0
    assert rows["torch_dist"]["save"]["x_torch_dist"] == 1.0 and rows["fastpersist"]["reshard"]["x_torch_dist"] > 0
    per_rank = rows["fastpersist"]["bytes_per_rank"]
    assert len(per_rank) == 2 and min(per_rank) > 0  # TP=1: all replicated, both ranks write a share
    assert "bytes written per rank" in proc.stdout and "x t_dist" in proc.stdout
    assert "bench: fastpersist_async 1/1: save" in proc.stderr  # progress while it runs
    assert "RuntimeWarning" not in proc.stderr  # e.g. runpy's about a writer process started with -m
    known = [start for _, start in WARNINGS] + [start for starts in LOGGED.values() for start in starts]
    for noise in known:  # dependencies' known warnings, hidden in our command (its ranks, megatron's spawned processes)
        assert noise not in proc.stdout + proc.stderr, noise
    assert "prepared its share" in proc.stderr and "copy+aio" in proc.stderr  # the per-rank profile, with DEBUG
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list((tmp_path / "b").iterdir())  # checkpoints removed unless --keep


def test_a_contender_that_redistributes_main_replicas_leaves_the_next_one_the_state_as_built(tmp_path):
    """megatron's FullyParallelSaveStrategyWrapper re-assigns main replicas in place (``replica_id``); the
    contenders after it must still get the state as built, not its distribution.

    TP=1: every shard is held by both ranks and rank 0 holds the main replicas, so with balancing off
    rank 0 writes everything; in the second repetition that contender runs right after the wrapper's save.
    """
    contenders = ("torch_dist_fully_parallel", "fastpersist_unbalanced")
    assert balanced_order(contenders, 1) == list(reversed(contenders))
    cfg = BenchConfig(ranks=2, tp=1, gib=0.02, reps=2, directory=str(tmp_path), contenders=contenders, loads=False)
    rows = {r["name"]: r for r in run(cfg, progress=lambda _: None)["results"]}
    first, second = rows["fastpersist_unbalanced"]["bytes_per_rank"]
    assert first > 1_000_000 and second < first / 1000, (first, second)


def test_bench_rejects_bad_arguments():
    """Each is refused by the argument check (exit code 2, the reason on stderr), not by a crash."""
    for args, says in ((["--ranks", "3", "--tp", "2"], "--ranks (3) must be a multiple of --tp (2)"),
                       (["--gib", "0"], "argument --gib: must be > 0, got 0.0"),
                       (["--contenders", "nope"], "unknown contenders ['nope']")):
        proc = subprocess.run([sys.executable, "-m", "fastpersist_dist_cli", "bench", *args],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and says in proc.stderr and "Traceback" not in proc.stderr, (args, proc.stderr)


def test_sweep_table_and_argument_check():
    rows = [{"knob": "io_buffer_mb", "value": v, "default": v == 64, "median_s": t, "min_s": t, "max_s": t + 0.1,
             "gib_s": 1 / t} for v, t in ((16, 0.5), (64, 0.25))]
    table = format_sweep(rows, BenchConfig(gib=1.0))
    assert "io_buffer_mb" in table and "64*" in table and "16 " in table and "4.00" in table
    proc = subprocess.run([sys.executable, "-m", "fastpersist_dist_cli", "sweep", "--ranks", "3", "--tp", "2"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "must be a multiple of --tp" in proc.stderr
    defaults = WriteConfig()
    assert all(getattr(defaults, knob) in values for knob, values in SEARCH.items())  # defaults are searched


@pytest.mark.slow
def test_training_loop_benchmark_tiny(tmp_path):
    """Every loop contender runs with async checkpoints and reports its figures (no timing assertions)."""
    cfg = LoopConfig(BenchConfig(gib=0.02, reps=1, directory=str(tmp_path / "t")), steps=5, every=2, compute_ms=5)
    assert cfg.save_steps == [2, 4]
    report = training_loop.run(cfg, progress=lambda _: None)
    assert report["compute_ms"] == 5 and report["matmuls_per_step"] >= 1  # calibrated on the ranks
    rows = {r["name"]: r for r in report["rows"]}
    assert list(rows) == list(DEFAULT_LOOP_CONTENDERS)
    assert "slowdown_pct" not in rows["none"]
    for name in ("torch_dist", "fastpersist_megatron_queue", "fastpersist_megatron_lm", "fastpersist"):
        r = rows[name]
        assert r["first_call_s"] > 0 and r["call_s"] > 0 and r["sync_s"] > 0, r
        assert r["durable_s"] > 0 and r["extra_gib"] >= 0 and "slowdown_pct" in r, r
    for name in ("torch_dist", "fastpersist_megatron_queue", "fastpersist_megatron_lm", "fastpersist"):  # a first save never overlaps
        r = rows[name]
        assert r["saves"] == 2 and r["overlapped"] in (0, 1) and r["durable_alone_s"] > 0, r
    # ours holds a snapshot buffer per save in flight and its writer process: more than nothing
    assert rows["fastpersist"]["extra_gib"] > 0
    # the copy floor of our calls: a rank's data file copied at once by every rank, set against our sync saves
    assert report["copy_floor_bytes"] >= report["bytes"] // 2 and report["copy_floor_s"] > 0
    assert all(rows[n]["copy_floor_pct"] > 0 for n in ("fastpersist", "fastpersist_megatron_queue", "fastpersist_megatron_lm"))
    assert "copy_floor_pct" not in rows["torch_dist"]
    table = loop_report.format_loop_table(report)
    assert all(name in table for name in rows) and "slowdown" in table and "copy floor:" in table
    assert f"plus {report['matmuls_per_step']} matmuls (calibrated to 5 ms" in table
    assert not list((tmp_path / "t").iterdir())  # every checkpoint removed


def test_process_group_backend_takes_nccl_only_with_a_gpu_per_rank():
    assert process_group_backend(2, 0) == "gloo"  # a host
    assert process_group_backend(2, 2) == "nccl" and process_group_backend(1, 8) == "nccl"
    assert process_group_backend(2, 1) == "gloo"  # NCCL refuses two ranks on one GPU


def test_matmuls_for_a_step():
    assert training_loop.matmuls_for(0, 0.002) == 0
    assert training_loop.matmuls_for(250, 0.002) == 125
    assert training_loop.matmuls_for(1, 0.5) == 1  # any asked for: at least one


def test_loop_report_sets_saves_that_overlapped_apart():
    """Durable 'alone' is over the saves called with none in flight; the overlap count is of all saves."""
    cfg = LoopConfig(BenchConfig(gib=0.02, reps=2), steps=5, every=2)
    runs = {"none": [training_loop.LoopRun(loop_s=1.0)] * 2,
            "fastpersist": [training_loop.LoopRun(loop_s=1.5, calls_s=[0.1, 0.1], durable_s=[0.5, 1.5], sync_s=1.0,
                                                  overlapped=[False, True]),
                            training_loop.LoopRun(loop_s=1.5, calls_s=[0.1, 0.1], durable_s=[0.7, 0.6], sync_s=1.0,
                                                  overlapped=[False, False])]}
    row = training_loop.report(cfg, 1 << 20, runs, {"fastpersist": 0})["rows"][1]
    assert (row["saves"], row["overlapped"]) == (4, 1)
    assert row["durable_s"] == pytest.approx(0.65) and row["durable_alone_s"] == pytest.approx(0.6)
    assert row["durable_alone_x_sync"] == pytest.approx(0.6)


def test_bench_train_rejects_bad_arguments(monkeypatch, capsys):
    """Refused before anything runs: the command line once in a process of its own, the rest through main()."""
    proc = subprocess.run([sys.executable, "-m", "fastpersist_dist_cli", "bench-train", "--contenders", "fastpersist"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "bench-train:" in proc.stderr, proc.stderr[-2000:]
    for name in ("PYTORCH_NVML_BASED_CUDA_CHECK", QUIET_ENV):  # main() sets them for the processes it starts
        monkeypatch.delenv(name, raising=False)
    for args in (["--steps", "3", "--every", "3"], ["--contenders", "none,nope"], ["--compute-ms", "-1"],
                 ["--contenders", "none,fastpersist_tiered"], ["--nodes", "3", "--local-dir", "/dev/shm/x"],
                 ["--share-reads", "sometimes"]):
        try:
            code = main(["bench-train", *args])
        except SystemExit as e:  # argparse's own refusals
            code = e.code
        err = capsys.readouterr().err
        assert code == 2 and "bench-train:" in err, (args, err[-2000:])


@pytest.mark.slow
def test_bench_train_command_writes_json(tmp_path):
    """The command prints the table and writes the same report as JSON, with the chosen contenders only. Its two
    ranks are two nodes (--nodes 2: a local tier each, in a mount namespace each) at TP=1: the tiered contender
    also reports when its checkpoints' replicas were made and when they became durable on the persistent tier, and
    a restart from the local tiers, each rank reading all it needs (--share-reads off: its own files and its replicas
    of the other node's), beside the read bounds of its even share and of the two shares it loads; nothing is left
    behind."""
    out, local = tmp_path / "train.json", tmp_path / "local"
    proc = subprocess.run(
        [sys.executable, "-m", "fastpersist_dist_cli", "bench-train", "--gib", "0.02", "--reps", "1", "--steps", "4",
         "--every", "2", "--ranks", "2", "--tp", "1", "--nodes", "2",
         "--contenders", "none,fastpersist,fastpersist_tiered",
         "--dir", str(tmp_path / "t"), "--local-dir", str(local), "--persistent", str(tmp_path / "persistent"),
         "--share-reads", "off", "--log-level", "INFO", "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["share_reads"] == "off" and "loads each, share_reads=off)" in proc.stdout, proc.stdout
    # every rank read all it needed itself: rank 0's loads say nothing read for or received from another rank,
    # which they do (the small tensors every rank holds whole) where reads are shared
    assert "fastpersist: rank 0 loaded" in proc.stderr and "read for other ranks" not in proc.stderr, proc.stderr
    rows = {r["name"]: r for r in report["rows"]}
    assert list(rows) == ["none", "fastpersist", "fastpersist_tiered"] and report["save_steps"] == [2]
    assert (report["nodes"], report["replicas"]) == (2, 1)
    tiered = rows["fastpersist_tiered"]
    # durable is the time its manifest records, the local commit and the replicas what the loop sees at a step
    assert tiered["persisted_s"] > 0 and tiered["replicated_s"] >= tiered["durable_s"] > 0, tiered
    restart = tiered["restart"]
    assert all(restart[k] > 0 for k in ("from_local_s", "from_persistent_s", "local_read_bound_s",
                                        "local_checksummed_read_bound_s", "local_checksummed_read_bound_loaded_s"))
    # TP=1 x DP=2: each rank loads the whole state, two even shares (an odd byte count splits unevenly)
    assert restart["local_checksummed_read_bound_dp"] == 2, restart
    assert abs(restart["loaded_bytes_per_rank"] - 2 * restart["bound_bytes_per_rank"]) <= 2, restart
    assert f"each rank loading {restart['loaded_bytes_per_rank'] / 2**30:.3f} GiB" in proc.stdout, proc.stdout
    loaded_bound = restart["local_checksummed_read_bound_loaded_s"]
    assert (f"that one reading its share 2 times over, {loaded_bound:.2f} s: the bytes each rank loads at DP=2"
            in proc.stdout), proc.stdout
    assert "fastpersist_tiered: local commit" in proc.stdout and "from the persistent tier" in proc.stdout
    assert "s after it (as its manifest records)" in proc.stdout, proc.stdout
    assert "on 2 nodes of this machine (replicas=1)" in proc.stdout and ", replicated (each node's" in proc.stdout
    where = report["filesystems"]
    assert set(where) == {report["directory"], str(local)} and where[str(local)], where
    assert f"into {report['directory']} ({where[report['directory']]}), local tier {local} (" in proc.stdout
    assert not list((tmp_path / "persistent").iterdir()) and not list(local.iterdir())  # all removed
    assert not os.path.exists(f"{local}.nodes")
    assert rows["fastpersist"]["call_s"] is None and rows["fastpersist"]["first_call_s"] > 0  # one save: no later call
    assert rows["fastpersist"]["durable_s"] > 0 and rows["fastpersist"]["sync_s"] > 0
    assert report["compute_ms"] == 0 and report["matmuls_per_step"] == 0  # a host's default: the update is the step
    assert report["copy_floor_s"] > 0 and "copy floor:" in proc.stdout
    assert "slowdown" in proc.stdout and "fastpersist" in proc.stdout


def _checksummed_bound_on_flipped_byte(rank: int, world: int, directory: str) -> str:
    """The checksummed bound's write, one byte of its file flipped, then its read (which must refuse it)."""
    sd = gpt_sharded_state_dict(GptShape.for_bytes(8 << 20, 1), 1, rank, 1)
    bound = CONTENDERS[CHECKSUMMED_BOUND]
    config = WriteConfig(io_buffer_mb=2)  # several chunks per file, read in alternate halves
    bound.save(sd, directory, config)
    assert bound.load(sd, directory, config) == {}  # read back intact: the digests match
    path = next(p for p in Path(directory).iterdir() if p.suffix == ".bin")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(OSError) as err:
        bound.load(sd, directory, config)
    return str(err.value)


def test_checksummed_bound_hashes_every_byte_it_writes_and_reads(tmp_path):
    """The ceiling of a checksumming writer really hashes all it moves: a flipped byte fails its read."""
    (message,) = on_ranks(1, _checksummed_bound_on_flipped_byte, str(tmp_path))
    assert "other checksums" in message and "bound00000.bin" in message


def _burn_cpu(seconds: float) -> None:
    while time.process_time() < seconds:
        pass


def test_save_cpu_seconds_count_reaped_writer_processes():
    """The CPU column charges a save with its forked writers' CPU (reaped within the save), not only the caller's."""
    cpu: list[float] = []

    def forked_writer() -> None:
        child = multiprocessing.get_context("fork").Process(target=_burn_cpu, args=(0.3,))
        child.start()
        child.join()

    _cpu_timed(forked_writer, cpu)
    assert cpu[0] >= 0.3


def _die_on_rank_1(rank: int, world: int) -> int:
    """Rank 1 is killed as the OOM killer would; rank 0 would wait for it forever."""
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)
    return rank


def test_a_rank_killed_fails_the_benchmark_instead_of_hanging():
    started = time.monotonic()
    with pytest.raises(RanksFailed) as err:
        on_ranks(2, _die_on_rank_1)
    assert "rank 1 was killed by signal 9" in str(err.value)
    assert "rank 0 was stopped after another rank failed" in str(err.value)
    assert time.monotonic() - started < 300  # not the 600 s rank 0 would have slept


def _stuck_in_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        time.sleep(600)  # a hang, where the stack shows it
    return rank


def test_a_hung_rank_fails_the_launch_and_prints_where_it_hangs(capfd):
    with pytest.raises(RanksFailed, match=r"ranks \[1\] hung past 5 s") as err:
        run_ranks(2, _stuck_in_rank_1, deadline=5)
    assert "rank 0 ok" in str(err.value)
    stacks = capfd.readouterr().err
    assert "_stuck_in_rank_1" in stacks and "test_bench.py" in stacks, stacks
