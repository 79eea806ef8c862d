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
save); and the extra host memory of the rank (its
processes' memory above what the rank held before any checkpoint, sampled at
every step of one more loop per contender, in fresh rank processes: in the
timed run, a contender would reuse the heap that the one before it left).
Beside them, in the same run, the copy floor of our call: every rank copying
as many bytes as its data file holds (its snapshot and a few KiB of framing)
from its state's device into mapped shared memory (page-locked for a GPU) at
the same instant, the least that a call which copies the state can block.

A tiered contender (``fastpersist_tiered``: ``local_dir``, the persistent
tier the bench directory or ``persistent``, a directory or ``msc://`` URL)
also reports the time from the call until each checkpoint is durable on the
persistent tier and until it is committed to the local tiers (the times its
manifests record: an async tiered save is committed once written, not at the
loop's next finalize), and, after its last repetition, a
restart: that repetition's synchronous save loaded from the local tier, then,
its local copy removed, from the persistent tier, beside the local tier's read
bounds (the device bound's reads of each rank's even share of the state, plain
and with every byte hashed as a load must), medians of as many loads as
repetitions. A rank that holds replicas (data parallelism) loads more than its
even share: the report gives both sizes.
With ``nodes`` > 1 (``nodes.py``: each node its own local tier) it keeps one
replica of each node's files on another node and also reports the time from
the call until this rank's replication of each checkpoint is done (polled
after every step).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import statistics
import sys
import time
import uuid
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Optional

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing

from ... import compat
from ...engine.async_queue import AsyncSaveQueue
from ...engine.directory import prepare_checkpoint_dir
from ...engine.tiers.background import replicating
from ...engine.tiers.state import checkpoint_state, read_manifest, wait_durable
from ...engine.writer_process import writer_client
from ...format.tiers import DURABLE, TierManifest, local_copy_dir
from ...integrations.megatron_lm_queue import queue_class
from ...storage.host_copy import copy_to_host
from ...storage.mounts import describe_filesystem
from ...storage.persistent import PosixDir, is_object_store, persistent_dir
from ...storage.shared_memory import SharedBuffer
from ...strategies.fastpersist_load import FastPersistLoadStrategy
from ...strategies.fastpersist_save import FastPersistSaveStrategy
from ...util.config import TierConfig, check_copy_modes
from .baselines import CHECKSUMMED_BOUND, CONTENDERS, DEVICE_BOUND, SHIM_NOTE, even_share, torch_dist_cpu_shims
from .gpt_state import GptShape, gpt_sharded_state_dict
from .nodes import become_node, node_dir, node_of, ranks_per_node
from .runner import (
    BenchConfig,
    GiB,
    _blank,
    _bytes_per_rank,
    _over_ranks,
    _timed,
    balanced_order,
    drop_page_cache,
    on_ranks,
    rank_device,
)

ACCELERATOR_COMPUTE_MS = 250.0


def default_compute_ms() -> float:
    """Matmul time per step when not given: none on a host, where rewriting the state is a step's
    worth of memory traffic, and ``ACCELERATOR_COMPUTE_MS`` on a GPU, which
    rewrites it in milliseconds: saves every 10 steps would otherwise always overlap, whatever the backend."""
    return ACCELERATOR_COMPUTE_MS if torch.cuda.is_available() else 0.0


@dataclass(frozen=True)
class LoopConfig:
    """The loop: ``steps`` steps, an async checkpoint every ``every`` steps (not at the last one), and
    ``compute_ms`` of matrix products per step besides the update (None: :func:`default_compute_ms`)."""

    bench: BenchConfig
    steps: int = 30
    every: int = 10
    compute_ms: Optional[float] = None
    local_dir: Optional[str] = None  # the local tier of tiered contenders
    persistent: Optional[str] = None  # their persistent tier (a directory or msc:// URL); default the bench's
    drain_while_writing: bool = False  # TierConfig's, for tiered contenders
    write_through: bool = False  # TierConfig's, for tiered contenders
    nodes: int = 1  # the ranks split into this many nodes on this machine (nodes.py); with 2+, replicas=1
    share_reads: str = "auto"  # ReadConfig's, for the restarts of tiered contenders

    @property
    def replicas(self) -> int:
        return 1 if self.nodes > 1 else 0

    @property
    def step_compute_ms(self) -> float:
        return default_compute_ms() if self.compute_ms is None else self.compute_ms

    @property
    def save_steps(self) -> list[int]:
        return [s for s in range(1, self.steps) if s % self.every == 0]


class _Checkpointer:
    """One way to checkpoint asynchronously: the save call, a non-blocking finalize, a synchronous save."""

    checkpoints = True
    uses_writer = False  # whether the rank's persistent writer process counts towards this one's memory
    tiered = False  # whether a finalized save is only local, durable later on the persistent tier
    replicas = 0  # tiered: how many other nodes keep each node's files

    def shims(self) -> ContextManager[Any]:
        return nullcontext()

    def start(self, sd: dict) -> None:
        """What a trainer does once at start-up for this way of saving (before its first loop)."""

    def save(self, sd: dict, ckpt: str) -> None:
        raise NotImplementedError

    def finalize(self, blocking: bool) -> int:
        """Finalize what is done (collective); how many saves were finalized."""
        return 0

    def sync_save(self, sd: dict, ckpt: str) -> None:
        raise NotImplementedError


class _None(_Checkpointer):
    """The reference loop: no checkpoints."""

    checkpoints = False


class _Ours(_Checkpointer):
    """``save(..., sharded_strategy=FastPersistSaveStrategy(), async_sharded_save=True)``, a fresh strategy each."""

    uses_writer = True

    def __init__(self, cfg: BenchConfig, megatron_queue: bool, tiers: Optional[TierConfig] = None,
                 megatron_lm: bool = False):
        self._write = cfg.write
        self._megatron = megatron_queue or megatron_lm
        # Megatron-LM's --async-save queue once megatron_lm.enable() ran: ours for our requests
        queue = queue_class(compat.megatron_async_queue_class()) if megatron_lm else compat.megatron_async_queue_class()
        self._queue: Any = queue() if self._megatron else AsyncSaveQueue()
        self._tiers = tiers
        self.tiered = tiers is not None
        self.replicas = 0 if tiers is None else tiers.replicas

    def _strategy(self) -> FastPersistSaveStrategy:
        return FastPersistSaveStrategy(config=self._write, tiers=self._tiers)

    def shims(self) -> ContextManager[Any]:
        return torch_dist_cpu_shims() if self._megatron else nullcontext()

    def start(self, sd: dict) -> None:
        self._strategy().load_ops(sd)  # plan + snapshot buffer, as docs/async.md advises

    def save(self, sd: dict, ckpt: str) -> None:
        request = dist_checkpointing.save(sd, ckpt, sharded_strategy=self._strategy(), async_sharded_save=True,
                                          **compat.ASYNC_SAVE_KWARGS)
        if self._megatron:
            self._queue.schedule_async_request(request)
        else:
            self._queue.schedule(request)

    def finalize(self, blocking: bool) -> int:
        if self._megatron:
            return len(self._queue.maybe_finalize_async_calls(blocking=blocking))
        return len(self._queue.maybe_finalize(blocking=blocking))

    def sync_save(self, sd: dict, ckpt: str) -> None:
        dist_checkpointing.save(sd, ckpt, sharded_strategy=self._strategy())


def _tiered(loop: "LoopConfig") -> _Checkpointer:
    if loop.local_dir is None:
        raise ValueError("fastpersist_tiered needs a local tier: bench-train --local-dir PATH")
    return _Ours(loop.bench, megatron_queue=False, tiers=TierConfig(os.path.abspath(loop.local_dir),
                                                                    replicas=loop.replicas,
                                                                    drain_while_writing=loop.drain_while_writing,
                                                                    write_through=loop.write_through))


class _TorchDist(_Checkpointer):
    """megatron's torch_dist async save on megatron's own AsyncCallsQueue (fork, copy-on-write)."""

    def __init__(self, cfg: BenchConfig):
        self._queue = compat.megatron_async_queue_class()()

    def shims(self) -> ContextManager[Any]:
        return torch_dist_cpu_shims()

    def save(self, sd: dict, ckpt: str) -> None:
        request = dist_checkpointing.save(sd, ckpt, sharded_strategy=("torch_dist", 1), async_sharded_save=True,
                                          **compat.ASYNC_SAVE_KWARGS)
        self._queue.schedule_async_request(request)

    def finalize(self, blocking: bool) -> int:
        return len(self._queue.maybe_finalize_async_calls(blocking=blocking))

    def sync_save(self, sd: dict, ckpt: str) -> None:
        dist_checkpointing.save(sd, ckpt, sharded_strategy=("torch_dist", 1))


CHECKPOINTERS: dict[str, Callable[["LoopConfig"], _Checkpointer]] = {
    "none": lambda loop: _None(),
    "torch_dist": lambda loop: _TorchDist(loop.bench),
    "fastpersist_megatron_queue": lambda loop: _Ours(loop.bench, megatron_queue=True),
    "fastpersist_megatron_lm": lambda loop: _Ours(loop.bench, megatron_queue=False, megatron_lm=True),
    "fastpersist": lambda loop: _Ours(loop.bench, megatron_queue=False),
    "fastpersist_tiered": _tiered,
}
WHAT = {
    "none": "no checkpoints (the reference loop)",
    "torch_dist": "megatron torch_dist async on megatron's AsyncCallsQueue (forks a caller per save)",
    "fastpersist_megatron_queue": "FastPersistSaveStrategy() per save on megatron's AsyncCallsQueue (forks a caller "
                                  "per save: copy-on-write while it writes)",
    "fastpersist_megatron_lm": "FastPersistSaveStrategy() per save on the queue Megatron-LM's --async-save gets "
                               "with fastpersist_dist.megatron_lm (ours for our saves: no caller forked)",
    "fastpersist": "FastPersistSaveStrategy() per save on AsyncSaveQueue (a thread per save; the rank's writer "
                   "process writes)",
    "fastpersist_tiered": "FastPersistSaveStrategy(local_dir=...) per save on AsyncSaveQueue: committed on the local "
                          "tier, then copied to the persistent tier in the background",
}
DEFAULT_LOOP_CONTENDERS = ("none", "torch_dist", "fastpersist_megatron_queue", "fastpersist_megatron_lm", "fastpersist")


@dataclass(frozen=True)
class CopyFloor:
    """:func:`copy_floor_s` of the largest snapshot of a rank, and the contenders whose snapshot that is."""

    nbytes: int
    seconds: float
    contenders: tuple[str, ...]


@dataclass
class LoopRun:
    """One repetition of one contender on one rank (seconds; bytes)."""

    loop_s: float = 0.0
    calls_s: list[float] = field(default_factory=list)
    durable_s: list[float] = field(default_factory=list)  # per save, in call order (finalized in order)
    overlapped: list[bool] = field(default_factory=list)  # per save: an earlier one still in flight at its call
    drain_s: float = 0.0
    sync_s: float = 0.0
    extra_bytes: int = 0
    persisted_s: list[float] = field(default_factory=list)  # tiered: per save, call to durable on the persistent tier
    replicated_s: list[float] = field(default_factory=list)  # tiered with replicas: per save, call to its replicas made
    restart: dict[str, float] = field(default_factory=dict)  # tiered, last repetition: see Restart


# ----------------------------------------------------------------------------- host memory


def _descendants(pid: int) -> list[int]:
    out = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                children = [int(c) for c in f.read().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
        for child in children:
            out += [child] + _descendants(child)
    return out


def _memory(pid: int, field_names: tuple[str, ...]) -> int:
    """Sum of ``field_names`` (kB) in ``/proc/pid/smaps_rollup``, in bytes; 0 if the process is gone."""
    total = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in field_names:
                    total += int(rest.split()[0]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return 0
    return total


def host_memory(include_writer: bool) -> int:
    """Bytes of host memory held by this rank: its resident set plus its children's private pages.

    A forked child's private pages are the ones the trainer modified since the
    fork (copy-on-write keeps the old copy for the child); shared memory mapped
    by both (our snapshot buffer) is counted once, in the trainer.
    """
    writer = writer_client().pid
    children = [p for p in _descendants(os.getpid()) if include_writer or p != writer]
    return _memory(os.getpid(), ("Rss",)) + sum(_memory(p, ("Private_Clean", "Private_Dirty")) for p in children)


# ----------------------------------------------------------------------------- the loop


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


def _remove(path: str) -> None:
    """A run's checkpoints removed (on an object store they stay: the run's prefix is new each time)."""
    if dist.get_rank() == 0 and not is_object_store(path):
        shutil.rmtree(path, ignore_errors=True)


def _enable_object_store(loop: LoopConfig) -> None:
    """megatron-core's multi-storage-client support on (what Megatron-LM's ``--enable-msc`` does), for an
    ``msc://`` persistent tier."""
    if loop.persistent is not None and is_object_store(loop.persistent):
        from megatron.core.msc_utils import MultiStorageClientFeature

        MultiStorageClientFeature.enable()


def _node_leader(loop: LoopConfig) -> bool:
    """Whether this rank tends its node's local tier (the node's first rank)."""
    return dist.get_rank() % ranks_per_node(loop.bench.ranks, loop.nodes) == 0


def _remove_run(loop: LoopConfig, cp: _Checkpointer, root: str) -> None:
    """Collective: a run's checkpoints removed, and for a tiered one their local copies (on every node)."""
    dist.barrier()
    _remove(root)
    if cp.tiered and loop.local_dir is not None and _node_leader(loop):
        for name in [f"step{s}" for s in loop.save_steps] + ["sync"]:
            shutil.rmtree(local_copy_dir(os.path.abspath(loop.local_dir), f"{root}/{name}"), ignore_errors=True)


def _root(loop: LoopConfig, cp: _Checkpointer, run_name: str) -> str:
    """Collective: an empty directory for one run of a contender: in the bench directory, or for a tiered one in
    its persistent tier (on an object store a new prefix)."""
    if not (cp.tiered and loop.persistent is not None):
        root = os.path.join(loop.bench.directory, run_name)
    elif is_object_store(loop.persistent):
        tag = [uuid.uuid4().hex[:12]]
        dist.broadcast_object_list(tag, src=0)
        return f"{loop.persistent.rstrip('/')}/{tag[0]}/{run_name}"
    else:
        root = os.path.join(loop.persistent, run_name)
    _fresh_root(dist.get_rank(), root)
    return root


def _durable_after(ckpt: str, called_at: float) -> float:
    """Seconds from the save's call (unix time ``called_at``) to its state durable, as its manifest on the
    persistent tier records it: exact, where the loop only sees the state at its next step."""
    manifest = read_manifest(persistent_dir(ckpt))
    if manifest is None or DURABLE not in manifest.reached:
        raise RuntimeError(f"bench-train: {ckpt} is durable but its tiers manifest records no time for it")
    return manifest.reached[DURABLE] - called_at


def run_loop(cp: _Checkpointer, sd: dict, tensors: list[torch.Tensor], compute: StepCompute, cfg: LoopConfig,
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
                run.durable_s.append(_local_manifest(cfg, ckpt).created - called_at)
                draining.append((ckpt, called_at))
            else:
                run.durable_s.append(time.perf_counter() - call)
            if cp.replicas:
                replicating_now.append((ckpt, call, _local_manifest(cfg, ckpt)))

    def replicated() -> None:  # this rank's replication threads run the checkpoints' jobs in order
        busy = replicating()
        while replicating_now and replicating_now[0][2].checkpoint_id not in busy:
            ckpt, call, manifest = replicating_now.pop(0)
            run.replicated_s.append(time.perf_counter() - call)
            _check_replicas(cfg, ckpt, manifest)

    with cp.shims():
        for step in range(1, cfg.steps + 1):
            start = time.perf_counter()
            train_step(tensors, compute)
            if cp.checkpoints and step in cfg.save_steps:
                ckpt = f"{root}/step{step}"
                _prepare(ckpt)
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


def _local_manifest(loop: LoopConfig, ckpt: str) -> TierManifest:
    """The tiers manifest of this node's copy of ``ckpt`` (committed)."""
    assert loop.local_dir is not None
    manifest = read_manifest(PosixDir(local_copy_dir(os.path.abspath(loop.local_dir), ckpt)))
    if manifest is None:
        raise RuntimeError(f"bench-train: {ckpt} has no committed copy on this node")
    return manifest


def _check_replicas(loop: LoopConfig, ckpt: str, manifest: TierManifest) -> None:
    """Raise unless this node's copy of ``ckpt`` holds the files it keeps for other nodes, once its replication
    ended: a failed replication is not timed as one that made its replicas."""
    assert loop.local_dir is not None
    copy = local_copy_dir(os.path.abspath(loop.local_dir), ckpt)
    node = node_of(dist.get_rank(), loop.bench.ranks, loop.nodes)
    missing = [f for n, holders in enumerate(manifest.replica_nodes) if node in holders
               for f in manifest.files_of_node(n) if not os.path.isfile(os.path.join(copy, f))]
    if missing:
        raise RuntimeError(f"bench-train: the replication of {ckpt} ended without node {node}'s replicas of "
                           f"{', '.join(missing)} in {copy} (see the ranks' errors)")


def _prepare(ckpt: str) -> None:
    """A checkpoint directory made ready (an object store needs none)."""
    if not is_object_store(ckpt):
        prepare_checkpoint_dir(ckpt)


def restart_times(loop: LoopConfig, sd: dict, ckpt: str, bound_dir: str) -> dict[str, Optional[float]]:
    """Collective: seconds to load ``ckpt`` from the local tier, then (its local copy removed) from the
    persistent tier, and the device bound's reads of each rank's even share of the state from the local tier
    (``bound_dir``), plain and checksummed (every byte hashed, as a load must): medians of ``reps`` loads each
    (slowest rank), the local loads alternating with the bounds' reads; and the bytes per rank of each (the
    most of any rank). With data-parallel ranks (DP > 1) each rank loads DP even shares (a tensor-parallel
    slice of the whole state), so the checksummed bound also reads its share DP times over: the bytes the
    load brings each rank, at the device's pace, which tells how much of the gap to the even share is the
    load's own cost and how much is the bytes (reading each byte once and sending it between ranks instead
    is ``share_reads``' business, over the group's transport)."""
    assert loop.local_dir is not None
    template = {k: _blank(v) for k, v in sd.items()}
    local_copy = local_copy_dir(os.path.abspath(loop.local_dir), ckpt)
    bounds = {name: CONTENDERS[name] for name in (DEVICE_BOUND, CHECKSUMMED_BOUND)}

    def dropped(*where: str) -> None:
        if _node_leader(loop):
            for w in where:
                if not is_object_store(w) and os.path.isdir(w):
                    drop_page_cache(w)
        dist.barrier()

    def load() -> float:
        dropped(local_copy, ckpt)
        return _over_ranks(_timed(lambda: dist_checkpointing.load(
            template, ckpt, sharded_strategy=FastPersistLoadStrategy(share_reads=loop.share_reads))))

    def read_bound(name: str, passes: int = 1) -> float:
        where = os.path.join(bound_dir, name)
        dropped(where)
        return _over_ranks(_timed(lambda: [bounds[name].load(template, where, loop.bench.write)
                                           for _ in range(passes)]))

    if _node_leader(loop):
        shutil.rmtree(bound_dir, ignore_errors=True)
        for name in bounds:
            os.makedirs(os.path.join(bound_dir, name))
    dist.barrier()
    for name, bound in bounds.items():
        bound.save(sd, os.path.join(bound_dir, name), loop.bench.write)
    dp = loop.bench.ranks // loop.bench.tp
    from_local: list[float] = []
    bound_s: dict[str, list[float]] = {name: [] for name in bounds}
    loaded_bound_s: list[float] = []  # the checksummed bound over the bytes each rank loads (DP > 1)
    for _ in range(loop.bench.reps):
        from_local.append(load())
        for name in bounds:
            bound_s[name].append(read_bound(name))
        if dp > 1:
            loaded_bound_s.append(read_bound(CHECKSUMMED_BOUND, dp))
    if _node_leader(loop):
        shutil.rmtree(bound_dir, ignore_errors=True)

    def from_persistent_tier() -> float:  # a load from an object store fetches into the local tier: gone again
        if _node_leader(loop):
            shutil.rmtree(local_copy, ignore_errors=True)
        dist.barrier()
        return load()

    from_persistent = [from_persistent_tier() for _ in range(loop.bench.reps)]
    loaded = sum(t.data.numel() * t.data.element_size() for t in template.values())
    return {"from_local_s": statistics.median(from_local), "from_persistent_s": statistics.median(from_persistent),
            "local_read_bound_s": statistics.median(bound_s[DEVICE_BOUND]),
            "local_checksummed_read_bound_s": statistics.median(bound_s[CHECKSUMMED_BOUND]),
            "local_checksummed_read_bound_dp": dp,
            "local_checksummed_read_bound_loaded_s": statistics.median(loaded_bound_s) if loaded_bound_s else None,
            "loaded_bytes_per_rank": _over_ranks(loaded), "bound_bytes_per_rank": _over_ranks(even_share(sd))}


def timed_sync_save(cp: _Checkpointer, sd: dict, root: str) -> float:
    """Seconds of a synchronous save of the same state by the same backend (the ratios' denominator)."""
    ckpt = f"{root}/sync"
    _prepare(ckpt)
    with cp.shims():
        start = time.perf_counter()
        cp.sync_save(sd, ckpt)
        seconds = time.perf_counter() - start
    if cp.tiered and not wait_durable(ckpt):  # its copy to the persistent tier, before anything else runs
        raise RuntimeError(f"bench-train: {ckpt} did not become durable")
    return seconds


def copy_floor_s(nbytes: int, device: torch.device, reps: int = 3) -> float:
    """Collective: seconds for every rank to copy ``nbytes`` from ``device`` into mapped shared memory at once.

    What our async call does at least (its copy into the reused snapshot
    buffer, page-locked for an accelerator, without describing, planning or
    megatron's own steps, by the same :func:`copy_to_host`): median of ``reps``
    copies, slowest rank. Source and destination pages are touched first.
    """
    source = torch.ones(nbytes, dtype=torch.uint8, device=device)
    buffer = SharedBuffer(nbytes, pinned=device.type != "cpu")
    times = []
    try:
        copy_to_host(buffer.tensor, source)
        for _ in range(reps):
            dist.barrier()
            start = time.perf_counter()
            copy_to_host(buffer.tensor, source)
            times.append(time.perf_counter() - start)
    finally:
        buffer.close()
    return _over_ranks(statistics.median(times))


def _fresh_root(rank: int, root: str) -> None:
    """An empty ``root`` (made by rank 0), once every rank is here."""
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
    dist.barrier()


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
    _enable_object_store(cfg)
    t = _trainer(rank, cfg)
    baseline = host_memory(include_writer=False)
    cp = CHECKPOINTERS[name](cfg)
    cp.start(t.sd)
    root = _root(cfg, cp, f"train-{name}-memory")
    run = run_loop(cp, t.sd, t.tensors, t.compute, cfg, root, baseline)
    _remove_run(cfg, cp, root)
    return int(_over_ranks(float(run.extra_bytes)))


def _rank_main(rank: int, world: int, cfg: LoopConfig,
               contenders: tuple[str, ...]) -> tuple[int, int, dict, Optional[CopyFloor]]:
    b = cfg.bench
    snapshot_bytes = 0  # this rank's data file in our synchronous save: its snapshot and their framing
    _join_node(rank, cfg)
    _enable_object_store(cfg)
    t = _trainer(rank, cfg)
    FastPersistSaveStrategy(config=b.write).load_ops()  # at start-up, as docs/async.md advises
    checkpointers = {name: CHECKPOINTERS[name](cfg) for name in contenders}
    runs: dict[str, list[LoopRun]] = {name: [] for name in contenders}
    for rep in range(b.reps):
        for name in balanced_order(contenders, rep):
            cp = checkpointers[name]
            if rep == 0:
                cp.start(t.sd)
            root = _root(cfg, cp, f"train-{name}-{rep}")
            run = run_loop(cp, t.sd, t.tensors, t.compute, cfg, root)
            if cp.checkpoints and cfg.save_steps:
                run.sync_s = timed_sync_save(cp, t.sd, root)
                if cp.uses_writer and not cp.tiered:
                    snapshot_bytes = _bytes_per_rank(os.path.join(root, "sync"))[rank]
                if cp.tiered and rep == b.reps - 1:
                    assert cfg.local_dir is not None
                    run.restart = restart_times(cfg, t.sd, f"{root}/sync", os.path.join(cfg.local_dir, "read-bound"))
            _remove_run(cfg, cp, root)
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


def _med(values: list[float]) -> Optional[float]:
    return statistics.median(values) if values else None


def report(cfg: LoopConfig, nbytes: int, runs: dict[str, list[LoopRun]], memory: dict[str, int],
           floor: Optional[CopyFloor] = None, matmuls: int = 0) -> dict:
    """Medians over repetitions of the slowest rank's figures, the slowdown against the plain loop,
    ``memory``: each contender's peak extra host memory per rank (bytes, largest rank), the copy
    floor of our calls, if one of ours ran, and the step's calibrated ``matmuls``."""
    reference = _med([r.loop_s for r in runs["none"]]) if "none" in runs else None
    rows = []
    for name, reps in runs.items():
        loop = _med([r.loop_s for r in reps])
        later = [c for r in reps for c in r.calls_s][1:]  # the first call of the process apart
        sync = _med([r.sync_s for r in reps if r.sync_s])
        row: dict[str, Any] = {"name": name, "what": WHAT[name], "loop_s": loop,
                               "loop_min_s": min(r.loop_s for r in reps),
                               "loop_max_s": max(r.loop_s for r in reps)}
        if reference and name != "none":
            saves = len(cfg.save_steps)
            overlapped = [o for r in reps for o in r.overlapped]
            row.update(
                slowdown_pct=100 * (loop / reference - 1), lost_per_save_s=(loop - reference) / max(saves, 1),
                first_call_s=reps[0].calls_s[0] if reps[0].calls_s else None, call_s=_med(later), sync_s=sync,
                durable_s=_med([d for r in reps for d in r.durable_s]), drain_s=_med([r.drain_s for r in reps]),
                extra_gib=memory[name] / GiB, saves=len(overlapped), overlapped=sum(overlapped),
                durable_alone_s=_med([d for r in reps for d, o in zip(r.durable_s, r.overlapped) if not o]),
            )
            if sync:
                row["first_call_pct"] = 100 * row["first_call_s"] / sync if row["first_call_s"] else None
                row["call_pct"] = 100 * row["call_s"] / sync if row["call_s"] is not None else None
                row["durable_x_sync"] = row["durable_s"] / sync if row["durable_s"] else None
                row["durable_alone_x_sync"] = row["durable_alone_s"] / sync if row["durable_alone_s"] else None
                if floor and name in floor.contenders:
                    row["copy_floor_pct"] = 100 * floor.seconds / sync
            persisted = [p for r in reps for p in r.persisted_s]
            if persisted:
                row.update(persisted_s=_med(persisted), restart=reps[-1].restart)
            row["replicated_s"] = _med([p for r in reps for p in r.replicated_s])
        rows.append(row)
    notes = [] if torch.cuda.is_available() else [SHIM_NOTE]
    store = cfg.persistent is not None and is_object_store(cfg.persistent)  # copied by the drain alone
    return {"ranks": cfg.bench.ranks, "nodes": cfg.nodes, "replicas": cfg.replicas, "tp": cfg.bench.tp, "bytes": nbytes, "steps": cfg.steps, "every": cfg.every,
            "local_dir": cfg.local_dir, "persistent": cfg.persistent,
            "drain_while_writing": cfg.drain_while_writing and not store,
            "write_through": cfg.write_through and not store, "share_reads": cfg.share_reads,
            "compute_ms": cfg.step_compute_ms, "matmuls_per_step": matmuls, "save_steps": cfg.save_steps,
            "reps": cfg.bench.reps, "directory": cfg.bench.directory,
            "filesystems": {path: describe_filesystem(path) for path in (cfg.bench.directory, cfg.local_dir) if path},
            "copy_floor_bytes": floor.nbytes if floor else None, "copy_floor_s": floor.seconds if floor else None,
            "rows": rows, "notes": notes}


def _f(value: Optional[float], fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _compute_words(rep: dict) -> str:
    if not rep["matmuls_per_step"]:
        return ""
    return f" plus {rep['matmuls_per_step']} matmuls (calibrated to {rep['compute_ms']:g} ms on the idle machine)"


def _where(rep: dict) -> str:
    """The benchmark's directory and the tiered contenders' local tier, each with what holds it."""
    fs = rep["filesystems"]
    local = f", local tier {rep['local_dir']} ({fs[rep['local_dir']]})" if rep["local_dir"] else ""
    return f"{rep['directory']} ({fs[rep['directory']]}){local}"


def _node_words(rep: dict) -> str:
    return f" on {rep['nodes']} nodes of this machine (replicas={rep['replicas']})" if rep["nodes"] > 1 else ""


def format_loop_table(rep: dict) -> str:
    """The report as a text table."""
    lines = [
        f"training loop: {rep['ranks']} ranks{_node_words(rep)}, TP={rep['tp']}, {rep['bytes'] / GiB:.2f} GiB state rewritten in place "
        f"every step{_compute_words(rep)}, {rep['steps']} steps, async checkpoints at steps {rep['save_steps']} "
        f"into {_where(rep)}; "
        f"median of {rep['reps']} (slowest rank); 'call' = the save call blocking the loop, first of the process "
        f"apart; 'sync' = a synchronous save of the same state by the same backend; 'durable' = call to commit, "
        f"seen by the next step's finalize (tiered: to the local commit, as its manifest records); 'overlap' = saves "
        f"called while an earlier one was still in flight (they "
        f"queue behind it), of all; 'alone/sync' = durable of the others",
        f"{'contender':<28}{'loop s':>16}{'slowdown':>10}{'lost/ckpt s':>12}{'1st call s':>11}{'call s':>8}"
        f"{'sync s':>8}{'call/sync':>10}{'durable s':>10}{'dur/sync':>9}{'overlap':>8}{'alone/sync':>11}"
        f"{'extra GiB/rank':>15}",
    ]
    for r in rep["rows"]:
        loop = f"{r['loop_s']:.2f} ({r['loop_min_s']:.2f}..{r['loop_max_s']:.2f})"
        if "slowdown_pct" not in r:
            lines.append(f"{r['name']:<28}{loop:>16}")
            continue
        lines.append(
            f"{r['name']:<28}{loop:>16}{_f(r['slowdown_pct'], '.1f') + '%':>10}{_f(r['lost_per_save_s'], '.2f'):>12}"
            f"{_f(r['first_call_s'], '.3f'):>11}{_f(r['call_s'], '.3f'):>8}{_f(r['sync_s'], '.2f'):>8}"
            f"{_f(r.get('call_pct'), '.0f') + '%':>10}{_f(r['durable_s'], '.2f'):>10}"
            f"{_f(r.get('durable_x_sync'), '.2f') + 'x':>9}{str(r['overlapped']) + '/' + str(r['saves']):>8}"
            f"{_f(r.get('durable_alone_x_sync'), '.2f') + 'x':>11}{_f(r['extra_gib'], '.2f'):>15}"
        )
    lines.extend(f"  {r['name']}: {r['what']}" for r in rep["rows"])
    direct = next((r for r in rep["rows"] if r["name"] == "fastpersist" and r.get("sync_s")), None)
    for r in rep["rows"]:
        if r.get("persisted_s") is None:
            continue
        versus = (f" ({r['persisted_s'] / direct['sync_s']:.2f}x fastpersist's synchronous save straight to "
                  f"{rep['directory']}, {direct['sync_s']:.2f} s)" if direct else "")
        replicas = (f", replicated (each node's files also on {rep['replicas']} other node) {r['replicated_s']:.2f} s "
                    f"after it" if r.get("replicated_s") is not None else "")
        lines.append(f"{r['name']}: local commit {r['durable_s']:.2f} s after the call{replicas}, durable on the "
                     f"persistent tier {r['persisted_s']:.2f} s after it (as its manifest records){versus}; the drain "
                     + _drain_said(rep))
        if r.get("restart"):
            s = r["restart"]
            lines.append(f"{r['name']}: restart (last repetition's synchronous save, page cache dropped, median of "
                         f"{rep['reps']} loads each, share_reads={rep['share_reads']}): from the local tier "
                         f"{s['from_local_s']:.2f} s, each rank "
                         f"loading {s['loaded_bytes_per_rank'] / GiB:.3f} GiB "
                         f"({s['local_read_bound_s'] / s['from_local_s']:.2f}x the local read bound, "
                         f"{s['local_read_bound_s']:.2f} s, which reads each rank's even share, "
                         f"{s['bound_bytes_per_rank'] / GiB:.3f} GiB; "
                         f"{s['local_checksummed_read_bound_s'] / s['from_local_s']:.2f}x the checksummed one, "
                         f"{s['local_checksummed_read_bound_s']:.2f} s{_loaded_bound_said(s)}), from the "
                         f"persistent tier {s['from_persistent_s']:.2f} s")
    if rep.get("copy_floor_s") is not None:
        shares = ", ".join(f"{r['name']} {r['copy_floor_pct']:.0f}%" for r in rep["rows"] if "copy_floor_pct" in r)
        lines.append(f"copy floor: {rep['copy_floor_s']:.3f} s for every rank to copy its snapshot's "
                     f"{rep['copy_floor_bytes'] / GiB:.3f} GiB into mapped shared memory at once (the least our call "
                     f"can block); of the sync save: {shares}")
    lines.extend(f"note: {n}" for n in rep["notes"])
    return "\n".join(lines)


def _loaded_bound_said(restart: dict) -> str:
    """The restart's ratio to the checksummed bound reading as many bytes as the load brings each rank (DP > 1)."""
    seconds = restart.get("local_checksummed_read_bound_loaded_s")
    if seconds is None:
        return ""
    dp = restart["local_checksummed_read_bound_dp"]
    return (f"; {seconds / restart['from_local_s']:.2f}x that one reading its share {dp} times over, "
            f"{seconds:.2f} s: the bytes each rank loads at DP={dp}")


def _drain_said(rep: dict) -> str:
    """How the report's tiered saves reached the persistent tier."""
    if rep.get("write_through"):
        return "took each file as the rank's writer wrote it through, beside the local write"
    return "followed the local write" if rep["drain_while_writing"] else "started once each file was written"


def run_checked(bench: BenchConfig, steps: int, every: int, contenders: Optional[str],
                compute_ms: Optional[float] = None, local_dir: Optional[str] = None,
                persistent: Optional[str] = None, drain_while_writing: bool = False, nodes: int = 1,
                write_through: bool = False, share_reads: str = "auto") -> Optional[dict]:
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
    try:
        check_copy_modes(drain_while_writing, write_through)
    except ValueError as e:
        print(f"bench-train: --drain-while-writing, --write-through: {e}", file=sys.stderr)
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
    return run(LoopConfig(bench, steps, every, compute_ms, local_dir, persistent, drain_while_writing, write_through,
                          nodes, share_reads), names,
               progress=lambda m: print(m, file=sys.stderr))
