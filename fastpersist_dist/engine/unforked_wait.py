"""The wait for the writer's answer in a process forked from the trainer only to run an async save's
``async_fn`` (megatron-core's and nvidia-resiliency-ext's temporal callers fork one per request).

While a fork of the trainer lives, every page the trainer writes (the next
training steps: parameters, optimizer state, activations) is copied once,
paid by training for the length of the write. So the forked process hands its
job to the writer and then replaces itself (``execve``, the same pid, which
the caller watches) by ``_WAIT``: an interpreter without site or environment,
a few MiB, that reads the writer's answer on the inherited socket and exits
0 on "done"; otherwise it becomes ``_LOST``, which leaves the failure status
(:func:`reply_lost`) that finalize reports on every rank.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from typing import NoReturn

from ..util.errors import FastPersistError
from .status import left_good_status, write_status

logger = logging.getLogger(__name__)


def reply_lost(checkpoint_dir: str, rank: int, data_file: str, writer_pid: int, e: Exception) -> None:
    """The writer answered with an error or not at all: leave the failure status, unless it died after leaving
    a good one."""
    path = os.path.join(checkpoint_dir, data_file)
    if isinstance(e, (OSError, EOFError)) and left_good_status(checkpoint_dir, rank):
        logger.warning("fastpersist: rank %d: the writer process (pid %d) died after writing %s and leaving its "
                       "status (%s: %s); the file stands", rank, writer_pid, path, type(e).__name__, e)
        return
    cause = e if isinstance(e, FastPersistError) else FastPersistError(
        f"rank {rank}: the writer process (pid {writer_pid}) of {path} died before it finished "
        f"({type(e).__name__}: {e}); was it killed (e.g. by the OOM killer), or stopped as the trainer exited "
        "with this save not finalized?")
    logger.error("fastpersist: %s", cause)
    write_status(checkpoint_dir, rank, None, cause)


def wait_unforked(sock: socket.socket, checkpoint_dir: str, rank: int, data_file: str, writer_pid: int,
                  env: dict[str, str]) -> NoReturn:
    """Replace this forked process by ``_WAIT`` on ``sock`` (the same pid, so its caller still sees it run until
    the file is written); where the answer is not "done", that execs ``_LOST`` (in ``env``: the writer's, which
    imports this package as the trainer does) for the failure status."""
    os.set_inheritable(sock.fileno(), True)
    os.execve(sys.executable, [sys.executable, "-S", "-I", "-c", _WAIT, str(sock.fileno()), _LOST, checkpoint_dir,
                               str(rank), data_file, str(writer_pid)], env)


# Standard library only (-S -I: no site, no environment): it starts in milliseconds and maps a few MiB. Reads
# the writer's one answer (length-prefixed pickle of a tuple of a str and a str or None, as ``_send`` frames it);
# exits 0 on "done", else execs _LOST with the answer's message ("" where there was none).
_WAIT = """import os, pickle, struct, sys
fd, lost, *job = sys.argv[1:]
data = b""
try:
    while len(data) < 8 or len(data) < 8 + struct.unpack("<Q", data[:8])[0]:
        more = os.read(int(fd), 1 << 16)
        if not more:
            break
        data += more
except OSError:  # e.g. reset by a writer killed: no answer
    pass
try:
    answer = pickle.loads(data[8:8 + struct.unpack("<Q", data[:8])[0]])
except Exception:
    answer = None
if answer is not None and answer[0] == "done":
    sys.exit(0)
os.execv(sys.executable, [sys.executable, "-c", lost, *job, "" if answer is None else str(answer[1])])
"""
_LOST = ("import sys; del sys.path[0]; from fastpersist_dist.engine.unforked_wait import reply_lost_after_fork; "
         "reply_lost_after_fork(sys.argv[1:])")


def reply_lost_after_fork(argv: list[str]) -> None:
    """``_LOST``'s entry: ``checkpoint_dir rank data_file writer_pid message`` (message "": the connection
    closed without an answer)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    checkpoint_dir, rank, data_file, writer_pid, message = argv
    error: Exception = FastPersistError(message) if message else ConnectionError("connection closed")
    reply_lost(checkpoint_dir, int(rank), data_file, int(writer_pid), error)
