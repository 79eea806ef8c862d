"""The commit protocol: invalidate, write, report, commit the index last.

1. Before any data is written, rank 0 removes the old index (the commit marker)
   and every stale FastPersist file, then fsyncs the directory: a crash from
   here on leaves a directory that is recognisably incomplete.
2. Each writer streams its data file, fsyncs it, checks its size and leaves a
   status file (records + checksums, or the error). The writer may run in
   another process (async save), so the status file is the hand-over.
3. At finalize every rank sends its status to rank 0. Only if all succeeded does
   rank 0 write the index: temp file, fsync, rename, fsync of the directory.
   The outcome is broadcast, so every rank raises the same error or none.
"""

from __future__ import annotations

import json
import logging
import os
import traceback
from typing import Any, Optional

import torch.distributed as dist

from .errors import FastPersistError, IncompleteCheckpointError, SaveFailedError
from .format import (
    DATA_FILE_RE,
    INDEX_FILE,
    STATUS_FILE_RE,
    CheckpointIndex,
    record_from_json,
    record_to_json,
    status_file_name,
)
from .storage.writer import WriteResult

logger = logging.getLogger(__name__)


def fsync_dir(path: str) -> None:
    """Make renames and new entries in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file, or the whole new one."""
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


def check_target_directory(checkpoint_dir: str) -> Optional[str]:
    """Why ``checkpoint_dir`` cannot receive a checkpoint, or None if it can."""
    if not os.path.isdir(checkpoint_dir):
        return f"checkpoint directory {checkpoint_dir} does not exist (megatron's save() needs it created first)"
    if not os.access(checkpoint_dir, os.W_OK | os.X_OK):
        return f"checkpoint directory {checkpoint_dir} is not writable"
    return None


def invalidate(checkpoint_dir: str) -> None:
    """Remove the commit marker first, then every other FastPersist file (see step 1)."""
    index = os.path.join(checkpoint_dir, INDEX_FILE)
    if os.path.lexists(index):
        os.unlink(index)
        fsync_dir(checkpoint_dir)
        logger.warning("fastpersist: overwriting the checkpoint in %s; its index was removed first", checkpoint_dir)
    for name in os.listdir(checkpoint_dir):
        if DATA_FILE_RE.match(name) or STATUS_FILE_RE.match(name) or name == f"{INDEX_FILE}.tmp":
            os.unlink(os.path.join(checkpoint_dir, name))
    fsync_dir(checkpoint_dir)


def write_status(checkpoint_dir: str, rank: int, result: Optional[WriteResult], error: Optional[BaseException]) -> None:
    """Leave this rank's outcome for finalize (never raises: a failure here shows as a missing status)."""
    if error is None and result is not None:
        doc: dict[str, Any] = {
            "ok": True, "nbytes": result.nbytes, "seconds": result.seconds, "mode": result.mode,
            "records": [record_to_json(r) for r in result.records],
        }
    else:
        doc = {"ok": False, "error": f"{type(error).__name__}: {error}",
               "traceback": "".join(traceback.format_exception(error))}
    try:
        atomic_write(os.path.join(checkpoint_dir, status_file_name(rank)), json.dumps(doc).encode())
    except OSError:
        logger.exception("fastpersist: rank %d could not write its status file in %s", rank, checkpoint_dir)


def read_status(checkpoint_dir: str, rank: int) -> dict[str, Any]:
    """This rank's status, or a failure status saying why there is none."""
    path = os.path.join(checkpoint_dir, status_file_name(rank))
    try:
        with open(path, "rb") as f:
            return json.loads(f.read())
    except (OSError, ValueError) as e:
        return {"ok": False, "error": f"the writer left no readable status {path} ({e}); did it crash?"}


def build_index(statuses: list[dict[str, Any]], block_bytes: int, checkpoint_dir: str) -> CheckpointIndex:
    """Merge every rank's records into one validated index."""
    files = {}
    for st in statuses:
        for r in st["records"]:
            files[r["file"]] = files.get(r["file"], 0) + r["length"]
    records = tuple(
        record_from_json(r, f"status of {checkpoint_dir}", files, block_bytes)
        for st in statuses for r in st["records"]
    )
    return CheckpointIndex(world_size=len(statuses), checksum_block_bytes=block_bytes, files=files, records=records)


def finalize_save(checkpoint_dir: str, block_bytes: int) -> None:
    """Collective: commit the index if every rank wrote its file, else raise everywhere."""
    rank, world = dist.get_rank(), dist.get_world_size()
    status = read_status(checkpoint_dir, rank)
    gathered: Optional[list] = [None] * world if rank == 0 else None
    dist.gather_object(status, gathered, dst=0)
    outcome: list[Any] = [None]
    if rank == 0:
        assert gathered is not None
        failures = [f"rank {r}: {st['error']}" for r, st in enumerate(gathered) if not st.get("ok")]
        if not failures:
            try:
                index = build_index(gathered, block_bytes, checkpoint_dir)
                atomic_write(os.path.join(checkpoint_dir, INDEX_FILE), index.to_json_bytes())
                _log_summary(checkpoint_dir, gathered)
            except Exception as e:  # noqa: BLE001 - reported on every rank below
                failures = [f"rank 0: committing {INDEX_FILE} failed: {type(e).__name__}: {e}"]
        outcome = [failures]
    dist.broadcast_object_list(outcome, src=0)
    try:
        os.unlink(os.path.join(checkpoint_dir, status_file_name(rank)))
    except OSError:
        pass
    if outcome[0]:
        raise SaveFailedError(
            f"checkpoint {checkpoint_dir} was NOT saved; nothing was committed. " + " | ".join(outcome[0])
        )


def _log_summary(checkpoint_dir: str, statuses: list[dict[str, Any]]) -> None:
    total = sum(st["nbytes"] for st in statuses)
    slowest = max(st["seconds"] for st in statuses)
    logger.info(
        "fastpersist: committed %s: %.3f GiB from %d ranks, slowest writer %.2f s (%.2f GiB/s aggregate); "
        "bytes per rank: %s",
        checkpoint_dir, total / 2**30, len(statuses), slowest, total / 2**30 / max(slowest, 1e-9),
        [st["nbytes"] for st in statuses],
    )


def read_index(checkpoint_dir: str, who: str) -> CheckpointIndex:
    """The committed index, or an error saying why this directory cannot be loaded.

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
    return CheckpointIndex.from_json_bytes(data, path)
