"""``bench-train``'s figures: what each repetition measured, the report over repetitions, and its text table."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ...storage.mounts import describe_filesystem
from .baselines import SHIM_NOTE
from .loop_checkpointers import WHAT, LoopConfig
from .runner import GiB
from .table import or_dash as _f


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
    restart: dict[str, float] = field(default_factory=dict)  # tiered, last repetition: restart_times' figures


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
    return {"ranks": cfg.bench.ranks, "nodes": cfg.nodes, "replicas": cfg.replicas, "tp": cfg.bench.tp, "bytes": nbytes, "steps": cfg.steps, "every": cfg.every,
            "local_dir": cfg.local_dir, "persistent": cfg.persistent,
            "share_reads": cfg.share_reads,
            "compute_ms": cfg.step_compute_ms, "matmuls_per_step": matmuls, "save_steps": cfg.save_steps,
            "reps": cfg.bench.reps, "directory": cfg.bench.directory,
            "filesystems": {path: describe_filesystem(path) for path in (cfg.bench.directory, cfg.local_dir) if path},
            "copy_floor_bytes": floor.nbytes if floor else None, "copy_floor_s": floor.seconds if floor else None,
            "rows": rows, "notes": notes}


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
                     "copied each file after the local commit")
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

