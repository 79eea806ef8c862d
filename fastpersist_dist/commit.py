"""The commit protocol: invalidate, write, report, commit the index last.

1. Before any data is written, rank 0 removes the old commit markers (our index
   and DCP's ``.metadata``), fsyncs the directory, then removes every stale data
   file of either format that this save does not rewrite and the index part files:
   a crash from here on leaves a directory that is recognisably incomplete. A data
   file this save rewrites is unlinked by its own writer just before it writes
   (step 2): unlinking a large file takes time (0.06 s per 0.5 GiB on ext4 here),
   which the save call would otherwise spend on rank 0 while every rank waits.
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
import socket
import traceback
from dataclasses import replace
from typing import Any, Optional, Union

import torch.distributed as dist

from .checkpoint_formats import DCP_METADATA_FILE, CheckpointFormat
from .checksum import digest_bytes
from .config import WriteConfig
from .dcp_metadata import metadata_bytes
from .errors import CorruptCheckpointError, FastPersistError, IncompleteCheckpointError, SaveFailedError
from .format import (
    CONTAINER_TORCH_SAVE,
    INDEX_FILE,
    STATUS_FILE_RE,
    CheckpointIndex,
    ShardRecord,
    aux_copy_name,
    is_data_file,
    record_from_json,
    record_to_json,
    status_file_name,
)
from .index_pages import (
    PART_FILE_RE,
    Box,
    Page,
    PagedIndex,
    build_part,
    is_paged,
    key_kinds,
    parse_top,
    part_file_name,
    select_pages,
    top_level,
)
from .shared_dir import view_of, why_not_shared
from .storage.writer import WriteItem, WriteResult, write_rank_file

logger = logging.getLogger(__name__)
TMP_SUFFIX = ".fastpersist.tmp"  # atomic_write's temp files: only ours are removed when overwriting


def fsync_path(path: str) -> None:
    """Make ``path`` durable: a file's bytes, or a directory's renames and new entries."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file, or the whole new one."""
    tmp = f"{path}{TMP_SUFFIX}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)  # e.g. a full disk: leave no half-written temp file behind
        raise
    fsync_path(os.path.dirname(path) or ".")


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _who() -> str:
    return f"rank {dist.get_rank()}" if dist.is_available() and dist.is_initialized() else f"pid {os.getpid()}"


def check_target_directory(checkpoint_dir: str) -> Optional[str]:
    """Why ``checkpoint_dir`` cannot receive a checkpoint (from this process), or None if it can.

    A probe file is created and removed: ``os.access`` looks at permission bits,
    which say "writable" to root on a read-only mount or under NFS root squash.
    """
    if not os.path.isdir(checkpoint_dir):
        return (f"{_who()}: checkpoint directory {checkpoint_dir} does not exist "
                "(megatron's save() needs it created first)")
    probe = os.path.join(checkpoint_dir, f".fastpersist_probe.{socket.gethostname()}.{os.getpid()}")
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600))
    except OSError as e:
        return f"{_who()}: checkpoint directory {checkpoint_dir} is not writable: {e.strerror} (creating {probe})"
    _unlink_quietly(probe)
    return None


