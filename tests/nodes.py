"""Several torchrun nodes on this machine: ``torchrun --nnodes N`` started once per node, as on a cluster.

Each node runs in a mount namespace of its own (``unshare``: root) where the local-tier path, the same
string on every node, is that node's own directory, as each machine's NVMe is at one path on a cluster.
The nodes meet in a rendezvous store this process serves (its port bound here first: nothing guessed);
torchrun orders them by address, so the node started with ``127.0.0.{n+1}`` is node ``n`` (``GROUP_RANK``).
Each node is a process group of its own, so a test can kill one whole node (torchrun and its ranks) at once.
A rank that crashes, or hangs past the timeout, prints every thread's Python stack into the output a failure
shows (``PYTHONFAULTHANDLER``; SIGUSR1, which tests/tiers_driver.py registers).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent


class Nodes:
    """``python -m tests.tiers_driver ACTION ARGS`` running on ``len(node_dirs)`` nodes of ``per_node`` ranks;
    node ``n`` sees ``node_dirs[n]`` at ``local``."""

    def __init__(self, action: str, args: dict, node_dirs: list[str], local: str, per_node: int = 1,
                 timeout: float = 300, env: Optional[dict] = None):
        self.action, self.timeout = action, timeout
        self._store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=timeout),
                                    wait_for_workers=False)
        self.procs = []
        for n, node_dir in enumerate(node_dirs):
            torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(node_dirs)),
                        "--nproc-per-node", str(per_node), "--rdzv-backend", "c10d", "--rdzv-id", "tiers",
                        "--rdzv-endpoint", f"127.0.0.1:{self._store.port}", "--rdzv-conf", "is_host=false",
                        "--local-addr", f"127.0.0.{n + 1}", "-m", "tests.tiers_driver", action, json.dumps(args)]
            self.procs.append(subprocess.Popen(
                on_node(node_dir, local, torchrun), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
                env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", **(env or {})}))

    def kill(self, node: int) -> None:
        """Kill node ``node`` at once: torchrun and every rank of it (a machine lost). torchrun starts its ranks
        in sessions of their own, so they are found as descendants, and stopped before anything is killed."""
        family = _descendants(self.procs[node].pid)
        for pid in family:
            _signal(pid, signal.SIGSTOP)
        for pid in family:
            _signal(pid, signal.SIGKILL)

    def kill_ranks(self, node: int) -> None:
        """SIGKILL the ranks of node ``node``, not its torchrun (a rank's process killed, its machine up)."""
        for pid in _descendants(self.procs[node].pid):
            if _is_rank(pid):
                _signal(pid, signal.SIGKILL)

    def finish(self, check: bool = True) -> list[dict]:
        """Wait for every node; every rank's RESULT, by global rank (``check``: every node must exit 0)."""
        outputs = []
        try:
            for p in self.procs:
                outputs.append(p.communicate(timeout=self.timeout)[0])
        except subprocess.TimeoutExpired:
            for n in range(len(self.procs)):  # each hung rank prints its threads' stacks first (tests/tiers_driver)
                for pid in _descendants(self.procs[n].pid):
                    if _is_rank(pid):
                        _signal(pid, signal.SIGUSR1)
            time.sleep(2)
            for n in range(len(self.procs)):
                self.kill(n)
            tails = [p.communicate()[0][-12000:] for p in self.procs]
            raise AssertionError(f"{self.action} ran past {self.timeout} s; the nodes' output:\n" + "\n".join(
                f"--- node {n}:\n{tail}" for n, tail in enumerate(tails))) from None
        finally:
            del self._store
        if check:
            for n, (p, out) in enumerate(zip(self.procs, outputs)):
                assert p.returncode == 0, f"node {n} of {self.action} exited {p.returncode}:\n{out[-6000:]}"
        self.outputs = outputs
        results = [json.loads(line[len("RESULT "):]) for out in outputs for line in out.splitlines()
                   if line.startswith("RESULT ")]
        return sorted(results, key=lambda r: r["rank"])


def on_node(node_dir: str, local: str, command: list[str]) -> list[str]:
    """``command`` run in a mount namespace of its own where ``local`` is ``node_dir`` (a node's local tier)."""
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c",
            'mount --bind "$1" "$2" && shift 2 && exec "$@"', "sh", node_dir, local, *command]


def _descendants(pid: int) -> list[int]:
    """``pid`` and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo += children.get(p, [])
    return found


def _is_rank(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            words = f.read().split(b"\0")
    except OSError:
        return False
    return b"tests.tiers_driver" in words and b"torch.distributed.run" not in words


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def run_nodes(action: str, args: dict, node_dirs: list[str], local: str, per_node: int = 1,
              timeout: float = 300, env: Optional[dict] = None) -> list[dict]:
    """Run ``action`` on the nodes to the end; every rank's RESULT, by global rank (see :class:`Nodes`)."""
    return Nodes(action, args, node_dirs, local, per_node, timeout, env).finish()
