"""What a checkpoint directory holds, read from its metadata and index alone.

Unlike ``verify`` this reads no tensor bytes, so it answers at once even for a
huge checkpoint: which backend wrote it, whether it was committed, every tensor
(dtype, global shape, shards, records, bytes), the bytes of each rank's data
file and whether the small files committed beside the index (``common.pt``) are
still the committed ones. No ``torch.distributed`` is needed.

For a tiered checkpoint (saved with ``local_dir``) it also shows the tiers:
its state (``local``, ``replicated``, ``durable``), its nodes and replicas,
how many data files reached the persistent tier, and whether this machine's
local tier holds a copy of it. A tiered checkpoint on an object store
(``msc://``) shows its tiers only.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from megatron.core.dist_checkpointing.core import maybe_load_config

from ..engine.index_reader import check_markers, read_unchecked_index
from ..engine.tiers.state import drained_files, failed_copies, pending_dir, read_manifest
from ..format.index_pages import PART_FILE_RE
from ..format.kinds import BACKENDS, BY_CONTAINER, DCP_METADATA_FILE, MEGATRON_CONFIG_FILE
from ..format.records import (
    COMMON_FILE,
    COMMON_STATE_KEY,
    INDEX_FILE,
    STATUS_FILE_RE,
    CheckpointIndex,
    ShardRecord,
    aux_copy_name,
    is_data_file,
)
from ..format.tiers import DURABLE, PENDING_DIR, STATES, TIERS_FILE, TierManifest, local_copy_dir
from ..storage.files import file_digest
from ..storage.persistent import PosixDir, is_object_store, persistent_dir
from ..util.errors import FastPersistError, IncompleteCheckpointError
from ..util.wording import counted
from .dcp_files import NO_CHECKSUMS, dcp_files

WHO = "inspect"
NOT_COMMITTED = "NOT committed (incomplete checkpoint)"
# InspectReport.index: what became of reading fastpersist_index.json.
INDEX_COMMITTED, INDEX_MISSING, INDEX_INVALID = "committed", "missing", "invalid"
INDEX_PENDING = "pending"  # a tiered checkpoint not durable yet: committed on the local tiers, its index in PENDING_DIR
INDEX_NONE, DCP_OTHER = "none", "torch DCP"  # DCP's files of another writer: committed by its .metadata, no index


@dataclass(frozen=True)
class EntrySummary:
    """One global tensor (or sharded object) as the index stores it."""

    key: str
    kind: str
    dtype: Optional[str]
    global_shape: tuple[int, ...]
    shards: int
    records: int
    bytes: int


@dataclass(frozen=True)
class AuxFileSummary:
    """A file committed beside the index (``common.pt``, its copy): what the index says and what is there."""

    name: str
    xxh3: str  # committed
    bytes: Optional[int]  # present now; None if missing
    intact: bool  # present with the committed XXH3


@dataclass(frozen=True)
class TierSummary:
    """A tiered checkpoint as its persistent home records it, and this machine's local copy of it."""

    state: str
    checkpoint_id: str
    persistent: bool  # False: a local checkpoint only
    local_dir: str
    nodes: list[list[int]]  # node -> its ranks
    replica_nodes: list[list[int]]  # node -> the nodes holding replicas of its files
    data_files: int
    drained: int  # data files copied to the persistent tier and checked
    failed: dict[str, str]  # data file -> why its copy to the persistent tier failed for good
    local_copy: str  # where this machine's local tier keeps the checkpoint
    local_copy_state: str  # "this checkpoint", "none", or what else is there
    created: float  # unix time of the local commit
    after_local_s: dict[str, float]  # each later state reached -> seconds after the local commit


