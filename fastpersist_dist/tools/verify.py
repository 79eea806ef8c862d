"""Standalone integrity check of a checkpoint directory, without torch.distributed.

Checks, and reports every problem found rather than the first: megatron's
``metadata.json`` names our backend; the index is committed, intact and valid;
every data file exists with the size the index gives; every byte of every
record matches its block checksums; every global tensor is covered exactly once
and no object shard appears twice. Of a torch DCP checkpoint of another writer
(no index of ours), only that each file holds the bytes its ``.metadata`` places
there (``dcp_files.py``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..engine.index_reader import check_markers, read_page_bytes, read_top
from ..format.coverage import coverage_errors
from ..format.index_pages import PagedIndex
from ..format.records import KIND_TENSOR, CheckpointIndex
from ..storage.reader import ShardReader
from ..util import progress
from ..util.errors import FastPersistError
from .dcp_files import dcp_files
from .inspect import format_problems, megatron_made, metadata_backend

WHO = "verify"


@dataclass
class VerifyReport:
    """What was checked, and every problem found (empty when the checkpoint is sound)."""

    directory: str
    problems: list[str] = field(default_factory=list)
    records: int = 0
    tensors: int = 0
    bytes_checked: int = 0
    checksummed: bool = True  # False: torch DCP files of another writer, their sizes checked only

    @property
    def ok(self) -> bool:
        """True when no problem was found."""
        return not self.problems


def verify_checkpoint(checkpoint_dir: str) -> VerifyReport:
    """Check ``checkpoint_dir`` completely; raises only if it is not a directory."""
    if not os.path.isdir(checkpoint_dir):
        raise FastPersistError(f"{WHO}: {checkpoint_dir} is not a directory")
    report = VerifyReport(checkpoint_dir)
    foreign = dcp_files(checkpoint_dir)
    if foreign is not None:  # its sizes only: it has no checksums
        report.problems, report.checksummed = foreign.problems, False
        report.records = sum(e.chunks for e in foreign.entries)
        report.tensors = sum(e.kind == KIND_TENSOR for e in foreign.entries)
        return report
    try:
        top = read_top(checkpoint_dir, WHO)
        index = _all_parts(checkpoint_dir, top, report.problems) if isinstance(top, PagedIndex) else top
        check_markers(checkpoint_dir, index, WHO)
    except FastPersistError as e:
        report.problems[:0] = metadata_backend(checkpoint_dir)[2]
        report.problems.append(str(e))
        return report
    backend, _, problems = metadata_backend(checkpoint_dir, megatron_made(index))
    report.problems[:0] = problems
    report.problems.extend(format_problems(backend, index))
    report.records = len(index.records)
    report.tensors = len({r.key for r in index.records if r.kind == KIND_TENSOR})
    broken = set()
    for name, size in sorted(index.files.items()):
        path = os.path.join(checkpoint_dir, name)
        try:
            actual = os.path.getsize(path)
        except OSError as e:
            report.problems.append(f"{path} listed in the index is unreadable: {e}")
            broken.add(name)
            continue
        if actual != size:
            report.problems.append(f"{path} has {actual} bytes, the index says {size}")
            broken.add(name)
    records = sorted((r for r in index.records if r.file not in broken), key=lambda r: (r.file, r.offset))
    shown = progress.task("checksum", sum(r.length for r in records))
    with ShardReader(checkpoint_dir, index, verify=True, who=WHO) as reader:
        for record in records:
            try:
                reader.check_record(record)
                report.bytes_checked += record.length
                shown.add(record.length)
            except FastPersistError as e:
                report.problems.append(str(e))
    report.problems.extend(f"{checkpoint_dir}: {p}" for p in coverage_errors(list(index.records)))
    return report


def _all_parts(checkpoint_dir: str, top: PagedIndex, problems: list[str]) -> CheckpointIndex:
    """Every page of every index part file, one part at a time; a damaged part is a problem, the rest is checked."""
    good = []
    for name in sorted(top.parts):
        try:
            pages = read_page_bytes(checkpoint_dir, top, [p for p in top.pages if p.part_file == name], WHO)
            top.whole(pages, f"{WHO}: {checkpoint_dir}")  # each page checked and parsed
        except FastPersistError as e:
            problems.append(str(e))
            continue
        good += pages
    return top.whole(good, f"{WHO}: {checkpoint_dir}")
