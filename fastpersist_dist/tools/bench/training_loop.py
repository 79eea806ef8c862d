"""What asynchronous checkpoints cost a training loop: ours against megatron's torch_dist async.

Each rank runs a loop that rewrites its whole GPT-shaped state in place every
step (``mul_`` + ``add_`` over every tensor: memory-bound, like an optimizer
step), optionally followed by a fixed amount of matrix products (calibrated
once to take ``compute_ms`` on the idle machine; on a GPU by default, where the
update alone takes milliseconds), waits for its device at the end of the step
(as a trainer's ``loss.item()`` does), and checkpoints asynchronously every K
steps into a fresh directory,
finalizing without blocking at every step, as a trainer does. The loop's time
is compared with the same loop without checkpoints, in the same run
(repetitions interleaved). Also measured: how long each save call blocked,
against a synchronous save of the same state by the same backend; the time from
the call until the checkpoint was committed (seen at the next step's finalize,
so with one step's resolution), also over only the saves called with no earlier
one still in flight (one that finds one queues behind it at the writer: its
time to durable then measures the checkpoint interval against the write, not a
save); and the extra host memory of the rank (sampled at every step of one
more loop per contender, in fresh rank processes: in the timed run, a
contender would reuse the heap that the one before it left). Beside them, in
the same run, the copy floor of our call (``loop_measures.py``).

A tiered contender (``fastpersist_tiered``: ``local_dir``, the persistent
tier the bench directory or ``persistent``, a directory or ``msc://`` URL)
also reports the time from the call until each checkpoint is durable on the
persistent tier and until it is committed to the local tiers (the times its
manifests record: an async tiered save is committed once written, not at the
loop's next finalize), and, after its last repetition, a restart
(``loop_measures.restart_times``). With ``nodes`` > 1 (``nodes.py``: each
node its own local tier) it keeps one replica of each node's files on another
node and also reports the time from the call until this rank's replication of
each checkpoint is done (polled after every step).

The ways of checkpointing are in ``loop_checkpointers.py``, the runs'
directories in ``loop_places.py``, the report and its table in
``loop_report.py``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ...engine.tiers.background import replicating
from ...engine.tiers.state import checkpoint_state, read_manifest, wait_durable
from ...format.tiers import DURABLE, TierManifest
from ...storage.persistent import is_object_store, persistent_dir
from ...strategies.fastpersist_save import FastPersistSaveStrategy
from .gpt_state import GptShape, gpt_sharded_state_dict
from .loop_checkpointers import CHECKPOINTERS, DEFAULT_LOOP_CONTENDERS, Checkpointer, LoopConfig
from .loop_measures import copy_floor_s, host_memory, restart_times, timed_sync_save
from .loop_places import (
    check_replicas,
    enable_object_store,
    local_manifest,
    prepare_checkpoint,
    remove_run,
    run_root,
)
from .loop_report import CopyFloor, LoopRun, report
from .nodes import become_node, node_dir
from .runner import BenchConfig, GiB, _bytes_per_rank, _over_ranks, balanced_order, on_ranks, rank_device


def matmuls_for(compute_ms: float, seconds_each: float) -> int:
    """How many products of ``seconds_each`` make ``compute_ms`` (at least one where any is asked for)."""
    return 0 if compute_ms <= 0 else max(1, round(compute_ms / 1000 / seconds_each))


@dataclass
class StepCompute:
    """A step's fixed matmul work: ``count`` products of an n x n matrix with itself, on the state's device.

    Fixed work rather than a fixed duration, so that a checkpoint slowing the
    products down (memory bandwidth, cores, the device) shows as a slower loop.
    """

    matrix: torch.Tensor
    out: torch.Tensor
    count: int = 0

    def run(self) -> None:
        for _ in range(self.count):
            torch.mm(self.matrix, self.matrix, out=self.out)


def calibrated_compute(device: torch.device, compute_ms: float) -> StepCompute:
    """Collective: the step's matmul work, as many products as take ``compute_ms`` on the slowest rank now."""
    if compute_ms <= 0:
        none = torch.empty(0, 0, device=device)
        return StepCompute(none, none, count=0)
    n = 4096 if device.type != "cpu" else 256  # a few ms each: one core of a host, or a whole GPU
    matrix = torch.randn(n, n, device=device) / n ** 0.5
    compute = StepCompute(matrix, torch.empty_like(matrix), count=1)
    compute.run()  # warm-up: kernels chosen, pages touched
    _synchronize(device)
    done, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < 0.2:
        compute.run()
        _synchronize(device)
        done += 1
    compute.count = matmuls_for(compute_ms, _over_ranks(elapsed / done))
    return compute