@dataclass
class InspectReport:
    """Everything ``inspect`` shows; ``problems`` is empty for a committed, loadable checkpoint."""

    directory: str
    backend: Optional[str] = None
    backend_version: Optional[int] = None
    format: Optional[str] = None  # checkpoint format named by the committed index
    index: str = INDEX_MISSING
    world_size: Optional[int] = None
    checksum_block_bytes: Optional[int] = None
    entries: list[EntrySummary] = field(default_factory=list)
    files: dict[str, int] = field(default_factory=dict)
    aux_files: list[AuxFileSummary] = field(default_factory=list)
    present_files: dict[str, int] = field(default_factory=dict)
    tiers: Optional[TierSummary] = None
    problems: list[str] = field(default_factory=list)

    @property
    def committed(self) -> bool:
        """True when the index is present and valid: the save finished (on the local tiers, for a tiered one)."""
        return self.index in (INDEX_COMMITTED, INDEX_PENDING, INDEX_NONE)

    @property
    def ok(self) -> bool:
        """True when the checkpoint is committed and nothing looks wrong."""
        return self.committed and not self.problems

    def to_json(self) -> dict[str, Any]:
        """The report as plain JSON types (what ``inspect --json`` prints)."""
        return {**asdict(self), "committed": self.committed, "ok": self.ok}


def inspect_checkpoint(checkpoint_dir: str) -> InspectReport:
    """Summarize ``checkpoint_dir``; raises FastPersistError only if it is not a readable directory (or, on an
    object store, not a tiered checkpoint)."""
    if is_object_store(checkpoint_dir):
        return _inspect_object_store(checkpoint_dir)
    if not os.path.isdir(checkpoint_dir):
        raise FastPersistError(f"{checkpoint_dir} is not a directory")
    try:
        names = os.listdir(checkpoint_dir)
    except OSError as e:
        raise FastPersistError(f"cannot list {checkpoint_dir}: {e}") from None
    report = InspectReport(checkpoint_dir, present_files=_our_files(checkpoint_dir, names))
    index_dir = checkpoint_dir
    try:
        report.tiers = tier_summary(checkpoint_dir)
    except FastPersistError as e:
        report.problems.append(str(e))
    if report.tiers is not None and report.tiers.state != DURABLE:
        index_dir = os.path.join(checkpoint_dir, PENDING_DIR)
    try:
        index = read_unchecked_index(index_dir, WHO)
    except IncompleteCheckpointError:
        foreign = dcp_files(checkpoint_dir)
        if foreign is not None:
            report.index, report.format, report.files = INDEX_NONE, DCP_OTHER, foreign.files
            report.entries = [EntrySummary(e.key, e.kind, e.dtype, e.global_shape, e.chunks, e.chunks, e.bytes)
                              for e in foreign.entries]
            report.problems.extend(foreign.problems)
            return report
        _read_metadata(report, True)
        report.problems.append(f"{checkpoint_dir}: {NOT_COMMITTED}: it has no {INDEX_FILE}")
        return report
    except FastPersistError as e:
        _read_metadata(report, True)
        report.index = INDEX_INVALID
        report.problems.append(str(e))
        return report
    _read_metadata(report, megatron_made(index))
    report.index = INDEX_COMMITTED if index_dir == checkpoint_dir else INDEX_PENDING
    report.format = BY_CONTAINER[index.container].name
    report.problems.extend(format_problems(report.backend, index))
    report.world_size = index.world_size
    report.checksum_block_bytes = index.checksum_block_bytes
    report.files = dict(sorted(index.files.items()))
    report.entries = _entries(index, report.problems)
    report.aux_files = [_aux_summary(checkpoint_dir, name, want) for name, want in sorted(index.aux_files.items())]
    if report.index == INDEX_PENDING:  # its data files are on the local tiers; the aux files were checked above
        report.problems.extend(f"{checkpoint_dir}/{a.name}: {_aux_state(a)}" for a in report.aux_files if not a.intact)
        return report
    try:
        check_markers(checkpoint_dir, index, WHO)
    except FastPersistError as e:  # the index is committed, but a file beside it is not the committed one
        report.problems.append(str(e))
    return report


