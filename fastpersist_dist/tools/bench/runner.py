"""The benchmark: FastPersist against the device bound and the alternatives on one GPT-shaped state.

Ranks are forked processes (gloo on CPU; NCCL, one GPU per rank and the state on
the GPUs where CUDA is available). Every contender saves the same state dict from
the same ranks into a fresh
directory under the same target, durably (fsync), and then loads it back
with the same sharding and, where it can, resharded (tensor-parallel splits
moved to the other axis), checking every loaded value. Before each load the
page cache of the checkpoint files is dropped with posix_fadvise(DONTNEED),
so loads read from the device. Repetitions go round-robin over the contenders in
a balanced order (see :func:`balanced_order`), and each rank runs torch
with one intra-op thread where several ranks share the host, as ``torchrun``
sets ``OMP_NUM_THREADS=1``.

CPU seconds of a save are those of every process and thread that did its work:
the rank's own process (all its threads: DeepSpeed's aio threads, torch's
intra-op pool, DCP's writer threads), its reaped children (a forked writer) and
its persistent writer process (async saves), summed over ranks. Kernel
writeback threads flushing a buffered writer's page cache are not charged.
"""

from __future__ import annotations

import copy
import logging
import os
import resource
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional, Sequence, TypeVar

import torch
import torch.distributed as dist

from ...engine.async_queue import collective_device
from ...engine.index_reader import read_index
from ...engine.writer_process import writer_client
from ...format.kinds import BY_CONTAINER
from ...format.records import INDEX_FILE
from ...storage.deepspeed_ops import aio_resources
from ...storage.mounts import describe_filesystem
from ...storage.sinks import preload_ops
from ...util import progress
from ...util.config import WriteConfig
from ..ranks import run_ranks
from .baselines import CONTENDERS, DEFAULT_CONTENDERS, DEVICE_BOUND, LOCAL_TIER_DIR, SHIM_NOTE
from .gpt_state import GptShape, gpt_sharded_state_dict

logger = logging.getLogger(__name__)

GiB = 2**30
OPS = ("save", "load", "reshard")
BENCH_PG_TIMEOUT_S = 30 * 60  # a collective waits this long for a slow rank (a big state on a slow disk)


@dataclass(frozen=True)
class BenchConfig:
    """What to run; see ``fastpersist-dist bench --help``."""

    ranks: int = 2
    tp: int = 2
    gib: float = 2.0
    reps: int = 3
    directory: str = "bench_out"
    contenders: tuple[str, ...] = DEFAULT_CONTENDERS
    keep: bool = False
    write: WriteConfig = field(default_factory=WriteConfig)
    loads: bool = True  # also time the loads (the knob search needs saves only)


@dataclass
class Result:
    """Timings of one contender, seconds per repetition."""

    name: str
    save_s: list[float] = field(default_factory=list)
    load_s: list[float] = field(default_factory=list)
    reshard_s: list[float] = field(default_factory=list)
    blocking_s: list[float] = field(default_factory=list)
    save_cpu_s: list[float] = field(default_factory=list)  # CPU seconds of the save, all ranks summed
    bytes_per_rank: list[int] = field(default_factory=list)  # data file sizes, where the format says


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