def _synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize()


def train_step(tensors: list[torch.Tensor], compute: StepCompute) -> None:
    """Rewrite every element in place (two memory-bound passes, like an optimizer step), then the step's
    products; return once the device is done, as a trainer's ``loss.item()`` does."""
    for t in tensors:
        t.mul_(0.999).add_(1e-3)
    compute.run()
    _synchronize(compute.matrix.device)


def _durable_after(ckpt: str, called_at: float) -> float:
    """Seconds from the save's call (unix time ``called_at``) to its state durable, as its manifest on the
    persistent tier records it: exact, where the loop only sees the state at its next step."""
    manifest = read_manifest(persistent_dir(ckpt))
    if manifest is None or DURABLE not in manifest.reached:
        raise RuntimeError(f"bench-train: {ckpt} is durable but its tiers manifest records no time for it")
    return manifest.reached[DURABLE] - called_at


def run_loop(cp: Checkpointer, sd: dict, tensors: list[torch.Tensor], compute: StepCompute, cfg: LoopConfig,
             root: str, baseline: Optional[int] = None) -> LoopRun:
    """The loop with ``cp``'s checkpoints; times are this rank's; peak memory above ``baseline`` if given."""
    run = LoopRun()
    pending: list[tuple[str, float, float]] = []  # called, not finalized: (checkpoint, call time, its unix time)
    draining: list[tuple[str, float]] = []  # tiered: finalized (local), not yet durable: (checkpoint, unix time)
    replicating_now: list[tuple[str, float, TierManifest]] = []  # tiered with replicas: finalized, replicas not made
    peak = 0

    def finalized(count: int) -> None:
        for _ in range(count):
            ckpt, call, called_at = pending.pop(0)
            if cp.tiered:  # committed once written: the time its manifest records, not the loop's next step
                run.durable_s.append(local_manifest(cfg, ckpt).created - called_at)
                draining.append((ckpt, called_at))
            else:
                run.durable_s.append(time.perf_counter() - call)
            if cp.replicas:
                replicating_now.append((ckpt, call, local_manifest(cfg, ckpt)))

    def replicated() -> None:  # this rank's replication threads run the checkpoints' jobs in order
        busy = replicating()
        while replicating_now and replicating_now[0][2].checkpoint_id not in busy:
            ckpt, call, manifest = replicating_now.pop(0)
            run.replicated_s.append(time.perf_counter() - call)
            check_replicas(cfg, ckpt, manifest)

    with cp.shims():
        for step in range(1, cfg.steps + 1):
            start = time.perf_counter()
            train_step(tensors, compute)
            if cp.checkpoints and step in cfg.save_steps:
                ckpt = f"{root}/step{step}"
                prepare_checkpoint(ckpt)
                run.overlapped.append(bool(pending))
                call, called_at = time.perf_counter(), time.time()
                cp.save(sd, ckpt)
                run.calls_s.append(time.perf_counter() - call)
                pending.append((ckpt, call, called_at))
            finalized(cp.finalize(blocking=False))
            while draining and checkpoint_state(draining[0][0]) == DURABLE:
                run.persisted_s.append(_durable_after(*draining.pop(0)))
            replicated()
            run.loop_s += time.perf_counter() - start
            if baseline is not None:
                peak = max(peak, host_memory(cp.uses_writer) - baseline)
        start = time.perf_counter()
        finalized(cp.finalize(blocking=True))
        for ckpt, called_at in draining:
            if not wait_durable(ckpt):
                raise RuntimeError(f"bench-train: {ckpt} did not become durable")
            run.persisted_s.append(_durable_after(ckpt, called_at))
        while replicating_now:
            replicated()
            time.sleep(0.005)
        run.drain_s = time.perf_counter() - start
    run.extra_bytes = peak
    return run


