"""A writer's outcome, left as a status file: the hand-over from the write to the commit (which reads it).

The write may run in the trainer (synchronous save) or in the rank's writer
process (async), which imports this module and what it needs to write, and
nothing of megatron-core, the index or the commit (``util/roles.py``).
"""

from __future__ import annotations

import json
import logging
import os
import traceback
from typing import Any, Optional

from ..format.records import CONTAINER_TORCH_SAVE, record_to_json, status_file_name
from ..storage.files import atomic_write
from ..storage.writer import WriteItem, WriteResult, write_rank_file
from ..util.config import WriteConfig

logger = logging.getLogger(__name__)


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


def left_good_status(checkpoint_dir: str, rank: int) -> bool:
    """Whether this rank's writer left a good status in ``checkpoint_dir`` (a save's directory holds no stale
    status: it is cleared before the writers start), e.g. before it died without saying so to the trainer."""
    try:
        with open(os.path.join(checkpoint_dir, status_file_name(rank)), "rb") as f:
            return json.loads(f.read()).get("ok") is True
    except (OSError, ValueError):
        return False


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
