"""The commit protocol: invalidate, write, report, commit the index last.

1. Before any data is written, rank 0 removes the old commit markers (a tiers
   manifest, our index and DCP's ``.metadata``), fsyncs the directory, then
   removes every stale data file of either format that this save does not
   rewrite, the index part files and what is left of a tiered checkpoint:
   a crash from here on leaves a directory that is recognisably incomplete. A data
   file this save rewrites is unlinked by its own writer just before it writes
   (step 2): unlinking a large file takes time (it frees every extent), which the
   save call would otherwise spend on rank 0 while every rank waits.
2. Each writer streams its data file, fsyncs it, checks its size, reads
   sampled blocks back from the device and leaves a status file (records +
   checksums, or the error). The writer may run in another process (async
   save), so the status file is the hand-over.
3. At finalize every rank sends its status to the first rank of its planning
   group, which commits the group's index part file (``index_pages``) and
   sends rank 0 only its page entries. Only if all succeeded does rank 0
   commit, each file as temp file, fsync, rename, fsync of the directory:
   first auxiliary files (``common.pt`` where megatron-core 0.19 leaves it to us),
   then the top-level index,
   then, for the ``torch_dist`` format, DCP's ``.metadata``: the format's marker
   comes last.
   The outcome is broadcast, so every rank raises the same error or none. A
   failed save removes its data files (its space is needed on a full disk); the
   directory stays without index, i.e. incomplete.

A rank that dies or hangs makes the commit collectives fail on the others: a
dead process at once (gloo sees its sockets close), a hung one after the
process group's timeout. That surfaces as ``SaveFailedError`` too, saying
whether this rank knows the outcome.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import replace
from typing import Any, Optional

import torch.distributed as dist

from ..format.checksum import digest_bytes
from ..format.dcp_metadata import metadata_bytes
from ..format.index_pages import Page, PagedIndex, build_part, key_kinds, part_file_name, top_level
from ..format.kinds import CheckpointFormat
from ..format.records import INDEX_FILE, ShardRecord, aux_copy_name, record_from_json, status_file_name
from ..storage.files import atomic_write, file_digest, unlink_quietly
from ..util.errors import FastPersistError, SaveFailedError
from .index_reader import read_page_bytes, read_top

logger = logging.getLogger(__name__)


def read_status(checkpoint_dir: str, rank: int, fmt: CheckpointFormat) -> dict[str, Any]:
    """This rank's status, or a failure status saying why there is none."""
    path = os.path.join(checkpoint_dir, status_file_name(rank))
    try:
        with open(path, "rb") as f:
            return json.loads(f.read())
    except (OSError, ValueError) as e:
        data = os.path.join(checkpoint_dir, fmt.data_file(rank))
        return {"ok": False, "error": f"the writer of {data} left no readable status {path} ({e}); did it crash?"}


def _validated_records(statuses: list[dict[str, Any]], block_bytes: int, where: str,
                       fmt: CheckpointFormat) -> tuple[list[ShardRecord], dict[str, int]]:
    """Every record of ``statuses`` checked against the format's invariants, and the sizes of their files."""
    files: dict[str, int] = {}
    for st in statuses:
        for r in st["records"]:
            files[r["file"]] = files.get(r["file"], 0) + r["length"]
    records = [record_from_json(r, where, files, block_bytes, fmt.container) for st in statuses for r in st["records"]]
    return records, files


class _Commit:
    """Where the committed files go: into ``directory`` at once (a shared directory), or, for a tiered save's
    local commit (``kept``), into a list in commit order, for every node's copy (``engine/tiers/save.py``)."""

    def __init__(self, directory: str, kept: bool):
        self.directory = directory
        self.kept: Optional[list[tuple[str, bytes]]] = [] if kept else None

    def put(self, name: str, data: bytes) -> None:
        if self.kept is None:
            _commit_file(self.directory, name, data)
        else:
            self.kept.append((name, data))

    def pages(self, top: PagedIndex, name: str, who: str) -> list[tuple[Page, bytes]]:
        """The pages of part file ``name``, read back: from the directory, or from what was kept."""
        pages = [p for p in top.pages if p.part_file == name]
        if self.kept is None:
            return read_page_bytes(self.directory, top, pages, who)
        data = dict(self.kept)[name]
        return [(p, data[p.offset : p.offset + p.length]) for p in pages]


