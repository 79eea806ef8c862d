"""The checkpoint directory before a save: can every rank write it, do they share it, and invalidation.

A save touches nothing until every rank has agreed that it can go on
(``engine/agreement.py``); then rank 0 invalidates the old checkpoint there,
commit markers first (step 1 of the protocol in ``engine/commit.py``).
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
from typing import Any, Optional

import torch.distributed as dist

from ..format.index_pages import PART_FILE_RE
from ..format.records import STATUS_FILE_RE, is_data_file
from ..format.tiers import DRAINED_PREFIX, PENDING_DIR, TIERED_MARKERS
from ..storage.files import TMP_SUFFIX, fsync_path, unlink_quietly
from ..storage.shared_dir import view_of, why_not_shared
from ..util.errors import SaveFailedError
from .agreement import before_writing, failure
from .tiers.background import saving_into

logger = logging.getLogger(__name__)


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
    unlink_quietly(probe)
    return None


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
    is written. A removal of the directory asked for before (``remove_checkpoint``)
    keeps it from here on.
    """
    saving_into(checkpoint_dir, f"rank {dist.get_rank()}")
    agreement = before_writing(f"checkpoint directory {checkpoint_dir} cannot be used")
    created: list[Any] = [None]
    if dist.get_rank() == 0 and create:
        try:
            os.makedirs(checkpoint_dir, exist_ok=True)
        except OSError as e:
            created = [f"rank 0: cannot create {checkpoint_dir}: {e.strerror}"]
    dist.broadcast_object_list(created, src=0)
    agreement.raise_if(created)
    unusable = check_target_directory(checkpoint_dir)
    not_shared = check_shared_directory(checkpoint_dir, require_shared_dir)
    agreement.agree(failure(unusable or not_shared))


def invalidate(checkpoint_dir: str, rewritten: frozenset[str] = frozenset()) -> None:
    """Remove the commit markers first, then every stale data, index part, status and temp file (see step 1).

    The markers include a tiers manifest: a tiered checkpoint overwritten by a
    save without tiers must not send a later load to its local copies; the
    rest of its tiered layout (pending index, drain markers) goes with the
    stale files. Data files of both formats go: a stock ``torch_dist``
    checkpoint overwritten by us leaves no ``.distcp`` file of its own behind;
    those named in ``rewritten`` are left to the writers that replace them
    (``write_rank_file`` unlinks its file before writing). ``common.pt`` stays:
    megatron-core 0.16 writes it before the sharded strategy runs.
    """
    removed = [m for m in TIERED_MARKERS if os.path.lexists(os.path.join(checkpoint_dir, m))]
    for marker in removed:
        os.unlink(os.path.join(checkpoint_dir, marker))
    if removed:
        fsync_path(checkpoint_dir)
        logger.debug("fastpersist: overwriting the checkpoint in %s; removed %s first", checkpoint_dir, removed)
    for name in os.listdir(checkpoint_dir):
        if name in rewritten:
            continue
        if name == PENDING_DIR:
            shutil.rmtree(os.path.join(checkpoint_dir, name))
        elif (is_data_file(name) or PART_FILE_RE.match(name) or STATUS_FILE_RE.match(name)
              or name.endswith(TMP_SUFFIX) or name.startswith(DRAINED_PREFIX)):
            os.unlink(os.path.join(checkpoint_dir, name))
    fsync_path(checkpoint_dir)
