"""Fault injection for the tests: ranks that die mid-write, calls that must fail, records to write."""

from __future__ import annotations

import logging
import os
import resource
import signal
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import pytest
import torch
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.core import CheckpointingException

from fastpersist_dist import FastPersistLoadStrategy, IncompleteCheckpointError
from fastpersist_dist.format.records import INDEX_FILE, ShardRecord, data_file_name
from fastpersist_dist.storage.writer import WriteItem
from fastpersist_dist.tools.ranks import Outcome, launch, run_ranks
from fastpersist_dist.tools.verify import verify_checkpoint
from fastpersist_dist.util.config import MiB

from .helpers import assert_same, global_tensor, load, sharded

logger = logging.getLogger(__name__)

KILL_AT = 4 * MiB  # a victim dies when its data file reaches this size
# The kernel signals (SIGXFSZ) only a write that starts at or past the limit; one that straddles
# it is cut short in silence (the size check then fails the save instead). A write killed half
# way therefore needs aio blocks smaller than KILL_AT, so that a later block starts past it.
KILLABLE = {"aio_block_mb": 1}


def die_at_file_size(limit: int) -> None:
    """SIGKILL this process as soon as it writes a file past ``limit`` bytes.

    The kernel raises SIGXFSZ (RLIMIT_FSIZE) at the first write starting there (see KILLABLE); the handler
    turns it into SIGKILL, i.e. a crash in the middle of the write. Both the
    limit and the handler are inherited by processes forked from here on.
    """
    signal.signal(signal.SIGXFSZ, lambda *_: os.kill(os.getpid(), signal.SIGKILL))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))


def live_again() -> None:
    """Undo :func:`die_at_file_size` in this process."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)


@dataclass(repr=False)
class Raised:
    """What a call that had to fail raised, and after how long (logged, never asserted)."""

    kind: str
    message: str
    seconds: float
    trace: str

    def __repr__(self) -> str:  # what a failing assertion shows
        return f"{self.kind} after {self.seconds:.2f} s:\n{self.trace}"


def save_error(call: Callable[[], Any]) -> Raised:
    """What ``call()`` raised; it must raise."""
    start = time.monotonic()
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return Raised(type(e).__name__, str(e), time.monotonic() - start, traceback.format_exc())
    raise AssertionError("the call was expected to fail")


def random_records(lengths: list[int], rank: int) -> list[WriteItem]:
    """Pseudo-random uint8 records of these lengths, placed back to back in ``rank``'s data file."""
    shards, offset = [], 0
    for i, n in enumerate(lengths):
        data = torch.from_numpy(np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8))
        record = ShardRecord(
            key=f"r{i}", kind="tensor", dtype="uint8", local_shape=(n,), global_shape=(n,), global_offset=(0,),
            axis_fragmentations=None, prepend_axis_num=0, flattened_range=None, replica_id=0,
            file=data_file_name(rank), offset=offset, length=n, checksums=(),
        )
        shards.append(WriteItem(record, data))
        offset += n
    return shards


def run_faulty(world: int, fn: Callable, *args: Any, pg_timeout: float = 120, deadline: float = 240,
               wait_for: Optional[set[int]] = None) -> dict[int, Outcome]:
    """``fn(rank, world, *args)`` on forked gloo ranks, some of which are expected to die; how each ended.

    Waits until every rank in ``wait_for`` (default: all) has an outcome; the others are then stopped.
    A rank still running at ``deadline`` seconds fails the test: that is the hang this harness exists to catch.
    """
    return launch(world, fn, *args, pg_timeout=pg_timeout, deadline=deadline, wait_for=wait_for, stop_on_death=False,
                  leave_together=False)


# --------------------------------------------------------------------------- shapes and checks shared by the fault tests

BIG = (2048, 4096)  # float32: 16 MiB per rank of 2
HUGE = (16384, 8192)  # float32: 256 MiB per rank of 2
SMALL = (64, 256)
DEAD_PEER = "a rank died or timed out"


def fault_state(key: str, shape: tuple[int, int], rank: int, world: int, salt: int, split: Any = 0) -> dict:
    return {key: sharded(key, global_tensor(key, shape, salt=salt), rank, world, split)}


def files_named(path: str, pattern: str = "fastpersist") -> list[str]:
    return sorted(n for n in os.listdir(path) if pattern in n)


# --------------------------------------------------------------------------- checks after a crash


def load_and_verify(rank: int, world: int, path: str, key: str, shape: tuple[int, int], salt: int) -> None:
    want = global_tensor(key, shape, salt=salt)
    req = {key: ShardedTensor.from_rank_offsets(key, torch.zeros_like(want), replica_id=rank)}
    assert_same(load(req, path)[key], want, f"{path}:{key}")
    report = verify_checkpoint(path)
    assert report.ok, report.problems


def refusal_messages(rank: int, world: int, path: str, key: str, shape: tuple[int, int], metadata: bool) -> list[str]:
    """Every way to open ``path`` refuses it; returns the messages."""
    req = {key: ShardedTensor.from_rank_offsets(key, torch.zeros(shape), replica_id=rank)}
    messages = []
    with pytest.raises(IncompleteCheckpointError) as ours:
        FastPersistLoadStrategy().load(req, path)
    messages.append(str(ours.value))
    # megatron refuses a directory without metadata.json before asking any strategy;
    # after a failed overwrite the old metadata.json is there and our loader refuses.
    expected = IncompleteCheckpointError if metadata else CheckpointingException
    with pytest.raises(expected) as theirs:
        load(req, path)
    messages.append(str(theirs.value))
    return messages


def assert_incomplete_and_prev_intact(new: str, prev: str, key: str, shape: tuple[int, int], metadata: bool) -> None:
    assert not os.path.exists(os.path.join(new, INDEX_FILE))
    assert os.path.exists(os.path.join(new, "metadata.json")) == metadata
    ours, theirs = run_ranks(1, refusal_messages, new, key, shape, metadata)[0]
    assert "this checkpoint is incomplete" in ours and new in ours, ours
    assert ("this checkpoint is incomplete" if metadata else "is not a distributed checkpoint") in theirs, theirs
    problems = verify_checkpoint(new).problems
    assert any("this checkpoint is incomplete" in p for p in problems), problems
    run_ranks(1, load_and_verify, prev, "s", SMALL, 1)


def assert_survivors_raised(outcomes: dict[int, Outcome], victim: int, new: str) -> None:
    """The victim died of SIGKILL; every other rank raised SaveFailedError (the harness deadline bounds the wait)."""
    assert outcomes[victim].kind == "killed" and outcomes[victim].value == signal.SIGKILL, outcomes[victim]
    for r, o in outcomes.items():
        if r == victim:
            continue
        assert o.kind == "ok", o.value
        e = o.value
        logger.info("rank %d raised %s after %.2f s: %s", r, e.kind, e.seconds, e.message)
        assert e.kind == "SaveFailedError" and DEAD_PEER in e.message, e
        assert new in e.message and f"rank {r}:" in e.message, e
        if r == 0:
            assert "nothing was committed" in e.message, e