def tier_summary(checkpoint_dir: str) -> Optional[TierSummary]:
    """The tiers of ``checkpoint_dir`` (a persistent home or a node's local copy); None where it is not tiered."""
    home = persistent_dir(checkpoint_dir)
    manifest = read_manifest(home)
    if manifest is None:
        return None
    if home.url.rstrip("/") != manifest.checkpoint_dir.rstrip("/"):  # a node's local copy: ask its home too
        try:
            manifest = read_manifest(persistent_dir(manifest.checkpoint_dir)) or manifest
        except FastPersistError:
            pass  # the home is unreachable from here: the local copy's own record stands
    local = local_copy_dir(manifest.local_dir, manifest.checkpoint_dir)
    home = persistent_dir(manifest.checkpoint_dir)
    names = set() if manifest.state == DURABLE or not manifest.persistent else set(home.names())
    drained = len(manifest.files) if manifest.state == DURABLE else len(drained_files(home, manifest, names))
    return TierSummary(
        state=manifest.state, checkpoint_id=manifest.checkpoint_id, persistent=manifest.persistent,
        local_dir=manifest.local_dir, nodes=[list(n) for n in manifest.nodes],
        replica_nodes=[list(r) for r in manifest.replica_nodes], data_files=len(manifest.files), drained=drained,
        failed=failed_copies(home, manifest, names),
        local_copy=local, local_copy_state=_local_copy_state(local, manifest), created=manifest.created,
        after_local_s={s: manifest.reached[s] - manifest.created for s in STATES if s in manifest.reached})


def _local_copy_state(local: str, manifest: TierManifest) -> str:
    try:
        there = read_manifest(PosixDir(local)) if os.path.isdir(local) else None
    except FastPersistError as e:
        return f"damaged ({e})"
    if there is None:
        return "none"
    if there.checkpoint_id != manifest.checkpoint_id:
        return f"another checkpoint (id {there.checkpoint_id}): not used"
    files = sorted(f for f in manifest.files if os.path.exists(os.path.join(local, f)))
    return f"this checkpoint: {counted(len(files), 'data file')} ({', '.join(files)})"


def _inspect_object_store(checkpoint_dir: str) -> InspectReport:
    report = InspectReport(checkpoint_dir)
    report.tiers = tier_summary(checkpoint_dir)
    if report.tiers is None:
        raise FastPersistError(f"{checkpoint_dir} has no {TIERS_FILE}: on an object store inspect reads tiered "
                               "checkpoints only")
    durable = report.tiers.state == DURABLE
    home = persistent_dir(checkpoint_dir)
    names = (home if durable else pending_dir(home)).names()
    report.index = (INDEX_COMMITTED if durable else INDEX_PENDING) if INDEX_FILE in names else INDEX_MISSING
    if not report.committed:
        report.problems.append(f"{checkpoint_dir}: {NOT_COMMITTED}: it has no {INDEX_FILE}")
    return report


def _aux_summary(checkpoint_dir: str, name: str, want: str) -> AuxFileSummary:
    path = os.path.join(checkpoint_dir, name)
    try:
        found = file_digest(path, WHO)
    except FastPersistError:
        found = None  # unreadable: check_markers reports it
    size = os.path.getsize(path) if found is not None else None
    return AuxFileSummary(name=name, xxh3=want, bytes=size, intact=found == want)


def _our_files(checkpoint_dir: str, names: list[str]) -> dict[str, int]:
    """Sizes of the data, status, index and common-state files present, whatever the index says (it may be missing)."""
    ours = {}
    for name in sorted(names):
        if (is_data_file(name) or STATUS_FILE_RE.match(name) or name.startswith(INDEX_FILE) or PART_FILE_RE.match(name)
                or name in (DCP_METADATA_FILE, COMMON_FILE, aux_copy_name(COMMON_FILE))):
            try:
                ours[name] = os.path.getsize(os.path.join(checkpoint_dir, name))
            except OSError:
                continue  # removed while we looked
    return ours