def _over_ranks(value: float, op: Any = dist.ReduceOp.MAX) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=collective_device())
    dist.all_reduce(t, op=op)
    return float(t.item())


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process (all threads), its reaped children and its writer process."""
    own = sum(u.ru_utime + u.ru_stime for u in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)))
    return own + _process_cpu_seconds(writer_client().pid)


def _process_cpu_seconds(pid: Optional[int]) -> float:
    """CPU seconds so far of a running process that is not our child to reap (0 if none or gone)."""
    if pid is None:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def _cpu_timed(fn: Callable[[], Any], cpu: list[float]) -> Any:
    """``fn()``, appending the CPU seconds it took to ``cpu`` (forked writers are reaped within)."""
    start = _cpu_seconds()
    try:
        return fn()
    finally:
        cpu.append(_cpu_seconds() - start)


def _check(name: str, loaded: dict, expected: dict) -> None:
    """Every value a contender loaded equals what was saved (megatron loads return every key)."""
    for key, value in loaded.items():
        if not torch.equal(value, expected[key].data):
            raise AssertionError(f"benchmark: {name} loaded '{key}' different from what was saved")


def _bytes_per_rank(ckpt: str) -> list[int]:
    """Data file sizes per rank, read from a FastPersist index; empty for other formats."""
    if not os.path.exists(os.path.join(ckpt, INDEX_FILE)):
        return []
    index = read_index(ckpt, "bench")
    fmt = BY_CONTAINER[index.container]
    return [index.files.get(fmt.data_file(r), 0) for r in range(index.world_size)]


def process_group_backend(world: int, gpus: int) -> str:
    """NCCL where every rank has a GPU of its own; gloo on a host, and where ranks share GPUs (NCCL refuses
    two ranks on one device), so that the default two ranks also run on a one-GPU machine."""
    return "nccl" if 0 < world <= gpus else "gloo"


def rank_backend(rank: int, world: int) -> str:
    """Set up a benchmark rank before it joins (threads, its GPU); the process group's backend for it
    (see :func:`process_group_backend`). With GPUs, ranks take them round-robin."""
    if world > 1 and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)  # as torchrun does: N ranks x all cores of torch's pool each oversubscribe the host
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)  # its SSD-endurance warning on every aio write
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0  # this forked rank's first CUDA call
    if gpus:
        torch.cuda.set_device(rank % gpus)
    backend = process_group_backend(world, gpus)
    if gpus and backend == "gloo" and rank == 0:
        logger.warning("bench: %d ranks share %d GPU(s): the process group is gloo (NCCL takes one rank per GPU)",
                       world, gpus)
    return backend


def rank_device() -> torch.device:
    """Where this benchmark rank's state lives: its GPU (:func:`rank_backend` picked it), else the host."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def on_ranks(ranks: int, target: Callable[..., Any], *args: Any) -> list[Any]:
    """``target(rank, world, *args)`` on ``ranks`` forked benchmark ranks; their return values by rank.

    No deadline: a benchmark at scale takes what it takes; a rank that dies stops the others at once.
    """
    return run_ranks(ranks, target, *args, backend=rank_backend, pg_timeout=BENCH_PG_TIMEOUT_S, deadline=None)


def _rank_main(rank: int, world: int, cfg: BenchConfig) -> tuple[GptShape, list[Result]]:
    device = rank_device()
    shape = GptShape.for_bytes(int(cfg.gib * GiB), cfg.tp)
    sd = gpt_sharded_state_dict(shape, cfg.tp, rank, cfg.ranks, device=device)
    resharded = gpt_sharded_state_dict(shape, cfg.tp, rank, cfg.ranks, transpose=True, device=device)
    preload_ops(cfg.write)  # ops and this process's aio handle exist before any timing starts
    aio_resources(cfg.write.aio)
    for name in cfg.contenders:  # collective where a contender's start-up is (the same list on every rank)
        if CONTENDERS[name].start is not None:
            CONTENDERS[name].start(sd, cfg.write)
    display = progress.ProgressLine(sys.stderr)  # rank 0's bytes (its writer's and its reads)
    if rank == 0:
        progress.install(display)
    results = {name: Result(name) for name in cfg.contenders}
    for rep in range(cfg.reps):
        for name in balanced_order(cfg.contenders, rep):
            _one_rep(rank, cfg, name, rep, results[name], sd, resharded, display)
    return shape, [results[name] for name in cfg.contenders]


T = TypeVar("T")


