"""Several torchrun nodes on this machine: ``torchrun --nnodes N`` started once per node, as on a cluster.

Each node runs in a mount namespace of its own (``unshare``: root) where the local-tier path, the same
string on every node, is that node's own directory, as each machine's NVMe is at one path on a cluster.
The nodes meet in a rendezvous store this process serves (its port bound here first: nothing guessed);
torchrun orders them by address, so the node started with ``127.0.0.{n+1}`` is node ``n`` (``GROUP_RANK``).
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent


def run_nodes(action: str, args: dict, node_dirs: list[str], local: str, per_node: int = 1,
              timeout: float = 300) -> list[dict]:
    """``python -m tests.tiers_driver ACTION ARGS`` on ``len(node_dirs)`` nodes of ``per_node`` ranks; every
    rank's RESULT, by global rank. Node ``n`` sees ``node_dirs[n]`` at ``local``."""
    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=timeout), wait_for_workers=False)
    try:
        procs = []
        for n, node_dir in enumerate(node_dirs):
            torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(node_dirs)),
                        "--nproc-per-node", str(per_node), "--rdzv-backend", "c10d", "--rdzv-id", "tiers",
                        "--rdzv-endpoint", f"127.0.0.1:{store.port}", "--rdzv-conf", "is_host=false",
                        "--local-addr", f"127.0.0.{n + 1}", "-m", "tests.tiers_driver", action, json.dumps(args)]
            command = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                       'mount --bind "$1" "$2" && shift 2 && exec "$@"', "sh", node_dir, local, *torchrun]
            procs.append(subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}))
        outputs = []
        for p in procs:
            try:
                outputs.append(p.communicate(timeout=timeout)[0])
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise
    finally:
        del store
    for n, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"node {n} of {action} exited {p.returncode}:\n{out[-6000:]}"
    results = [json.loads(line[len("RESULT "):]) for out in outputs for line in out.splitlines()
               if line.startswith("RESULT ")]
    return sorted(results, key=lambda r: r["rank"])