def _commit_part(checkpoint_dir: str, ranks: list[int], statuses: list[dict[str, Any]], block_bytes: int,
                 fmt: CheckpointFormat, keep: bool) -> dict[str, Any]:
    """The group leader's step: build, validate and commit its group's part file; report only page entries
    (and, where the commit is ``keep``-ing files for the local tiers, the part's bytes)."""
    group = min(ranks)
    report: dict[str, Any] = {"ranks": ranks, "failures": [f"rank {r}: {st['error']}"
                                                          for r, st in zip(ranks, statuses) if not st.get("ok")]}
    if report["failures"]:
        return report
    name = part_file_name(group)
    try:
        records, files = _validated_records(statuses, block_bytes, f"rank {ranks[0]}: status of {checkpoint_dir}", fmt)
        data, pages = build_part(records, group, files, fmt.container)
        if keep:
            report["part_data"] = data
        else:
            _commit_file(checkpoint_dir, name, data)
    except FastPersistError as e:
        report["failures"] = [f"rank {ranks[0]}: {e}"]
        return report
    except Exception as e:  # noqa: BLE001 - reported on every rank
        report["failures"] = [f"rank {ranks[0]}: committing {name} failed: {type(e).__name__}: {e}"]
        return report
    report.update(part=(name, len(data)), pages=pages, kinds=key_kinds(records),
                  nbytes=[st["nbytes"] for st in statuses], seconds=max(st["seconds"] for st in statuses))
    return report


def _commit_file(checkpoint_dir: str, name: str, data: bytes) -> None:
    try:
        atomic_write(os.path.join(checkpoint_dir, name), data)
    except OSError as e:
        raise FastPersistError(f"committing {name} failed: {type(e).__name__}: {e}") from e


def _commit_top(commit: _Commit, reports: list[dict[str, Any]], world: int, block_bytes: int,
                fmt: CheckpointFormat, aux_files: dict[str, bytes]) -> None:
    """Rank 0's step, from the groups' page entries only: auxiliary files, the top level, the marker last.

    For ``torch_dist``, DCP's ``.metadata`` needs every chunk (torch's format): it is
    built from the committed part files, read back one group at a time.
    """
    reported = sorted(r for rep in reports for r in rep["ranks"])
    if reported != list(range(world)):
        raise FastPersistError(f"the planning groups' ranks {reported} do not partition the world of {world} ranks "
                               "(every rank must pass the parallel_group it belongs to)")
    kinds = {k: v for rep in reports for k, v in rep["kinds"].items()}
    index = top_level([p for rep in reports for p in rep["pages"]], kinds, dict(rep["part"] for rep in reports),
                      world, block_bytes, fmt.container, {n: digest_bytes(b) for n, b in aux_files.items()})
    for rep in reports:
        if "part_data" in rep:
            commit.put(rep["part"][0], rep["part_data"])
    for name, data in aux_files.items():
        commit.put(name, data)
    if fmt.marker == INDEX_FILE:
        commit.put(INDEX_FILE, index.to_json_bytes())
        return
    records = (r for name in sorted(index.parts) for r in index.whole(commit.pages(index, name, "rank 0"),
                                                                       "rank 0").records)
    metadata = metadata_bytes(records, commit.directory)
    index = replace(index, metadata_xxh3_64=digest_bytes(metadata))
    commit.put(INDEX_FILE, index.to_json_bytes())
    commit.put(fmt.marker, metadata)