def balanced_order(names: Sequence[T], rep: int) -> list[T]:
    """The contenders (or sweep settings) of repetition ``rep``: a Williams design, one row per round.

    Round-robin rather than one contender's repetitions in a row, so that drift of
    the machine (a disk's write cache, a VM's memory given back to the host and
    faulted in again) hits every contender alike; and each contender follows each
    other one equally often (once per ``n`` rounds for an even number ``n`` of
    them, twice per ``2n`` for an odd one), because one contender's run slows the
    next: with a plain rotation the same contender always ran right after the
    device bound, and on /dev/shm that save was measurably slower. Over the same
    rounds each takes every position equally often.
    """
    n = len(names)
    if n == 0:
        return []
    first = [0]  # 0, 1, n-1, 2, n-2, ...: its steps between neighbours are all different mod n
    for i in range(1, n):
        first.append((i + 1) // 2 if i % 2 else n - i // 2)
    if n % 2 == 0:
        return [names[(i + rep) % n] for i in first]
    row = [names[(i + rep // 2) % n] for i in first]  # odd n: each row, then the same row reversed
    return row[::-1] if rep % 2 else row


def _one_rep(rank: int, cfg: BenchConfig, name: str, rep: int, res: Result, sd: dict, resharded: dict,
             display: progress.ProgressLine) -> None:
    """One save of ``name`` and its loads, timed into ``res``."""
    contender = CONTENDERS[name]
    loads = [(res.load_s, sd)] + ([(res.reshard_s, resharded)] if contender.reshards else [])
    loads = loads if cfg.loads else []
    ckpt = os.path.join(cfg.directory, f"{name}-{rep}")
    if rank == 0:
        shutil.rmtree(ckpt, ignore_errors=True)
        os.makedirs(ckpt)
    blocked: list = []
    cpu: list[float] = []
    display.label = f"bench: {name} {rep + 1}/{cfg.reps} save"
    state = _as_built(sd)
    res.save_s.append(_timed(lambda: blocked.append(_cpu_timed(lambda: contender.save(state, ckpt, cfg.write), cpu))))
    res.save_cpu_s.append(_over_ranks(cpu[0], dist.ReduceOp.SUM))
    if blocked[0] is not None:
        res.blocking_s.append(_over_ranks(blocked[0]))
    if rep == cfg.reps - 1:
        res.bytes_per_rank = _bytes_per_rank(ckpt)
    for times, expected in loads:
        if rank == 0:
            drop_page_cache(ckpt)
        template = {k: _blank(v) for k, v in expected.items()}
        display.label = f"bench: {name} {rep + 1}/{cfg.reps} {'load' if expected is sd else 'reshard'}"
        holder: dict = {}
        times.append(_timed(lambda: holder.update(contender.load(template, ckpt, cfg.write))))
        _check(name, holder, expected)
    dist.barrier()
    if rank == 0:
        display.clear()
        timings = ", ".join(f"{op} {t[-1]:.2f} s" for op, t in
                            (("save", res.save_s), ("load", res.load_s), ("reshard", res.reshard_s)) if t)
        print(f"bench: {name} {rep + 1}/{cfg.reps}: {timings}", file=sys.stderr, flush=True)
        if not (cfg.keep and rep == cfg.reps - 1):
            shutil.rmtree(ckpt, ignore_errors=True)


def _as_built(sd: dict) -> dict:
    """The state in new ``ShardedTensor`` objects over the same tensors: what one contender's save gets.

    megatron's ``FullyParallelSaveStrategyWrapper`` re-assigns main replicas in place
    (``replica_id``); on the shared objects every contender after it in the run would
    save with its distribution (at DP > 1 torch_dist and torch.save writing half each).
    """
    return {key: copy.copy(sh) for key, sh in sd.items()}


def _blank(sh: Any) -> Any:
    """A load template like a resuming trainer's: existing (written, so mapped) tensors, not fresh pages.

    Into never-touched memory every loader pays a page fault per 4 KiB (a copy
    into it runs an order of magnitude slower than into written memory): the cost
    of allocating, which the device read bound does not pay either.
    """
    from megatron.core.dist_checkpointing import ShardedTensor

    return ShardedTensor(
        sh.key, torch.zeros_like(sh.data), sh.dtype, sh.local_shape, sh.global_shape, sh.global_offset,
        sh.axis_fragmentations, sh.replica_id, sh.prepend_axis_num,
    )


def run(cfg: BenchConfig, progress: Callable[[str], None] = print) -> dict:
    """Run the benchmark on ``cfg.ranks`` forked ranks; return the report as a dict."""
    os.makedirs(cfg.directory, exist_ok=True)
    shape = GptShape.for_bytes(int(cfg.gib * GiB), cfg.tp)
    progress(
        f"bench: {cfg.ranks} ranks (TP={cfg.tp}), GPT state hidden={shape.hidden} layers={shape.layers} "
        f"{shape.total_bytes() / GiB:.2f} GiB, {cfg.reps} reps of {', '.join(cfg.contenders)} in {cfg.directory}"
    )
    shape, results = on_ranks(cfg.ranks, _rank_main, cfg)[0]
    if not cfg.keep:  # fastpersist_local_tier's copies
        shutil.rmtree(os.path.join(cfg.directory, LOCAL_TIER_DIR), ignore_errors=True)
    return report(cfg, shape, results)


def summary(times: list[float], nbytes: int) -> dict[str, float]:
    """Median, min and max seconds of repetitions, and GiB/s at the median."""
    med = statistics.median(times)
    return {"median_s": med, "min_s": min(times), "max_s": max(times), "gib_s": nbytes / GiB / med}


def report(cfg: BenchConfig, shape: GptShape, results: list[Result]) -> dict:
    """Medians, min and max, throughput, and ratios to the device bound and to torch_dist.

    ``x_device``: the device bound's time over the contender's (1.0 = at the bound);
    ``x_torch_dist``: torch_dist's time over the contender's (2.0 = twice as fast);
    ``save.cpu_s_per_gib``: median CPU seconds of a save (all ranks, threads and
    writer processes) per GiB of the state.
    A load's bound is the bound's read of the same bytes, resharded or not.
    """
    nbytes = shape.total_bytes()
    rows = []
    for res in results:
        row: dict[str, Any] = {"name": res.name, "what": CONTENDERS[res.name].what}
        for op, times in (("save", res.save_s), ("load", res.load_s), ("reshard", res.reshard_s),
                          ("blocking", res.blocking_s)):
            if times:
                row[op] = summary(times, nbytes)
        if res.save_cpu_s:
            row["save"]["cpu_s_per_gib"] = statistics.median(res.save_cpu_s) / (nbytes / GiB)
        if res.bytes_per_rank:
            row["bytes_per_rank"] = res.bytes_per_rank
        rows.append(row)
    by_name = {r["name"]: r for r in rows}
    base, bound = by_name.get("torch_dist"), by_name.get(DEVICE_BOUND)
    for row in rows:
        for op in OPS:
            if op not in row:
                continue
            row[op]["x_torch_dist"] = base[op]["median_s"] / row[op]["median_s"] if base and op in base else None
            bound_op = "save" if op == "save" else "load"
            row[op]["x_device"] = bound[bound_op]["median_s"] / row[op]["median_s"] if bound and bound_op in bound else None
    sync = by_name.get("fastpersist")
    for row in rows:
        if "blocking" in row and sync:
            row["blocking"]["pct_of_sync_save"] = 100 * row["blocking"]["median_s"] / sync["save"]["median_s"]
    torch_dist_ran = any(name.startswith("torch_dist") for name in cfg.contenders)
    notes = [SHIM_NOTE] if torch_dist_ran and not torch.cuda.is_available() else []
    return {"config": asdict(cfg), "bytes": nbytes, "hidden": shape.hidden, "layers": shape.layers,
            "filesystem": describe_filesystem(cfg.directory), "load_cache": "dropped (posix_fadvise DONTNEED)",
            "results": rows, "notes": notes}
