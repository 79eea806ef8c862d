"""The rank's persistent writer process: async saves are written there, not in the trainer.

Forking a writer per async save costs every save a new aio handle and locked
bounce buffer (a large page-locked allocation), and while the forked process lives,
every page the trainer modifies is copied once (copy-on-write): the training
loop pays for it. One writer per rank, started once with a fresh interpreter
(no pages shared with the trainer), owns its aio handle and bounce buffer
across saves and reads the snapshots from shared memory
(:class:`~fastpersist_dist.storage.shared_memory.SharedBuffer`).

Protocol, over a unix socket in the abstract namespace (peer uid checked):
one connection per message, a message being a length-prefixed pickle:

* ``("buffer", id, nbytes)`` with the memfd attached: map it (the trainer, when
  a snapshot buffer is made, or again for a new writer);
* ``("drop", id)``: unmap it;
* ``("ping", config)``: make the aio handle and bounce buffer of ``config``
  (a ``WriteConfig``, or None) unless they exist, then answer ``("pong",
  None)`` (the writer is ready);
* ``("job", WriterJob)``: write the file, leave the status (as any writer does,
  see status.py) and answer ``("done", None)``. The caller (the request's
  ``async_fn``, in whatever process megatron's or our queue runs it; in a
  process forked from the trainer for it, a fresh interpreter that replaced
  the fork) waits for that answer; if the connection breaks before the
  writer left a good status (the caller reads it: the answer is lost with a
  writer killed right after its status), the writer died, and the caller
  leaves a failure status naming the file, so finalize fails on every rank.

The writer dies with the trainer (``PR_SET_PDEATHSIG``, armed by the writer
itself for the thread that started it: schedule saves from a long-lived thread)
and is started again by the next save if it died. Jobs are written one after
the other, in the order their ``async_fn`` connected.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..format.records import ShardRecord
from ..storage.shared_memory import SharedBuffer, map_fd
from ..storage.sinks import preload_ops, prepare_direct_writes
from ..storage.writer import WriteItem
from ..util.config import WriteConfig
from ..util.errors import FastPersistError
from ..util.per_process import PerProcess
from ..util.roles import WRITER_ENV
from .status import write_and_report
from .unforked_wait import reply_lost, wait_unforked

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_LEN = struct.Struct("<Q")
_SO_PEERCRED = struct.Struct("3i")  # pid, uid, gid


@dataclass(frozen=True)
class ItemSpec:
    """One record's bytes as the writer finds them: a range of a shared buffer, or inline (objects)."""

    record: ShardRecord
    buffer: Optional[tuple[int, int]]  # SharedBuffer.id, or None: ``inline`` holds the bytes
    offset: int
    nbytes: int
    inline: bytes = b""
    prefix: bytes = b""
    suffix: bytes = b""


@dataclass(frozen=True)
class WriterJob:
    """Everything the writer needs for one rank's data file (picklable: any async caller can send it)."""

    checkpoint_dir: str
    data_file: str
    items: list[ItemSpec]
    config: WriteConfig
    rank: int


def describe_items(items: list[WriteItem], buffer: SharedBuffer) -> list[ItemSpec]:
    """Where each item's bytes lie: in ``buffer`` (snapshotted tensors) or inline (serialized objects)."""
    base, end = buffer.tensor.data_ptr(), buffer.tensor.data_ptr() + buffer.nbytes
    specs = []
    for it in items:
        n = it.data.numel()
        ptr = it.data.data_ptr()
        if n and base <= ptr and ptr + n <= end:
            specs.append(ItemSpec(it.record, buffer.id, ptr - base, n, prefix=it.prefix, suffix=it.suffix))
        else:
            specs.append(ItemSpec(it.record, None, 0, n, bytes(it.data.numpy()), it.prefix, it.suffix))
    return specs


# ----------------------------------------------------------------------------- wire


def _send(sock: socket.socket, message: Any, fds: tuple[int, ...] = ()) -> None:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    data = _LEN.pack(len(payload)) + payload
    sent = socket.send_fds(sock, [data], list(fds)) if fds else sock.send(data)
    if sent < len(data):
        sock.sendall(data[sent:])


def _recv_exact(sock: socket.socket, n: int, start: bytes = b"") -> bytes:
    chunks, got = [start], len(start)
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise ConnectionError("connection closed mid-message")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _recv(sock: socket.socket) -> tuple[Any, list[int]]:
    """One message and the descriptors attached to it; ``ConnectionError`` on EOF. Reads no byte past it."""
    first, fds, _, _ = socket.recv_fds(sock, _LEN.size, 4)
    if not first:
        raise ConnectionError("connection closed")
    head = _recv_exact(sock, _LEN.size, first) if len(first) < _LEN.size else first
    (length,) = _LEN.unpack(head[: _LEN.size])
    return pickle.loads(_recv_exact(sock, _LEN.size + length, head)[_LEN.size :]), fds