def finalize_save(
    checkpoint_dir: str, block_bytes: int, fmt: CheckpointFormat, aux_files: Optional[dict[str, bytes]] = None,
    group: Optional[dist.ProcessGroup] = None, spread: bool = False, beside: Optional[dist.ProcessGroup] = None,
) -> Optional[list[tuple[str, bytes]]]:
    """Collective: commit if every rank wrote its file, else raise everywhere.

    Statuses are gathered within the planning ``group`` (default: the world);
    its first rank commits the group's part file and sends rank 0 only page
    entries, so no rank holds every record. ``aux_files`` (rank 0 only;
    name -> bytes) are committed with the checkpoint. ``spread``: a tiered
    save's local commit, where ``checkpoint_dir`` is each node's own copy:
    nothing is written here; every rank gets the committed files, in commit
    order (the marker last), for its node's copy (``engine/tiers/save.py``).
    ``beside``: a group of every rank that the collectives run over instead
    of the trainer's, where the commit is made beside training (a tiered
    async save's, ``engine/tiers/local_commit.py``); the statuses of a
    planning group then travel point to point to its first rank.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    ranks = list(range(world)) if group is None else dist.get_process_group_ranks(group)
    leader = ranks[0]
    status = read_status(checkpoint_dir, rank, fmt)
    committed = False
    outcome: list[Any] = [None, None]  # the failures, and the files kept for the local tiers
    try:
        try:
            statuses = _gathered(status, ranks, group, beside)
        except RuntimeError as e:  # torch's DistError family: a rank died or timed out
            raise _peer_failure(checkpoint_dir, rank, "gathering the planning group's write statuses", e, False) from e
        report = None
        if rank == leader:
            assert statuses is not None
            report = _commit_part(checkpoint_dir, ranks, statuses, block_bytes, fmt, spread)
        reports: Optional[list] = [None] * world if rank == 0 else None
        try:
            dist.gather_object(report, reports, dst=0, group=beside)
        except RuntimeError as e:
            raise _peer_failure(checkpoint_dir, rank, "gathering the groups' part files", e, False) from e
        if rank == 0:
            assert reports is not None
            reports = [rep for rep in reports if rep is not None]
            failures = [f for rep in reports for f in rep["failures"]]
            commit = _Commit(checkpoint_dir, spread)
            if not failures:
                try:
                    _commit_top(commit, reports, world, block_bytes, fmt, aux_files or {})
                    committed = True
                except FastPersistError as e:  # reported on every rank below
                    failures = [f"rank 0: {e}"]
                except Exception as e:  # noqa: BLE001 - reported on every rank below
                    failures = [f"rank 0: committing the checkpoint failed: {type(e).__name__}: {e}"]
                if committed:
                    _log_summary(checkpoint_dir, reports)
            outcome = [failures, commit.kept]
        try:
            dist.broadcast_object_list(outcome, src=0, group=beside)
        except RuntimeError as e:
            raise _peer_failure(checkpoint_dir, rank, "broadcasting the commit outcome", e, committed) from e
    finally:
        unlink_quietly(os.path.join(checkpoint_dir, status_file_name(rank)))
    if outcome[0]:
        unlink_quietly(os.path.join(checkpoint_dir, fmt.data_file(rank)))  # every record of a rank is in its file
        if rank == leader:
            unlink_quietly(os.path.join(checkpoint_dir, part_file_name(min(ranks))))
        raise SaveFailedError(
            f"checkpoint {checkpoint_dir} was NOT saved; nothing was committed and the data files were removed. "
            + " | ".join(outcome[0])
        )
    return outcome[1]


def _gathered(status: dict[str, Any], ranks: list[int], group: Optional[dist.ProcessGroup],
              beside: Optional[dist.ProcessGroup]) -> Optional[list[dict[str, Any]]]:
    """The planning group's statuses, in its rank order, on its first rank (None on the others): gathered over the
    group (the world's over ``beside`` where given), or, for a planning group's commit made beside training, sent
    point to point over ``beside``."""
    rank, leader = dist.get_rank(), ranks[0]
    if group is None or beside is None:
        statuses: Optional[list] = [None] * len(ranks) if rank == leader else None
        dist.gather_object(status, statuses, dst=leader, group=beside if group is None else group)
        return statuses
    if rank != leader:
        dist.send_object_list([status], dst=leader, group=beside)
        return None
    statuses = [status]
    for member in ranks[1:]:
        box: list[Any] = [None]
        dist.recv_object_list(box, src=member, group=beside)
        statuses.append(box[0])
    return statuses


def _peer_failure(checkpoint_dir: str, rank: int, step: str, error: BaseException, committed: bool) -> SaveFailedError:
    """The error a rank raises when a commit collective fails (a rank died, or hung past the timeout)."""
    if rank == 0:
        state = ("the index WAS committed, but not every rank could be told" if committed
                 else "nothing was committed")
    else:
        state = (f"rank 0 commits only once every rank's status reached it; whether it did is unknown here, "
                 f"`fastpersist-dist verify {checkpoint_dir}` tells")
    return SaveFailedError(
        f"rank {rank}: checkpoint {checkpoint_dir}: {step} failed, a rank died or timed out "
        f"({type(error).__name__}: {error}); {state}"
    )


def _log_summary(checkpoint_dir: str, reports: list[dict[str, Any]]) -> None:
    per_rank = [n for rep in reports for n in rep["nbytes"]]
    total, slowest = sum(per_rank), max(rep["seconds"] for rep in reports)
    logger.info(
        "fastpersist: committed %s: %.3f GiB from %d ranks in %d planning groups, slowest writer %.2f s "
        "(%.2f GiB/s aggregate); bytes per rank: %s",
        checkpoint_dir, total / 2**30, len(per_rank), len(reports), slowest, total / 2**30 / max(slowest, 1e-9),
        per_rank,
    )


def keep_committed_aux_files(checkpoint_dir: str, who: str) -> None:
    """Put back the committed auxiliary files of the checkpoint in ``checkpoint_dir``, from their committed copies.

    megatron-core <= 0.18's ``save()`` rewrites ``common.pt`` before the sharded
    strategy runs; if the save is then refused (bad input, a queue it cannot
    serve, a directory still being written), the committed checkpoint there must
    stay whole. A save that goes on removes that checkpoint's index first and
    commits its own ``common.pt``. Never raises: a save goes on without it.
    """
    try:
        top = read_top(checkpoint_dir, who)
        for name, want in sorted(top.aux_files.items()):
            path, copy = os.path.join(checkpoint_dir, name), os.path.join(checkpoint_dir, aux_copy_name(name))
            if file_digest(path, who) == want or top.aux_files.get(aux_copy_name(name)) != want:
                continue
            with open(copy, "rb") as f:
                data = f.read()
            if digest_bytes(data) == want:
                _commit_file(checkpoint_dir, name, data)
                logger.debug("%s: put the committed %s back in %s (megatron's save() had rewritten it)",
                             who, name, checkpoint_dir)
    except FastPersistError:
        return  # no committed checkpoint there (e.g. invalidated by a save still running): nothing to restore
    except OSError:
        logger.warning("%s: could not check %s's committed auxiliary files", who, checkpoint_dir, exc_info=True)