@dataclass
class _Trainer:
    """A rank's training state: the sharded state dict, its tensors and the step's matmul work."""

    shape: GptShape
    sd: dict
    tensors: list[torch.Tensor]
    compute: StepCompute


def _trainer(rank: int, cfg: LoopConfig) -> _Trainer:
    """A rank at start-up: its state, every page of it touched once (the memory baseline holds it all)."""
    b = cfg.bench
    device = rank_device()
    shape = GptShape.for_bytes(int(b.gib * GiB), b.tp)
    sd = gpt_sharded_state_dict(shape, b.tp, rank, b.ranks, device=device)
    tensors = [sh.data for sh in sd.values()]
    compute = calibrated_compute(device, cfg.step_compute_ms)
    train_step(tensors, compute)
    return _Trainer(shape, sd, tensors, compute)


def _join_node(rank: int, cfg: LoopConfig) -> None:
    """With ``nodes`` > 1: this rank on its node, with the node's own local tier (nodes.py)."""
    if cfg.nodes > 1:
        assert cfg.local_dir is not None
        become_node(rank, cfg.bench.ranks, cfg.nodes, os.path.abspath(cfg.local_dir))


def _memory_probe(rank: int, world: int, cfg: LoopConfig, name: str) -> int:
    """Peak extra host memory of this rank over one loop with ``name``'s checkpoints, in a fresh process."""
    _join_node(rank, cfg)
    enable_object_store(cfg)
    t = _trainer(rank, cfg)
    baseline = host_memory(include_writer=False)
    cp = CHECKPOINTERS[name](cfg)
    cp.start(t.sd)
    root = run_root(cfg, cp, f"train-{name}-memory")
    run = run_loop(cp, t.sd, t.tensors, t.compute, cfg, root, baseline)
    remove_run(cfg, cp, root)
    return int(_over_ranks(float(run.extra_bytes)))


def _rank_main(rank: int, world: int, cfg: LoopConfig,
               contenders: tuple[str, ...]) -> tuple[int, int, dict, Optional[CopyFloor]]:
    b = cfg.bench
    snapshot_bytes = 0  # this rank's data file in our synchronous save: its snapshot and their framing
    _join_node(rank, cfg)
    enable_object_store(cfg)
    t = _trainer(rank, cfg)
    FastPersistSaveStrategy(config=b.write).load_ops()  # at start-up, as docs/async.md advises
    checkpointers = {name: CHECKPOINTERS[name](cfg) for name in contenders}
    runs: dict[str, list[LoopRun]] = {name: [] for name in contenders}
    for rep in range(b.reps):
        for name in balanced_order(contenders, rep):
            cp = checkpointers[name]
            if rep == 0:
                cp.start(t.sd)
            root = run_root(cfg, cp, f"train-{name}-{rep}")
            run = run_loop(cp, t.sd, t.tensors, t.compute, cfg, root)
            if cp.checkpoints and cfg.save_steps:
                run.sync_s = timed_sync_save(cp, t.sd, root)
                if cp.uses_writer and not cp.tiered:
                    snapshot_bytes = _bytes_per_rank(os.path.join(root, "sync"))[rank]
                if cp.tiered and rep == b.reps - 1:
                    assert cfg.local_dir is not None
                    run.restart = restart_times(cfg, t.sd, f"{root}/sync", os.path.join(cfg.local_dir, "read-bound"))
            remove_run(cfg, cp, root)
            runs[name].append(_slowest(run))
            if rank == 0:
                print(f"bench-train: {name} {rep + 1}/{b.reps}: loop {runs[name][-1].loop_s:.2f} s",
                      file=sys.stderr, flush=True)
    ours = tuple(name for name, cp in checkpointers.items() if cp.uses_writer and not cp.tiered)
    floor = (CopyFloor(int(_over_ranks(snapshot_bytes)), copy_floor_s(snapshot_bytes, t.compute.matrix.device), ours)
             if ours else None)
    return t.shape.total_bytes(), t.compute.count, runs, floor


