"""The benchmark: FastPersist against megatron's torch_dist on one GPT-shaped state.

Every contender saves the same state dict from the same ranks into a fresh
directory under the same target, durably (fsync), and then loads it back
twice, with the same sharding and resharded (tensor-parallel splits moved to
the other axis), checking every loaded value. Before each load the page cache of the checkpoint files is
dropped with posix_fadvise(DONTNEED), so loads read from the device.
"""

from __future__ import annotations

import datetime
import json
import logging
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from .baselines import CONTENDERS, SHIM_NOTE
from .gpt_state import GptShape, gpt_sharded_state_dict

GiB = 2**30
OPS = ("save", "load", "reshard")


@dataclass(frozen=True)
class BenchConfig:
    """What to run; see ``fastpersist-dist bench --help``."""

    ranks: int = 2
    tp: int = 2
    gib: float = 2.0
    reps: int = 3
    directory: str = "bench_out"
    contenders: tuple[str, ...] = ("fastpersist", "fastpersist_async", "torch_dist")
    keep: bool = False


@dataclass
class Result:
    """Timings of one contender, seconds per repetition."""

    name: str
    save_s: list[float] = field(default_factory=list)
    load_s: list[float] = field(default_factory=list)
    reshard_s: list[float] = field(default_factory=list)
    blocking_s: list[float] = field(default_factory=list)


def drop_page_cache(directory: str) -> None:
    """Evict the (clean, fsynced) pages of every file under ``directory``."""
    for root, _, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _timed(fn: Callable[[], Any]) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _check(loaded: dict, expected: dict) -> None:
    for key, sh in expected.items():
        if not torch.equal(loaded[key], sh.data):
            raise AssertionError(f"benchmark: resharded load of '{key}' differs from what was saved")


def _rank_main(rank: int, cfg: BenchConfig, port: int, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=cfg.ranks, timeout=datetime.timedelta(minutes=30))
        shape = GptShape.for_bytes(int(cfg.gib * GiB), cfg.tp)
        sd = gpt_sharded_state_dict(shape, cfg.tp, rank, cfg.ranks)
        resharded = gpt_sharded_state_dict(shape, cfg.tp, rank, cfg.ranks, transpose=True)
        results = []
        for name in cfg.contenders:
            save, load = CONTENDERS[name]
            res = Result(name)
            for rep in range(cfg.reps):
                ckpt = os.path.join(cfg.directory, f"{name}-{rep}")
                if rank == 0:
                    shutil.rmtree(ckpt, ignore_errors=True)
                    os.makedirs(ckpt)
                blocked: list = []
                res.save_s.append(_timed(lambda: blocked.append(save(sd, ckpt))))
                if blocked[0] is not None:
                    res.blocking_s.append(_max_over_ranks(blocked[0]))
                for times, expected in ((res.load_s, sd), (res.reshard_s, resharded)):
                    if rank == 0:
                        drop_page_cache(ckpt)
                    template = {k: _blank(v) for k, v in expected.items()}
                    holder: dict = {}
                    times.append(_timed(lambda: holder.update(load(template, ckpt))))
                    _check(holder, expected)
                dist.barrier()
                if rank == 0:
                    print(
                        f"bench: {name} {rep + 1}/{cfg.reps}: save {res.save_s[-1]:.2f} s, "
                        f"load {res.load_s[-1]:.2f} s, reshard {res.reshard_s[-1]:.2f} s (values checked)",
                        file=sys.stderr, flush=True,
                    )
                    if not (cfg.keep and rep == cfg.reps - 1):
                        shutil.rmtree(ckpt, ignore_errors=True)
            results.append(res)
        queue.put((rank, True, (shape, results)))
    except BaseException:  # noqa: BLE001 - shown to the user by the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _blank(sh: Any) -> Any:
    from megatron.core.dist_checkpointing import ShardedTensor

    return ShardedTensor(
        sh.key, torch.empty_like(sh.data), sh.dtype, sh.local_shape, sh.global_shape, sh.global_offset,
        sh.axis_fragmentations, sh.replica_id, sh.prepend_axis_num,
    )


