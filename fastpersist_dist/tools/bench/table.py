"""``bench``'s report as text, and the figure formats every benchmark table shares.

The fixed-width table the command prints, and the cell formats that
``fastpersist-dist report`` also writes into the docs' markdown tables, so one
figure reads the same wherever it appears.
"""

from __future__ import annotations

from typing import Optional

from .runner import OPS, GiB


def spread(o: dict) -> str:
    """A summary's median with its range: ``0.53 (0.50..0.58)`` (seconds, as :func:`runner.summary` gives)."""
    return f"{o['median_s']:.2f} ({o['min_s']:.2f}..{o['max_s']:.2f})"


def or_dash(value: Optional[float], fmt: str) -> str:
    """``value`` formatted, or ``-`` where it was not measured."""
    return "-" if value is None else format(value, fmt)


def _cell(o: Optional[dict]) -> str:
    if o is None:
        return f"{'-':>21} {'':>6} {'':>7} {'':>8}"
    ratios = [f"{o[k]:.2f}x" if o.get(k) is not None else "" for k in ("x_device", "x_torch_dist")]
    return f" {o['median_s']:>7.2f} ({o['min_s']:.2f}..{o['max_s']:.2f})".rjust(21) + \
        f" {o['gib_s']:>6.2f} {ratios[0]:>7} {ratios[1]:>8}"


def format_table(rep: dict) -> str:
    """The report as a fixed-width text table, with bytes per rank and the async figures below it."""
    cfg = rep["config"]
    lines = [
        f"state: {rep['bytes'] / GiB:.2f} GiB (GPT hidden={rep['hidden']}, layers={rep['layers']}), "
        f"{cfg['ranks']} ranks, TP={cfg['tp']} x DP={cfg['ranks'] // cfg['tp']}, in {cfg['directory']} "
        f"({rep['filesystem']}), median of {cfg['reps']} "
        f"(min..max); saves fsynced; 'load' same sharding, 'reshard' TP splits moved to the other axis; "
        f"page cache {rep['load_cache']}; x dev = device bound time / time, x t_dist = torch_dist time / time; "
        f"CPU s/GiB = CPU seconds of a save (all ranks, threads, writer processes) per GiB",
        "".join([f"{'contender':<26}"] + [f" {op + ' s':>20} {'GiB/s':>6} {'x dev':>7} {'x t_dist':>8}" for op in OPS]
                + [f" {'CPU s/GiB':>9}"]),
    ]
    for r in rep["results"]:
        cpu = r.get("save", {}).get("cpu_s_per_gib")
        lines.append("".join([f"{r['name']:<26}"] + [_cell(r.get(op)) for op in OPS]
                             + [f" {cpu:>9.2f}" if cpu is not None else f" {'-':>9}"]))
    for r in rep["results"]:
        lines.append(f"  {r['name']}: {r['what']}")
        if "bytes_per_rank" in r:
            per_rank = r["bytes_per_rank"]
            mean = sum(per_rank) / len(per_rank)
            lines.append(f"    bytes written per rank: {', '.join(f'{b / GiB:.3f}' for b in per_rank)} GiB "
                         f"(max/mean {max(per_rank) / mean if mean else 1:.2f})")
        if "blocking" in r:
            b = r["blocking"]
            pct = f" = {b['pct_of_sync_save']:.0f}% of the synchronous save" if "pct_of_sync_save" in b else ""
            lines.append(
                f"    the save call blocked {b['median_s']:.3f} s ({b['min_s']:.3f}..{b['max_s']:.3f}){pct}; "
                f"durable after {r['save']['median_s']:.2f} s; extra host memory: one snapshot of each rank's "
                f"share, {rep['bytes'] / cfg['ranks'] / GiB:.2f} GiB per rank on average, reused across saves"
            )
    lines.extend(f"note: {n}" for n in rep["notes"])
    return "\n".join(lines)
