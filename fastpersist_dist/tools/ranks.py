"""Run a function on N local ranks: forked processes in one process group, their results or fates collected.

The benchmarks and the tests launch their ranks here. The process group's
store listens on a socket this process binds before forking (port 0: the
kernel picks a free one, so no port is guessed and none can be taken in
between); rank 0 serves the store on it, the others connect. Processes that
are started rather than forked (a framework's training script) join a store
this process serves instead (:func:`serve_store`), as torchrun's do.

A rank that returns, raises, is killed or dies is reported as such
(:class:`Outcome`); one still running at the deadline is a hang, and fails
the run after every rank is stopped. A launch left early (a hang, or the
caller's own timeout interrupting the wait) first asks each rank still running
for every thread's Python stack (SIGUSR1, ``faulthandler``), printed on its
standard error: where it hung.
"""

from __future__ import annotations

import datetime
import faulthandler
import math
import multiprocessing as mp
import os
import queue as queue_module
import signal
import socket
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Union

import torch.distributed as dist

HOST = "127.0.0.1"
STACKS_WAIT_S = 2.0  # how long a launch left early waits for its running ranks to print their stacks
# What a rank runs before joining: it may pick its device, and returns the process group's backend.
Backend = Union[str, Callable[[int, int], str]]


@dataclass(frozen=True)
class Outcome:
    """How one rank ended: "ok" (``value``: what it returned), "raised" (the traceback), "killed" (the
    signal), "died" (a non-zero exit code without a result) or "stopped" (by the launcher)."""

    kind: str
    value: Any = None

    def describe(self, rank: int) -> str:
        """This outcome in a failure report."""
        if self.kind == "raised":
            return f"--- rank {rank} raised ---\n{self.value}"
        if self.kind == "killed":
            return f"--- rank {rank} was killed by signal {self.value} (SIGKILL, 9, is often the out-of-memory killer)"
        if self.kind == "died":
            return f"--- rank {rank} died without a result (exit code {self.value})"
        return f"--- rank {rank} was stopped after another rank failed" if self.kind == "stopped" else \
            f"--- rank {rank}: {self.kind}"


class RanksFailed(RuntimeError):
    """A rank raised, was killed, died or hung; the message has each one's traceback or fate."""