def _slowest(run: LoopRun) -> LoopRun:
    """The slowest rank's figures."""
    return LoopRun(
        loop_s=_over_ranks(run.loop_s), calls_s=[_over_ranks(c) for c in run.calls_s],
        durable_s=[_over_ranks(d) for d in run.durable_s], drain_s=_over_ranks(run.drain_s),
        sync_s=_over_ranks(run.sync_s), overlapped=[_over_ranks(float(o)) > 0 for o in run.overlapped],
        persisted_s=[_over_ranks(p) for p in run.persisted_s], restart=run.restart,
        replicated_s=[_over_ranks(p) for p in run.replicated_s],
    )


def run(cfg: LoopConfig, contenders: tuple[str, ...] = DEFAULT_LOOP_CONTENDERS,
        progress: Callable[[str], None] = print) -> dict:
    """Run the loop benchmark on forked ranks; the report as a dict."""
    b = cfg.bench
    os.makedirs(b.directory, exist_ok=True)
    shape = GptShape.for_bytes(int(b.gib * GiB), b.tp)
    progress(f"bench-train: {b.ranks} ranks (TP={b.tp}), {shape.total_bytes() / GiB:.2f} GiB state, {cfg.steps} "
             f"steps with {cfg.step_compute_ms:g} ms of matmuls each, async checkpoint at steps {cfg.save_steps}, "
             f"{b.reps} reps of {', '.join(contenders)} in {b.directory}")
    nbytes, matmuls, runs, floor = on_ranks(b.ranks, _rank_main, cfg, contenders)[0]
    memory: dict[str, int] = {}
    for name in contenders:
        if name != "none":
            progress(f"bench-train: {name}: host memory, one loop in fresh processes")
            memory[name] = on_ranks(b.ranks, _memory_probe, cfg, name)[0]
    if cfg.nodes > 1:
        assert cfg.local_dir is not None
        shutil.rmtree(os.path.dirname(node_dir(os.path.abspath(cfg.local_dir), 0)), ignore_errors=True)
    return report(cfg, nbytes, runs, memory, floor, matmuls)


def run_checked(bench: BenchConfig, steps: int, every: int, contenders: Optional[str],
                compute_ms: Optional[float] = None, local_dir: Optional[str] = None,
                persistent: Optional[str] = None, nodes: int = 1, share_reads: str = "auto") -> Optional[dict]:
    """:func:`run` for ``fastpersist-dist bench-train``: None, after saying why on stderr, on bad arguments."""
    names = tuple(contenders.split(",")) if contenders else DEFAULT_LOOP_CONTENDERS
    unknown = set(names) - set(CHECKPOINTERS)
    if unknown or "none" not in names or every >= steps:
        print(f"bench-train: contenders must include 'none' and be among {sorted(CHECKPOINTERS)} "
              f"(unknown: {sorted(unknown)}); --every must be below --steps", file=sys.stderr)
        return None
    if "fastpersist_tiered" in names and local_dir is None:
        print("bench-train: fastpersist_tiered needs --local-dir (its local tier)", file=sys.stderr)
        return None
    if nodes > 1 and (bench.ranks % nodes or local_dir is None or os.geteuid() != 0):
        print(f"bench-train: --nodes {nodes} needs --ranks a multiple of it, --local-dir, and root (each rank's "
              f"node has its own local tier in a mount namespace)", file=sys.stderr)
        return None
    if persistent is not None and is_object_store(persistent) and importlib.util.find_spec(
            "megatron.core.msc_utils") is None:
        print(f"bench-train: --persistent {persistent} needs megatron-core's multi-storage-client support "
              "(megatron-core 0.19)", file=sys.stderr)
        return None
    return run(LoopConfig(bench, steps, every, compute_ms, local_dir, persistent, nodes, share_reads), names,
               progress=lambda m: print(m, file=sys.stderr))