def megatron_made(index: CheckpointIndex) -> bool:
    """Whether megatron-core's ``save()`` made ``index``'s checkpoint: it holds megatron's common state
    (``common.pt`` beside it, or 0.19's ``common_state`` object), which a torch DCP checkpoint written by
    ``FastPersistWriter`` has not. megatron's ``load()`` needs its ``metadata.json``; DCP's does not."""
    return COMMON_FILE in index.aux_files or any(r.key == COMMON_STATE_KEY for r in index.records)


def metadata_backend(checkpoint_dir: str, required: bool = True) -> tuple[Optional[str], Optional[int], list[str]]:
    """Backend, version and problems of megatron's metadata.json, read by megatron's own reader (its absence a
    problem where ``required``)."""
    path = os.path.join(checkpoint_dir, MEGATRON_CONFIG_FILE)
    try:
        config = maybe_load_config(checkpoint_dir)
    except (OSError, ValueError, TypeError) as e:
        return None, None, [f"{path} is unreadable: {e}"]
    if config is None:
        return None, None, [f"{path} is missing: dist_checkpointing.load will refuse this directory"] * required
    found = (config.sharded_backend, config.sharded_backend_version)
    if found not in BACKENDS:
        return (*found, [f"{path} names backend {found[0]} version {found[1]}, "
                         f"none of {BACKENDS}: this is not a FastPersist checkpoint"])
    return (*found, [])


def format_problems(backend: Optional[str], index: CheckpointIndex) -> list[str]:
    """metadata.json must name the backend of the format the index commits (megatron picks the loader by it)."""
    fmt = BY_CONTAINER[index.container]
    if backend is None or backend == fmt.backend:
        return []
    return [f"metadata.json names backend {backend} but {INDEX_FILE} commits a {fmt.name} checkpoint "
            f"(backend {fmt.backend}): megatron would pick the wrong loader (megatron-core 0.17+'s "
            "FullyParallelSaveStrategyWrapper writes torch_dist whatever it wraps; wrap ours in "
            "fastpersist_dist.FullyParallelSaveWrapper; FastPersistLoadStrategy still reads this checkpoint)"]


def _read_metadata(report: InspectReport, required: bool) -> None:
    report.backend, report.backend_version, problems = metadata_backend(report.directory, required)
    report.problems[:0] = problems


def _entries(index: CheckpointIndex, problems: list[str]) -> list[EntrySummary]:
    """One summary per key; records of one key that disagree on dtype or shape are a problem."""
    groups: dict[str, list[ShardRecord]] = {}
    for r in index.records:
        groups.setdefault(r.key, []).append(r)
    entries = []
    for key, group in sorted(groups.items()):
        first = group[0]
        for what in ("kind", "dtype", "global_shape"):
            values = {getattr(r, what) for r in group}
            if len(values) > 1:
                problems.append(f"records of '{key}' disagree on {what}: {sorted(map(str, values))}")
        entries.append(EntrySummary(
            key=key, kind=first.kind, dtype=first.dtype, global_shape=first.global_shape,
            # Flattened-range records are pieces of one shard: a shard is its box, a record each piece.
            shards=len({(r.global_offset, r.local_shape) for r in group}),
            records=len(group), bytes=sum(r.length for r in group),
        ))
    return entries


