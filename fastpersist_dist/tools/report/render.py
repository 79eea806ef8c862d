"""The docs' benchmark tables, rendered from a report's JSON.

Pure: no I/O, no clock, so the same JSON always gives the same markdown and a
saved report re-renders the docs exactly (``fastpersist-dist report
--from-json``). Each block starts with a stamp line saying where and with what
its figures were measured, all of it read from the JSON.

The tables' rows are declared here, once: which contenders each table shows,
in which order and under which label. The measurement runs what they need
(:func:`bench_contenders`, ``LOOP_CONTENDERS``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from ..bench.runner import GiB
from ..bench.table import or_dash, spread

BENCH, BENCH_DETAIL, BENCH_TRAIN = "bench", "bench-detail", "bench-train"
BLOCKS = (BENCH, BENCH_DETAIL, BENCH_TRAIN)
WHERE = ("disk", "shm")  # the benchmark directories' roles, in table order: the disk, then memory

# bench-detail (docs/performance.md): every save path at 1 and 2 ranks, contender -> label, in table order
DETAIL_ROWS = {
    "device_bound": "device bound",
    "device_bound_checksummed": "device bound, checksummed",
    "fastpersist": "FastPersist, native",
    "fastpersist_async": "FastPersist async, until durable",
    "fastpersist_dcp": "FastPersist, torch_dist format",
    "fastpersist_dcp_writer": "FastPersist through torch DCP",
    "torch_dist": "megatron torch_dist",
    "dcp_filesystem": "torch DCP FileSystemWriter",
    "dcp_async": "torch DCP async_save (process), until written",
    "torch_save": "torch.save + fsync",
    "fastpersist_unshared": "FastPersist, loads unshared",
}
TWO_RANKS_ONLY = ("fastpersist_unshared",)  # its loads differ from fastpersist's only where ranks share reads
DETAIL_RANKS = (1, 2)
# bench (README.md): the main contenders at 2 ranks, from the same runs as bench-detail's
BENCH_ROWS = {
    "device_bound": "device bound (O_DIRECT aio, no copy, no checksum)",
    "fastpersist": "FastPersist, native format",
    "fastpersist_dcp": "FastPersist, torch_dist format",
    "fastpersist_dcp_writer": "FastPersist through torch DCP (`FastPersistWriter`)",
    "torch_dist": "megatron torch_dist",
    "dcp_filesystem": "torch DCP `FileSystemWriter`",
    "dcp_async": "torch DCP `async_save` (process kind), until written",
    "torch_save": "torch.save + fsync",
}
BENCH_RANKS = 2
# bench-train (README.md): 2 ranks at TP=1; the reference loop ('none') is in the stamp, not a row.
# {local}: where the local tier is (the memory directory's mount point).
LOOP_ROWS = {
    "torch_dist": "megatron torch_dist async, straight to the disk",
    "fastpersist_megatron_queue": "ours on megatron's `AsyncCallsQueue`, straight to the disk",
    "fastpersist": "ours, straight to the disk",
    "fastpersist_tiered": "ours tiered: `{local}`, then the disk",
}
LOOP_CONTENDERS = ("none", *LOOP_ROWS)
LOOP_RANKS, LOOP_TP, LOOP_STEPS, LOOP_EVERY = 2, 1, 30, 10


def bench_contenders(ranks: int) -> tuple[str, ...]:
    """The contenders a ``bench`` run at ``ranks`` ranks needs for the tables, in table order."""
    return tuple(name for name in DETAIL_ROWS if ranks > 1 or name not in TWO_RANKS_ONLY)


def _where_label(result: dict[str, Any], where: str) -> str:
    """A directory role as the tables name it: ``disk``, and memory by its mount point (``/dev/shm``)."""
    if where == "disk":
        return "disk"
    place = result["stamp"]["storage"][where]
    return place.get("mount") or place["path"]


def _commit_words(found: Optional[dict[str, Any]]) -> str:
    if found is None:
        return "outside a git checkout"
    return f"commit {found['sha'][:7]}" + (" with uncommitted changes" if found["dirty"] else "")


def _machine_words(m: dict[str, Any]) -> str:
    memory = f", {m['memory_bytes'] / GiB:.1f} GiB memory" if m.get("memory_bytes") else ""
    gpus = ", ".join(m["gpus"]) if m.get("gpus") else "no GPU"
    usable = f" ({m['usable_cores']} usable)" if m.get("usable_cores") not in (None, m["cores"]) else ""
    return f"{m['hostname']}: {m['cpu_model']}, {m['cores']} cores{usable}{memory}, {gpus}"


def _storage_words(result: dict[str, Any]) -> str:
    """Each benchmark directory with what holds it: ``disk /work/fpb (ext4 at /, /dev/vda)``."""
    said = []
    for where, role in zip(WHERE, ("disk", "memory")):
        place = result["stamp"]["storage"].get(where)
        if place:
            device = place.get("device")
            on = f", {device}" if device and device != place.get("type") else ""
            said.append(f"{role} {place['path']} ({place['filesystem']}{on})")
    return "; ".join(said)


def _version_words(v: dict[str, Optional[str]]) -> str:
    names = (("python", "Python"), ("torch", "torch"), ("megatron_core", "megatron-core"), ("deepspeed", "DeepSpeed"))
    return ", ".join(f"{label} {v.get(key) or 'not installed'}" for key, label in names)


def stamp_line(result: dict[str, Any], what: str) -> str:
    """Where, when and with what the figures were measured (``what``: the block's own run), from the JSON."""
    s = result["stamp"]
    date = s["date"].replace("T", " ").removesuffix("Z")[:16] + " UTC"
    return (f"Measured by `fastpersist-dist report` on {date}, {_commit_words(s['commit'])}; "
            f"{_machine_words(s['machine'])}; {_storage_words(result)}; {_version_words(s['versions'])}. {what}.")


def _table(header: list[str], rows: list[list[str]]) -> str:
    def line(cells: list[str]) -> str:
        return "|" + "|".join(f" {cell} " if cell else " " for cell in cells) + "|"

    return "\n".join([line(header), "|" + "---|" * len(header)] + [line(row) for row in rows])


def _runs(result: dict[str, Any]) -> dict[tuple[str, int], dict[str, Any]]:
    """The bench reports by (directory role, ranks)."""
    return {(run["where"], run["report"]["config"]["ranks"]): run["report"] for run in result.get("bench", [])}


def _state_words(rep: dict[str, Any]) -> str:
    cfg = rep["config"]
    ranks = f"{cfg['ranks']} rank" + ("s" if cfg["ranks"] > 1 else "")
    return f"{ranks} (TP={cfg['tp']}), {rep['bytes'] / GiB:.2f} GiB"


def _ratio(o: Optional[dict[str, Any]], suffix: str = "x") -> str:
    return "-" if o is None or o.get("x_device") is None else f"{o['x_device']:.2f}{suffix}"


def _cpu(row: dict[str, Any]) -> str:
    return or_dash(row.get("save", {}).get("cpu_s_per_gib"), ".2f")


def _with_ratio(o: Optional[dict[str, Any]]) -> str:
    """``1.02 (1.00x)``: a median and its ratio to the device bound."""
    return "-" if o is None else f"{o['median_s']:.2f} ({_ratio(o)})"


def _rows(rep: dict[str, Any], labels: dict[str, str], cells: Callable[[dict[str, Any]], list[str]],
          first: str) -> list[list[str]]:
    by_name = {row["name"]: row for row in rep["results"]}
    return [[first, label, *cells(by_name[name])] for name, label in labels.items() if name in by_name]


def render_bench(result: dict[str, Any]) -> Optional[str]:
    """README's save/load table: the main contenders at 2 ranks, on the disk and in memory."""
    runs = _runs(result)
    reps = [(where, runs[(where, BENCH_RANKS)]) for where in WHERE if (where, BENCH_RANKS) in runs]
    if not reps:
        return None
    rows = [row for where, rep in reps for row in _rows(
        rep, BENCH_ROWS, lambda r: [spread(r["save"]), _ratio(r["save"]), spread(r["load"]) if "load" in r else "-",
                                    _ratio(r.get("load")), _cpu(r)], _where_label(result, where))]
    rep = reps[0][1]
    what = (f"{_state_words(rep)} GPT-shaped state; saves fsynced, page cache dropped before loads, values "
            f"checked; median of {rep['config']['reps']} (min..max)")
    header = ["where", "contender", "save s", "x device", "load s", "x device", "CPU s/GiB of a save"]
    return stamp_line(result, what) + "\n\n" + _table(header, rows)


def render_detail(result: dict[str, Any]) -> Optional[str]:
    """docs/performance.md's table of every save path, 1 and 2 ranks, on the disk and in memory."""
    runs = _runs(result)
    found = [(where, ranks, runs[(where, ranks)]) for where in WHERE for ranks in DETAIL_RANKS if (where, ranks) in runs]
    if not found:
        return None
    rows = [row for where, ranks, rep in found for row in _rows(
        rep, DETAIL_ROWS, lambda r: [spread(r["save"]), _ratio(r["save"], ""), _cpu(r), _with_ratio(r.get("load")),
                                     _with_ratio(r.get("reshard"))], f"{_where_label(result, where)}, {ranks}")]
    states = {ranks: _state_words(rep) for _, ranks, rep in found}
    what = (f"{'; '.join(states[r] for r in sorted(states))}; median of {found[0][2]['config']['reps']} "
            f"(min..max), one run per rank count and directory")
    header = ["where, ranks", "contender", "save s", "x device", "CPU s/GiB", "load s (x device)",
              "reshard s (x device)"]
    return stamp_line(result, what) + "\n\n" + _table(header, rows)


def _unit(value: Optional[float], fmt: str, unit: str) -> str:
    """``value`` formatted with its unit, or ``-`` where it was not measured."""
    return "-" if value is None else format(value, fmt) + unit


def _loop_cells(row: dict[str, Any]) -> list[str]:
    tiered = row.get("persisted_s") is not None
    restart = row.get("restart") or {}
    return [
        _unit(row.get("slowdown_pct"), ".1f", " %"), _unit(row.get("lost_per_save_s"), ".2f", " s"),
        _unit(row.get("call_s"), ".3f", " s"), _unit(row.get("durable_s"), ".2f", " s") if tiered else "-",
        _unit(row.get("persisted_s") if tiered else row.get("durable_s"), ".2f", " s"),
        _unit(row.get("extra_gib"), ".2f", " GiB"),
        f"{restart['from_local_s']:.2f} s / {restart['from_persistent_s']:.2f} s" if restart else "-",
    ]


def render_train(result: dict[str, Any]) -> Optional[str]:
    """README's training-loop table: the loop's slowdown and each checkpoint's times, per contender."""
    rep = result.get("bench_train")
    if rep is None:
        return None
    local = _where_label(result, "shm")
    by_name = {row["name"]: row for row in rep["rows"]}
    rows = [[label.format(local=local), *_loop_cells(by_name[name])] for name, label in LOOP_ROWS.items()
            if name in by_name]
    reference = by_name.get("none")
    alone = (f"; the loop alone {reference['loop_s']:.2f} s ({reference['loop_min_s']:.2f}.."
             f"{reference['loop_max_s']:.2f})" if reference else "")
    what = (f"{rep['ranks']} ranks (TP={rep['tp']} x DP={rep['ranks'] // rep['tp']}) rewrite a "
            f"{rep['bytes'] / GiB:.2f} GiB GPT-shaped state in place every step, {rep['steps']} steps, async "
            f"checkpoints at steps {', '.join(map(str, rep['save_steps']))}, median of {rep['reps']} "
            f"repetition{'s' if rep['reps'] != 1 else ''} (slowest rank){alone}")
    header = ["", "loop slowdown", "lost per checkpoint", "call", "to local commit", "to durable",
              "extra host memory per rank", "restart from local / persistent"]
    return stamp_line(result, what) + "\n\n" + _table(header, rows)


RENDERERS: dict[str, Callable[[dict[str, Any]], Optional[str]]] = {
    BENCH: render_bench, BENCH_DETAIL: render_detail, BENCH_TRAIN: render_train}


def render(result: dict[str, Any]) -> dict[str, str]:
    """Each block's markdown (a stamp line, a blank line, the table) for the blocks ``result`` has figures for."""
    rendered = {name: renderer(result) for name, renderer in RENDERERS.items()}
    return {name: text for name, text in rendered.items() if text is not None}