def gather_or_fail(local: Any, what: str, group: Optional[dist.ProcessGroup] = None) -> list[Any]:
    """``all_gather_object`` (in ``group``, default the world); a rank that died or timed out becomes a
    ``SaveFailedError`` here too."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(gathered, local, group=group)
    except RuntimeError as e:  # torch's DistError family
        raise SaveFailedError(f"{what}; rank {dist.get_rank()}: a rank died or timed out "
                              f"before anything was written ({e})") from e
    return gathered


def raise_if(failures: list[Optional[str]], what: str) -> None:
    """Raise one ``SaveFailedError`` listing every failure, if there is any (before anything was written)."""
    failures = list(dict.fromkeys(f for f in failures if f))  # a group's failure arrives once per member
    if failures:
        raise SaveFailedError(f"{what}; nothing was written: " + " | ".join(failures))


def agree(local_error: Optional[str], what: str) -> None:
    """Collective: raise the same error on every rank if any rank reported one."""
    raise_if(gather_or_fail(local_error, what), what)


def check_shared_directory(checkpoint_dir: str, required: bool = True) -> Optional[str]:
    """Collective (world): why this rank does not see rank 0's ``checkpoint_dir`` (see ``shared_dir``), or None.

    Rank 0's view is broadcast whatever ``required`` says, so ranks that
    disagree about it still run the same collectives.
    """
    mine = view_of(checkpoint_dir)
    first = [mine if dist.get_rank() == 0 else None]
    try:
        dist.broadcast_object_list(first, src=0)
    except RuntimeError as e:  # torch's DistError family
        raise SaveFailedError(f"rank {dist.get_rank()}: a rank died or timed out while comparing views of "
                              f"{checkpoint_dir}; nothing was written ({e})") from e
    return why_not_shared(mine, first[0], dist.get_rank(), checkpoint_dir) if required else None


def prepare_checkpoint_dir(checkpoint_dir: str, create: bool = True, require_shared_dir: bool = True) -> None:
    """Collective: create ``checkpoint_dir`` (rank 0) and check that every rank can write it, and sees
    the directory rank 0 made (``require_shared_dir``: as the save strategy's knob).

    Call it instead of ``os.makedirs`` + barrier before ``dist_checkpointing.save``:
    megatron's save() lists the directory and writes ``common.pt`` on rank 0
    before our strategy runs, so a missing or read-only directory fails there on
    rank 0 alone, and the other ranks learn of it only when rank 0's process is
    gone. This raises the same ``SaveFailedError`` on every rank, before anything
    is written.
    """
    what = f"checkpoint directory {checkpoint_dir} cannot be used"
    created: list[Any] = [None]
    if dist.get_rank() == 0 and create:
        try:
            os.makedirs(checkpoint_dir, exist_ok=True)
        except OSError as e:
            created = [f"rank 0: cannot create {checkpoint_dir}: {e.strerror}"]
    dist.broadcast_object_list(created, src=0)
    raise_if(created, what)
    unusable = check_target_directory(checkpoint_dir)
    not_shared = check_shared_directory(checkpoint_dir, require_shared_dir)
    agree(unusable or not_shared, what)


MARKERS = (DCP_METADATA_FILE, INDEX_FILE)  # removed first when overwriting, whichever format wrote them


def invalidate(checkpoint_dir: str, rewritten: frozenset[str] = frozenset()) -> None:
    """Remove the commit markers first, then every stale data, index part, status and temp file (see step 1).

    Data files of both formats go: a stock ``torch_dist`` checkpoint overwritten
    by us leaves no ``.distcp`` file of its own behind; those named in
    ``rewritten`` are left to the writers that replace them (``write_rank_file``
    unlinks its file before writing). ``common.pt`` stays: megatron-core 0.16
    writes it before the sharded strategy runs.
    """
    removed = [m for m in MARKERS if os.path.lexists(os.path.join(checkpoint_dir, m))]
    for marker in removed:
        os.unlink(os.path.join(checkpoint_dir, marker))
    if removed:
        fsync_path(checkpoint_dir)
        logger.debug("fastpersist: overwriting the checkpoint in %s; removed %s first", checkpoint_dir, removed)
    for name in os.listdir(checkpoint_dir):
        if name in rewritten:
            continue
        if is_data_file(name) or PART_FILE_RE.match(name) or STATUS_FILE_RE.match(name) or name.endswith(TMP_SUFFIX):
            os.unlink(os.path.join(checkpoint_dir, name))
    fsync_path(checkpoint_dir)


def write_status(checkpoint_dir: str, rank: int, result: Optional[WriteResult], error: Optional[BaseException]) -> None:
    """Leave this rank's outcome for finalize (never raises: a failure here shows as a missing status)."""
    if error is None and result is not None:
        doc: dict[str, Any] = {
            "ok": True, "nbytes": result.nbytes, "seconds": result.seconds, "mode": result.mode,
            "records": [record_to_json(r, CONTAINER_TORCH_SAVE) for r in result.records],  # data_offset kept
        }
    else:
        doc = {"ok": False, "error": f"{type(error).__name__}: {error}",
               "traceback": "".join(traceback.format_exception(error))}
    try:
        atomic_write(os.path.join(checkpoint_dir, status_file_name(rank)), json.dumps(doc).encode())
    except OSError:
        logger.exception("fastpersist: rank %d could not write its status file in %s", rank, checkpoint_dir)


def write_and_report(checkpoint_dir: str, items: list[WriteItem], config: WriteConfig, rank: int,
                     data_file: str) -> None:
    """Step 2: write this rank's file and leave its status; never raises (the status is the hand-over).

    Runs in the trainer (synchronous save) or in the rank's writer process (async).
    """
    path = os.path.join(checkpoint_dir, data_file)
    try:
        result = write_rank_file(path, items, config, rank)
    except BaseException as e:  # noqa: BLE001 - reported to every rank at finalize
        logger.error("fastpersist: rank %d failed writing %s: %s", rank, path, e)
        write_status(checkpoint_dir, rank, None, e)
        return
    write_status(checkpoint_dir, rank, result, None)


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


def _commit_part(checkpoint_dir: str, ranks: list[int], statuses: list[dict[str, Any]], block_bytes: int,
                 fmt: CheckpointFormat) -> dict[str, Any]:
    """The group leader's step: build, validate and commit its group's part file; report only page entries."""
    group = min(ranks)
    report: dict[str, Any] = {"ranks": ranks, "failures": [f"rank {r}: {st['error']}"
                                                          for r, st in zip(ranks, statuses) if not st.get("ok")]}
    if report["failures"]:
        return report
    name = part_file_name(group)
    try:
        records, files = _validated_records(statuses, block_bytes, f"rank {ranks[0]}: status of {checkpoint_dir}", fmt)
        data, pages = build_part(records, group, files, fmt.container)
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


def _commit_top(checkpoint_dir: str, reports: list[dict[str, Any]], world: int, block_bytes: int,
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
    for name, data in aux_files.items():
        _commit_file(checkpoint_dir, name, data)
    if fmt.marker == INDEX_FILE:
        _commit_file(checkpoint_dir, INDEX_FILE, index.to_json_bytes())
        return
    records = (r for name in sorted(index.parts) for r in index.whole(read_page_bytes(
        checkpoint_dir, index, [p for p in index.pages if p.part_file == name], "rank 0"), "rank 0").records)
    metadata = metadata_bytes(records, checkpoint_dir)
    index = replace(index, metadata_xxh3_64=digest_bytes(metadata))
    _commit_file(checkpoint_dir, INDEX_FILE, index.to_json_bytes())
    _commit_file(checkpoint_dir, fmt.marker, metadata)


def finalize_save(
    checkpoint_dir: str, block_bytes: int, fmt: CheckpointFormat, aux_files: Optional[dict[str, bytes]] = None,
    group: Optional[dist.ProcessGroup] = None,
) -> None:
    """Collective: commit if every rank wrote its file, else raise everywhere.

    Statuses are gathered within the planning ``group`` (default: the world);
    its first rank commits the group's part file and sends rank 0 only page
    entries, so no rank holds every record. ``aux_files`` (rank 0 only;
    name -> bytes) are committed with the checkpoint.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    ranks = list(range(world)) if group is None else dist.get_process_group_ranks(group)
    leader = ranks[0]
    status = read_status(checkpoint_dir, rank, fmt)
    committed = False
    outcome: list[Any] = [None]
    try:
        statuses: Optional[list] = [None] * len(ranks) if rank == leader else None
        try:
            dist.gather_object(status, statuses, dst=leader, group=group)
        except RuntimeError as e:  # torch's DistError family: a rank died or timed out
            raise _peer_failure(checkpoint_dir, rank, "gathering the planning group's write statuses", e, False) from e
        report = None
        if rank == leader:
            assert statuses is not None
            report = _commit_part(checkpoint_dir, ranks, statuses, block_bytes, fmt)
        reports: Optional[list] = [None] * world if rank == 0 else None
        try:
            dist.gather_object(report, reports, dst=0)
        except RuntimeError as e:
            raise _peer_failure(checkpoint_dir, rank, "gathering the groups' part files", e, False) from e
        if rank == 0:
            assert reports is not None
            reports = [rep for rep in reports if rep is not None]
            failures = [f for rep in reports for f in rep["failures"]]
            if not failures:
                try:
                    _commit_top(checkpoint_dir, reports, world, block_bytes, fmt, aux_files or {})
                    committed = True
                except FastPersistError as e:  # reported on every rank below
                    failures = [f"rank 0: {e}"]
                except Exception as e:  # noqa: BLE001 - reported on every rank below
                    failures = [f"rank 0: committing the checkpoint failed: {type(e).__name__}: {e}"]
                if committed:
                    _log_summary(checkpoint_dir, reports)
            outcome = [failures]
        try:
            dist.broadcast_object_list(outcome, src=0)
        except RuntimeError as e:
            raise _peer_failure(checkpoint_dir, rank, "broadcasting the commit outcome", e, committed) from e
    finally:
        _unlink_quietly(os.path.join(checkpoint_dir, status_file_name(rank)))
    if outcome[0]:
        _unlink_quietly(os.path.join(checkpoint_dir, fmt.data_file(rank)))  # every record of a rank is in its file
        if rank == leader:
            _unlink_quietly(os.path.join(checkpoint_dir, part_file_name(min(ranks))))
        raise SaveFailedError(
            f"checkpoint {checkpoint_dir} was NOT saved; nothing was committed and the data files were removed. "
            + " | ".join(outcome[0])
        )


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


def read_top(checkpoint_dir: str, who: str) -> Union[PagedIndex, CheckpointIndex]:
    """The committed top level (version 3) or whole index (versions 1 and 2), or why there is none.

    ``who`` (e.g. "rank 3") starts every message.
    """
    path = os.path.join(str(checkpoint_dir), INDEX_FILE)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise IncompleteCheckpointError(
            f"{who}: {checkpoint_dir} has no {INDEX_FILE}: this checkpoint is incomplete "
            "(its save crashed, failed or is still running) and cannot be loaded"
        ) from None
    except OSError as e:
        raise FastPersistError(f"{who}: cannot read {path}: {e}") from e
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        doc = None  # from_json_bytes says what is wrong
    return parse_top(doc, f"{who}: {path}") if is_paged(doc) else CheckpointIndex.from_json_bytes(data, path)


def read_index(checkpoint_dir: str, who: str, wants: Optional[dict[str, list[Box]]] = None) -> CheckpointIndex:
    """The committed index, or an error saying why this directory cannot be loaded.

    For a version-3 (paged) index, ``wants`` (key -> requested boxes) reads only
    the pages meeting them; None reads every page. Versions 1 and 2 are one
    file, always read whole.
    """
    index = read_unchecked_index(checkpoint_dir, who, wants)
    check_markers(str(checkpoint_dir), index, who)
    return index


def read_unchecked_index(checkpoint_dir: str, who: str,
                         wants: Optional[dict[str, list[Box]]] = None) -> CheckpointIndex:
    """``read_index`` without checking the files committed beside it: for reports that list those too."""
    top = read_top(checkpoint_dir, who)
    if isinstance(top, PagedIndex):
        pages = top.pages if wants is None else select_pages(top, wants)
        top = top.whole(read_page_bytes(str(checkpoint_dir), top, pages, who), f"{who}: {checkpoint_dir}")
    return top


def check_markers(checkpoint_dir: str, index: Union[CheckpointIndex, PagedIndex], who: str) -> None:
    """The index goes with the files committed beside it: its own ``.metadata`` (or none for the native
    format), then auxiliary files (``common.pt``); a marker from another writer is the first thing to tell."""
    if index.container == CONTAINER_TORCH_SAVE:
        _check_dcp_metadata(checkpoint_dir, index, who)
    elif os.path.lexists(os.path.join(checkpoint_dir, DCP_METADATA_FILE)):
        # Our saves remove both markers first, so this .metadata came later, from another writer.
        raise CorruptCheckpointError(
            f"{who}: {checkpoint_dir} holds a native {INDEX_FILE} and a torch DCP {DCP_METADATA_FILE} written "
            "after it by another writer (e.g. megatron's own torch_dist save into the same directory): which "
            f"checkpoint is meant is unknown; remove {INDEX_FILE} to load the torch_dist one"
        )
    _check_aux_files(checkpoint_dir, index, who)


def read_page_bytes(checkpoint_dir: str, top: PagedIndex, pages: list[Page], who: str) -> list[tuple[Page, bytes]]:
    """The bytes of ``pages``, read from their part files (checked and parsed by ``PagedIndex.whole``)."""
    by_file: dict[str, list[Page]] = {}
    for page in pages:
        by_file.setdefault(page.part_file, []).append(page)
    read: list[tuple[Page, bytes]] = []
    for name, file_pages in sorted(by_file.items()):
        path = os.path.join(checkpoint_dir, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise CorruptCheckpointError(
                f"{who}: index part file {path} listed in {INDEX_FILE} is missing "
                f"(it holds the records of '{file_pages[0].key}'): this checkpoint is damaged"
            ) from None
        except OSError as e:
            raise FastPersistError(f"{who}: cannot read {path}: {e}") from e
        try:
            size = os.fstat(fd).st_size
            if size != top.parts[name]:
                raise CorruptCheckpointError(f"{who}: index part file {path} has {size} bytes, "
                                             f"{INDEX_FILE} says {top.parts[name]}: it is damaged")
            read.extend((p, os.pread(fd, p.length, p.offset)) for p in sorted(file_pages, key=lambda p: p.offset))
        finally:
            os.close(fd)
    return read


def file_digest(path: str, who: str) -> Optional[str]:
    """XXH3 of the file at ``path``, None if there is none."""
    try:
        with open(path, "rb") as f:
            return digest_bytes(f.read())
    except FileNotFoundError:
        return None
    except OSError as e:
        raise FastPersistError(f"{who}: cannot read {path}: {e}") from e


def _check_aux_files(checkpoint_dir: str, index: Union[CheckpointIndex, PagedIndex], who: str) -> None:
    """Every auxiliary file is the one committed: megatron-core <= 0.18 loads ``common.pt`` before any strategy."""
    for name, want in sorted(index.aux_files.items()):
        path = os.path.join(checkpoint_dir, name)
        found = file_digest(path, who)
        if found == want:
            continue
        copy = aux_copy_name(name)
        fix = (f"; its committed copy {copy} is intact: copy it over {name} to load this checkpoint"
               if index.aux_files.get(copy) == want and file_digest(os.path.join(checkpoint_dir, copy), who) == want
               else "")
        state = "is missing" if found is None else f"(XXH3 {found}) is not the one committed with {INDEX_FILE} (XXH3 {want})"
        raise CorruptCheckpointError(
            f"{who}: {path} {state}: it was damaged or rewritten after the commit (megatron-core <= 0.18's "
            f"save() writes {name} before the sharded strategy runs, so a save into this directory that was "
            f"killed before that leaves its own {name} behind){fix}"
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


def _check_dcp_metadata(checkpoint_dir: str, index: Union[CheckpointIndex, PagedIndex], who: str) -> None:
    """The sidecar index holds only if DCP's ``.metadata`` is the one committed with it."""
    path = os.path.join(checkpoint_dir, DCP_METADATA_FILE)
    digest = file_digest(path, who)
    if digest is None:
        raise IncompleteCheckpointError(
            f"{who}: {checkpoint_dir} has no {DCP_METADATA_FILE}: this torch_dist checkpoint is incomplete "
            "(its save crashed, failed or is still running) and cannot be loaded"
        )
    if digest != index.metadata_xxh3_64:
        raise CorruptCheckpointError(
            f"{who}: {path} (XXH3 {digest}) is not the one committed with {INDEX_FILE} "
            f"(XXH3 {index.metadata_xxh3_64}): it is damaged, or another writer (e.g. megatron's own torch_dist) "
            f"rewrote this checkpoint; to load such a checkpoint without our checksums, remove {INDEX_FILE}"
        )