def run(cfg: BenchConfig, progress: Callable[[str], None] = print) -> dict:
    """Run the benchmark on ``cfg.ranks`` forked ranks; return the report as a dict."""
    os.makedirs(cfg.directory, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, cfg, port, queue)) for r in range(cfg.ranks)]
    shape = GptShape.for_bytes(int(cfg.gib * GiB), cfg.tp)
    progress(
        f"bench: {cfg.ranks} ranks (TP={cfg.tp}), GPT state hidden={shape.hidden} layers={shape.layers} "
        f"{shape.total_bytes() / GiB:.2f} GiB, {cfg.reps} reps of {', '.join(cfg.contenders)} in {cfg.directory}"
    )
    for p in procs:
        p.start()
    outcomes = {}
    for _ in procs:
        rank, ok, value = queue.get()
        outcomes[rank] = (ok, value)
    for p in procs:
        p.join()
    failed = [f"rank {r}:\n{v}" for r, (ok, v) in sorted(outcomes.items()) if not ok]
    if failed:
        raise RuntimeError("benchmark failed:\n" + "\n".join(failed))
    shape, results = outcomes[0][1]
    return report(cfg, shape, results)


def report(cfg: BenchConfig, shape: GptShape, results: list[Result]) -> dict:
    """Medians, min and max, throughput and ratios to torch_dist."""
    nbytes = shape.total_bytes()
    rows = []
    for res in results:
        row: dict[str, Any] = {"name": res.name}
        for op, times in (("save", res.save_s), ("load", res.load_s), ("reshard", res.reshard_s),
                          ("blocking", res.blocking_s)):
            if not times:
                continue
            med = statistics.median(times)
            row[op] = {"median_s": med, "min_s": min(times), "max_s": max(times), "gib_s": nbytes / GiB / med}
        rows.append(row)
    base = next((r for r in rows if r["name"] == "torch_dist"), None)
    for row in rows:
        for op in OPS:
            row[op]["x_torch_dist"] = base[op]["median_s"] / row[op]["median_s"] if base else None
    sync = next((r for r in rows if r["name"] == "fastpersist"), None)
    for row in rows:
        if "blocking" in row and sync:
            row["blocking"]["pct_of_sync_save"] = 100 * row["blocking"]["median_s"] / sync["save"]["median_s"]
    notes = [SHIM_NOTE] if "torch_dist" in cfg.contenders and not torch.cuda.is_available() else []
    return {"config": asdict(cfg), "bytes": nbytes, "hidden": shape.hidden, "layers": shape.layers,
            "load_cache": "dropped (posix_fadvise DONTNEED)", "results": rows, "notes": notes}


def format_table(rep: dict) -> str:
    """The report as a fixed-width text table."""
    lines = [
        f"state: {rep['bytes'] / GiB:.2f} GiB (GPT hidden={rep['hidden']}, layers={rep['layers']}), "
        f"{rep['config']['ranks']} ranks, TP={rep['config']['tp']}, median of {rep['config']['reps']} "
        f"(min..max); saves fsynced; 'load' same sharding, 'reshard' TP splits moved to the other axis; "
        f"page cache {rep['load_cache']}",
        "".join([f"{'contender':<18}"] + [f" {op + ' s':>20} {'GiB/s':>6} {'x t_dist':>8}" for op in OPS]),
    ]
    for r in rep["results"]:
        cells = [f"{r['name']:<18}"]
        for op in OPS:
            o = r[op]
            ratio = "" if o["x_torch_dist"] is None else f"{o['x_torch_dist']:.2f}x"
            cells.append(f" {o['median_s']:>7.2f} ({o['min_s']:.2f}..{o['max_s']:.2f})".rjust(21))
            cells.append(f" {o['gib_s']:>6.2f} {ratio:>8}")
        lines.append("".join(cells))
    for r in rep["results"]:
        if "blocking" in r:
            b = r["blocking"]
            pct = f" = {b['pct_of_sync_save']:.0f}% of the synchronous save" if "pct_of_sync_save" in b else ""
            lines.append(
                f"{r['name']}: the save call blocked {b['median_s']:.3f} s ({b['min_s']:.3f}..{b['max_s']:.3f}){pct}; "
                f"durable after {r['save']['median_s']:.2f} s; extra host memory: one snapshot of each rank's "
                f"share, {rep['bytes'] / rep['config']['ranks'] / GiB:.2f} GiB per rank on average, reused across saves"
            )
    lines.extend(f"note: {n}" for n in rep["notes"])
    return "\n".join(lines)


def main_bench(cfg: BenchConfig, json_path: Optional[str]) -> int:
    """Entry point of ``fastpersist-dist bench``."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    rep = run(cfg)
    print(format_table(rep))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rep, f, indent=1)
    return 0