def _connect(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(address)
    except OSError:
        sock.close()
        raise
    return sock


# ----------------------------------------------------------------------------- trainer side


def write_in_writer(address: str, writer_pid: int, job: WriterJob) -> None:
    """``async_fn`` of an async save: hand ``job`` to the rank's writer and wait until it is written.

    Never raises (like every writer): a writer that is gone or dies mid-write
    leaves a failure status naming the rank, file and cause, which finalize
    reports on every rank. In a process forked from the trainer only to run
    this call (megatron's and nvidia-resiliency-ext's temporal callers), the
    wait goes on in a fresh interpreter that replaces the fork (``unforked_wait.py``):
    while a fork lives, every page the trainer writes is copied once.
    """
    try:
        with _connect(address) as sock:
            _send(sock, ("job", job))
            if getattr(multiprocessing.current_process(), "_target", None) is write_in_writer:
                wait_unforked(sock, job.checkpoint_dir, job.rank, job.data_file, writer_pid, _child_env())
            reply, _ = _recv(sock)
        if reply[0] != "done":
            raise FastPersistError(str(reply[1]))
    except (OSError, EOFError, pickle.UnpicklingError, FastPersistError) as e:
        reply_lost(job.checkpoint_dir, job.rank, job.data_file, writer_pid, e)


class WriterClient:
    """The trainer's handle on its writer process: starts it (again), shares snapshot buffers with it."""

    def __init__(self) -> None:
        self._process: Optional[subprocess.Popen] = None
        self._address = ""
        self._starts = 0
        self._buffers: dict[tuple[int, int], SharedBuffer] = {}

    @property
    def pid(self) -> Optional[int]:
        """The running writer's process id (None before the first async save)."""
        return self._process.pid if self._process is not None else None

    def ensure_running(self) -> tuple[str, int]:
        """Start the writer unless it runs (a dead one is replaced, with a warning); its address and pid.

        Returns at once: the writer's listening socket exists before the process
        does, so jobs queue up while it imports and loads its ops.
        """
        if self._process is not None and self._process.poll() is None:
            return self._address, self._process.pid
        if self._process is not None:
            logger.warning("fastpersist: writer process %d exited (%s); starting a new one",
                           self._process.pid, _exit_description(self._process.returncode))
        self._starts += 1
        self._address = f"\0fastpersist-writer-{os.getpid()}-{self._starts}-{os.urandom(4).hex()}"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(self._address)
            listener.listen(256)
            self._process = subprocess.Popen(
                [sys.executable, "-c", _BOOT, str(listener.fileno()), str(os.getpid()),
                 str(logging.getLogger("fastpersist_dist").getEffectiveLevel())],
                pass_fds=(listener.fileno(),), stdin=subprocess.DEVNULL, env=_child_env(),
            )
        finally:
            listener.close()  # only the writer holds it: if it dies, waiting connections fail at once
        logger.debug("fastpersist: writer process %d started", self._process.pid)
        for buffer in self._buffers.values():
            self._share(buffer)
        return self._address, self._process.pid

    def wait_ready(self, config: Optional[WriteConfig] = None) -> None:
        """Start the writer if needed and wait until it serves (its imports and ops take seconds); with
        ``config``, also until it holds that configuration's aio handle and bounce buffer."""
        address, pid = self.ensure_running()
        try:
            with _connect(address) as sock:
                _send(sock, ("ping", config))
                _recv(sock)
        except (OSError, EOFError) as e:
            raise FastPersistError(f"the writer process {pid} did not start ({type(e).__name__}: {e})") from e

    def stop(self, timeout: Optional[float] = None) -> None:
        """Let the writer finish the jobs handed to it so far (it serves in order), then exit (killed after
        ``timeout`` s): what it writes is then all there. A job handed to it later fails (a failure status). For a
        process that ends (an async save never finalized: ``tiers/background.py``); a later save starts a new
        writer."""
        if self._process is None or self._process.poll() is not None:
            return
        self._tell(("stop",))
        try:
            self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            logger.warning("fastpersist: writer process %d still writing after %.0f s; killing it", self._process.pid,
                           timeout)
            self._process.kill()
            self._process.wait()
        logger.debug("fastpersist: writer process %d stopped (%s)", self._process.pid,
                     _exit_description(self._process.returncode))

    def add_buffer(self, buffer: SharedBuffer) -> None:
        """Let the writer map ``buffer`` (no wait: it is read before any later job)."""
        self._buffers[buffer.id] = buffer
        self.ensure_running()
        self._share(buffer)

    def drop_buffer(self, buffer: SharedBuffer) -> None:
        """The writer unmaps ``buffer``; no job may still refer to it."""
        self._buffers.pop(buffer.id, None)
        if self._process is not None and self._process.poll() is None:
            self._tell(("drop", buffer.id))

    def _share(self, buffer: SharedBuffer) -> None:
        self._tell(("buffer", buffer.id, buffer.nbytes), (buffer.fd,))

    def _tell(self, message: Any, fds: tuple[int, ...] = ()) -> None:
        try:
            with _connect(self._address) as sock:
                _send(sock, message, fds)
        except OSError as e:  # a writer dying now fails the job that needs it, with the cause
            logger.warning("fastpersist: writer process %s unreachable (%s)", self.pid, e)


def _child_env() -> dict[str, str]:
    """This environment, with this very package first on the writer's import path, marked as the writer's."""
    env = dict(os.environ)
    env[WRITER_ENV] = "1"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # holds fastpersist_dist/
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    env.setdefault("PYTHONWARNINGS", "ignore")  # megatron's import-time warnings, once per rank already
    return env


def _exit_description(code: Optional[int]) -> str:
    if code is not None and code < 0:
        return f"killed by signal {-code} ({signal.strsignal(-code)})"
    return f"exit code {code}"


# The writer's interpreter imports this module like any other: run as ``-m`` it would exist twice
# (runpy warns, on stderr of every writer, that the package import had already loaded it). ``-c`` puts the
# working directory first on the import path: dropped, so that a checkout of another version there cannot
# stand in for the trainer's package (``_child_env`` puts that first).
_BOOT = "import sys; del sys.path[0]; from fastpersist_dist.engine.writer_process import main; main(sys.argv[1:])"

# This process's writer client (a forked child gets its own: the parent's writer is not its child).
writer_client = PerProcess(WriterClient).get


# ----------------------------------------------------------------------------- writer side


class _Writer:
    def __init__(self) -> None:
        self._maps: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}

    def handle(self, conn: socket.socket) -> bool:
        """Serve one request; False once told to stop."""
        message, fds = _recv(conn)
        try:
            if message[0] == "buffer":
                self._maps[message[1]] = map_fd(fds[0], message[2])
            elif message[0] == "drop":
                self._maps.pop(message[1], None)
            elif message[0] == "job":
                _send(conn, self._write(message[1]))
            elif message[0] == "ping":
                if message[1] is not None:
                    prepare_direct_writes(message[1])
                _send(conn, ("pong", None))
            elif message[0] == "stop":
                return False
        finally:
            for fd in fds:
                os.close(fd)
        return True

    def _write(self, job: WriterJob) -> tuple[str, Optional[str]]:
        try:
            items = [WriteItem(s.record, self._bytes(s), s.prefix, s.suffix) for s in job.items]
        except KeyError as e:
            return "error", f"rank {job.rank}: the writer of {job.data_file} has no snapshot buffer {e}"
        write_and_report(job.checkpoint_dir, items, job.config, job.rank, job.data_file)
        return "done", None

    def _bytes(self, spec: ItemSpec) -> torch.Tensor:
        if spec.buffer is None:
            if not spec.inline:
                return torch.empty(0, dtype=torch.uint8)
            return torch.frombuffer(bytearray(spec.inline), dtype=torch.uint8)
        return self._maps[spec.buffer][1][spec.offset : spec.offset + spec.nbytes]