def _listener() -> socket.socket:
    """A listening socket on a free port of ``HOST``: the store's, bound before any rank exists."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((HOST, 0))
    sock.listen(128)
    return sock


def join(rank: int, world: int, listener: socket.socket, backend: str, timeout: datetime.timedelta) -> None:
    """Join the process group whose store ``listener`` holds (rank 0 serves it, the others connect)."""
    port = listener.getsockname()[1]
    os.environ.update(MASTER_ADDR=HOST, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))  # as torchrun's: one machine
    if rank == 0:
        store = dist.TCPStore(HOST, port, world, is_master=True, timeout=timeout, wait_for_workers=False,
                              master_listen_fd=listener.fileno())
    else:
        listener.close()  # rank 0's to serve
        store = dist.TCPStore(HOST, port, world, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)


def _entry(rank: int, world: int, listener: socket.socket, backend: Backend, pg_timeout: float, fn: Callable,
           args: tuple, out: Any, leave_together: bool) -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the launcher asks a hung rank where it is
    try:
        chosen = backend(rank, world) if callable(backend) else backend
        join(rank, world, listener, chosen, datetime.timedelta(seconds=pg_timeout))
        out.put((rank, "ok", fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - reported to the launcher
        out.put((rank, "raised", traceback.format_exc()))
        if dist.is_initialized():
            dist.destroy_process_group()  # at once: the others learn of it in their next collective
        return
    if leave_together:
        _leave_together()
    else:
        dist.destroy_process_group()


def _leave_together() -> None:
    """After returning, wait for the other ranks before leaving: rank 0 serves the store they may still need.

    A rank that cannot take part (a peer died) leaves at once: the launcher already has its result.
    """
    try:
        dist.barrier()
    except RuntimeError:  # torch's DistError family: a peer is gone
        pass
    dist.destroy_process_group()


def launch(world: int, fn: Callable, *args: Any, backend: Backend = "gloo", pg_timeout: float = 120,
           deadline: Optional[float] = 600, wait_for: Optional[set[int]] = None, stop_on_death: bool = True,
           leave_together: bool = True) -> dict[int, Outcome]:
    """Run ``fn(rank, world, *args)`` on ``world`` forked ranks; how each ended.

    Waits until every rank in ``wait_for`` (default: all) has an outcome; the
    others are then stopped. ``stop_on_death``: a rank killed or dead without
    a result stops the rest at once (they would wait for it in their next
    collective until the process group's timeout); fault tests that kill a rank
    on purpose pass False and watch the survivors. ``leave_together``: a rank
    that returned waits in a barrier for the others before it leaves (rank 0
    serves the store); fault tests, whose ranks may return in diverged states
    (one refused, another still in a collective), pass False. A rank still running after
    ``deadline`` seconds (None: no deadline) raises :class:`RanksFailed` (a hang),
    once every rank is stopped.
    """
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    waiting = set(range(world)) if wait_for is None else set(wait_for)
    outcomes: dict[int, Outcome] = {}
    with _listener() as listener:
        procs = [ctx.Process(target=_entry, args=(r, world, listener, backend, pg_timeout, fn, args, out,
                                                  leave_together)) for r in range(world)]
        for p in procs:
            p.start()
    end = time.monotonic() + (math.inf if deadline is None else deadline)
    try:
        while waiting - outcomes.keys():
            _drain(out, outcomes, 0.2)
            dead = _dead(procs, outcomes)
            if dead:
                _drain(out, outcomes, 0.0)  # a result may have arrived just before its rank exited
                for r, code in _dead(procs, outcomes).items():
                    outcomes[r] = Outcome("killed", -code) if code < 0 else Outcome("died", code)
                if stop_on_death:
                    break
            if time.monotonic() > end and waiting - outcomes.keys():
                hung = sorted(waiting - outcomes.keys())
                raise RanksFailed(f"ranks {hung} hung past {deadline} s (their stacks are on standard error); "
                                  "the others: " + "; ".join(f"rank {r} {o.kind}" for r, o in sorted(outcomes.items())))
    except BaseException:  # a hang, or the caller's timeout interrupting the wait
        _print_stacks([p for r, p in enumerate(procs) if r not in outcomes])
        raise
    finally:
        done = leave_together and not (waiting - outcomes.keys()) and all(o.kind == "ok" for o in outcomes.values())
        for r, p in enumerate(procs):
            if done:
                p.join(timeout=30)  # leaving together (see _leave_together)
            if p.is_alive():
                p.kill()
                outcomes.setdefault(r, Outcome("stopped"))
            p.join(timeout=60)
    return outcomes


def _print_stacks(procs: list[Any]) -> None:
    """Have each of ``procs`` still running print its threads' stacks (see ``_entry``), and give them the time to."""
    asked = False
    for p in procs:
        if p.is_alive():
            try:
                os.kill(p.pid, signal.SIGUSR1)
                asked = True
            except ProcessLookupError:
                pass
    if asked:
        time.sleep(STACKS_WAIT_S)


def _drain(out: Any, outcomes: dict[int, Outcome], timeout: float) -> None:
    """Take every result waiting in ``out`` (the first within ``timeout`` seconds)."""
    while True:
        try:
            rank, kind, value = out.get(timeout=timeout) if timeout else out.get_nowait()
        except queue_module.Empty:
            return
        outcomes[rank] = Outcome(kind, value)
        timeout = 0.0


def _dead(procs: list[Any], outcomes: dict[int, Outcome]) -> dict[int, int]:
    """Ranks that exited without a result, and their exit codes."""
    return {r: p.exitcode for r, p in enumerate(procs) if r not in outcomes and p.exitcode is not None}


def run_ranks(world: int, fn: Callable, *args: Any, backend: Backend = "gloo", pg_timeout: float = 120,
              deadline: Optional[float] = 600) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` forked ranks; every rank's return value, in rank order.

    Raises :class:`RanksFailed` with every failed rank's traceback or fate.
    """
    outcomes = launch(world, fn, *args, backend=backend, pg_timeout=pg_timeout, deadline=deadline)
    failed = [o.describe(r) for r, o in sorted(outcomes.items()) if o.kind != "ok"]
    if failed:
        raise RanksFailed("\n".join(failed))
    return [outcomes[r].value for r in range(world)]


@contextmanager
def serve_store(world: int, timeout: float = 300) -> Iterator[dict[str, str]]:
    """A process group store served by this process while the block runs; the environment of its ranks.

    For ranks that are started, not forked (``torch.distributed``'s ``env://``
    joins it as a client, as under torchrun): each gets this environment plus
    its ``RANK``.
    """
    store = dist.TCPStore(HOST, 0, world, is_master=True, timeout=datetime.timedelta(seconds=timeout),
                          wait_for_workers=False)
    try:
        yield {"MASTER_ADDR": HOST, "MASTER_PORT": str(store.port), "WORLD_SIZE": str(world),
               "LOCAL_WORLD_SIZE": str(world), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    finally:
        del store