def _size(nbytes: int) -> str:
    """Bytes exactly, plus a readable unit once they reach a KiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes} bytes ({nbytes / scale:.2f} {unit})"
    return f"{nbytes} bytes"


def _aux_state(aux: AuxFileSummary) -> str:
    if aux.intact:
        return f"{_size(aux.bytes or 0)}, XXH3 {aux.xxh3}: intact"
    if aux.bytes is None:
        return f"MISSING (committed with XXH3 {aux.xxh3})"
    return f"{_size(aux.bytes)}: NOT the committed file (XXH3 {aux.xxh3})"


def _tier_lines(t: TierSummary) -> list[str]:
    """The tiers section of the text report."""
    meaning = {"local": "each node's part on its own local tier", "replicated": "each node's part also on "
               "its replica nodes", DURABLE: "committed on the persistent tier"}[t.state]
    where = (f"{t.drained} of {t.data_files} data files on the persistent tier" if t.persistent
             else "a local checkpoint only (persistent=False)")
    lines = [f"tiers: {t.state} ({meaning}); checkpoint id {t.checkpoint_id}; {where}",
             f"  local tier: {t.local_dir} on each of {counted(len(t.nodes), 'node')}",
             f"  local commit: {time.strftime('%Y-%m-%d %H:%M:%S %Z', time.localtime(t.created))}"
             + "".join(f"; {state} {after:.2f} s later" for state, after in t.after_local_s.items())]
    for node, ranks in enumerate(t.nodes):
        replicas = f"; replicas on nodes {', '.join(map(str, t.replica_nodes[node]))}" if t.replica_nodes else ""
        lines.append(f"  node {node}: ranks {', '.join(map(str, ranks))}{replicas}")
    lines.append(f"  this machine's copy: {t.local_copy}: {t.local_copy_state}")
    lines.extend(f"  copy of {name} to the persistent tier FAILED (the checkpoint stays in the local tiers): {why}"
                 for name, why in t.failed.items())
    return lines


def format_report(report: InspectReport) -> str:
    """The report as text for a terminal."""
    backend = "unknown" if report.backend is None else f"{report.backend} version {report.backend_version}"
    lines = [f"checkpoint: {report.directory}", f"backend: {backend} (metadata.json)"]
    if report.tiers is not None:
        lines.extend(_tier_lines(report.tiers))
    if not report.committed:
        state = NOT_COMMITTED if report.index == INDEX_MISSING else "INVALID or unreadable (see PROBLEM)"
        lines.append(f"index: {state}")
        lines.append("files present:" if report.present_files else "files present: none of ours")
        lines.extend(f"  {name}  {_size(size)}" for name, size in report.present_files.items())
    elif report.format is None:  # a tiered checkpoint on an object store: its tiers only
        lines.append(f"index: {'committed' if report.index == INDEX_COMMITTED else 'committed on the local tiers'}")
    else:
        files = ("torch DCP files (.metadata, __<rank>_0.distcp)" if report.format == "torch_dist"
                 else "FastPersist data files")
        if report.index == INDEX_NONE:
            lines.append(f"format: {NO_CHECKSUMS}")
        else:
            lines.append(f"format: {report.format}: {files}, checksums in {INDEX_FILE}")
            where = "committed" if report.index == INDEX_COMMITTED else f"committed on the local tiers ({PENDING_DIR})"
            lines.append(f"index: {where}; written by {report.world_size} ranks; checksums per "
                         f"{_size(report.checksum_block_bytes or 0)}")
        tensors = [e for e in report.entries if e.kind == "tensor"]
        objects = [e for e in report.entries if e.kind != "tensor"]
        records = sum(e.records for e in report.entries)
        lines.append(f"{counted(len(tensors), 'tensor')}, {counted(len(objects), 'object')}, {counted(records, 'record')}:")
        rows = [("key", "kind", "dtype", "global shape", "shards", "records", "bytes")] + [
            (e.key, e.kind, e.dtype or "-", str(e.global_shape), str(e.shards), str(e.records), str(e.bytes))
            for e in report.entries
        ]
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        for row in rows:
            cells = [c.ljust(w) if i < 4 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))]
            lines.append("  " + "  ".join(cells).rstrip())
        lines.append(f"data files ({len(report.files)}, {_size(sum(report.files.values()))}):")
        width = max(map(len, report.files), default=0)
        lines.extend(f"  {name.ljust(width)}  {_size(size)}" for name, size in report.files.items())
        if report.aux_files:
            lines.append(f"committed beside the index ({len(report.aux_files)}):")
            width = max(len(a.name) for a in report.aux_files)
            lines.extend(f"  {a.name.ljust(width)}  {_aux_state(a)}" for a in report.aux_files)
    lines.extend(f"PROBLEM: {p}" for p in report.problems)
    return "\n".join(lines)