def _peer_uid(conn: socket.socket) -> int:
    return _SO_PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _SO_PEERCRED.size))[1]


def main(argv: list[str]) -> None:
    """The writer process: serve the trainer ``argv[1]`` on the listening socket ``argv[0]`` until it dies."""
    listen_fd, trainer, level = int(argv[0]), int(argv[1]), int(argv[2])
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != trainer:  # the trainer died before the signal was armed
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the trainer; we die with it
    logging.basicConfig(level=level, format=f"%(asctime)s writer of pid {trainer}: %(name)s %(levelname)s %(message)s")
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    torch.set_num_threads(1)  # I/O-bound; the trainer's cores are the trainer's
    preload_ops(WriteConfig())  # before the first job arrives (seconds)
    listener = socket.socket(fileno=listen_fd)
    writer = _Writer()
    uid = os.getuid()
    while True:
        conn, _ = listener.accept()
        with conn:
            if _peer_uid(conn) != uid:
                logger.warning("fastpersist: writer refused a connection from uid %d", _peer_uid(conn))
                continue
            try:
                if not writer.handle(conn):
                    return
            except (OSError, EOFError, pickle.UnpicklingError) as e:  # that caller is gone; serve the next
                logger.warning("fastpersist: writer: a request failed: %s", e)
