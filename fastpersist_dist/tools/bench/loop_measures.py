"""What ``bench-train`` sets the loop's figures against, measured beside it on the same ranks.

A rank's extra host memory (its processes' memory above what it held before any
checkpoint); a synchronous save of the same state by the same backend; the copy
floor of our call (every rank copying its snapshot's bytes into mapped shared
memory at once); and, for a tiered contender, a restart: its last repetition's
synchronous save loaded from the local tier, then, its local copy removed,
from the persistent tier, beside the local tier's read bounds (the device
bound's reads of each rank's even share of the state, plain and with every
byte hashed as a load must), medians of as many loads as repetitions. A rank
that holds replicas (data parallelism) loads more than its even share: the
report gives both sizes.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing

from ...engine.tiers.state import wait_durable
from ...engine.writer_process import writer_client
from ...format.tiers import local_copy_dir
from ...storage.host_copy import copy_to_host
from ...storage.persistent import is_object_store
from ...storage.shared_memory import SharedBuffer
from ...strategies.fastpersist_load import FastPersistLoadStrategy
from .baselines import CHECKSUMMED_BOUND, CONTENDERS, DEVICE_BOUND, even_share
from .loop_checkpointers import Checkpointer, LoopConfig
from .loop_places import node_leader, prepare_checkpoint
from .runner import _blank, _over_ranks, _timed, drop_page_cache


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
        if node_leader(loop):
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

    if node_leader(loop):
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
    if node_leader(loop):
        shutil.rmtree(bound_dir, ignore_errors=True)

    def from_persistent_tier() -> float:  # a load from an object store fetches into the local tier: gone again
        if node_leader(loop):
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


def timed_sync_save(cp: Checkpointer, sd: dict, root: str) -> float:
    """Seconds of a synchronous save of the same state by the same backend (the ratios' denominator)."""
    ckpt = f"{root}/sync"
    prepare_checkpoint(ckpt)
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
