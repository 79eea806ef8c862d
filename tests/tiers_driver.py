"""One rank of a tiered-checkpoint run under torchrun: ``python -m tests.tiers_driver ACTION ARGS_JSON``.

``tests/test_tiers.py`` starts torchrun once per node (``--nnodes 2 --node-rank N``), each in a mount
namespace of its own where the same local-tier path is that node's own directory. Actions:

* ``save``: for each of ``saves``, save the state of its ``step`` (``rows`` rows of ``w`` per rank) into its
  ``checkpoint`` (``local_dir``, ``replicas``, ``persistent``, ``keep_local``, ``async`` as it says), leave a file
  ``rank<N>`` in the directory ``returned`` (if given) once the call is over, then optionally wait until it is
  durable (``wait_durable``) or until this rank's copies are done (``wait_copies``); then, where ``remove`` is
  given (``checkpoint``, ``gate``), rank 0 leaves the file ``gate``.waiting, waits for the file ``gate``, asks for
  the removal of ``checkpoint`` (``remove_checkpoint``) and waits for this process's copies and removals
  (``RESULT``'s ``removal``);
* ``load``: load ``checkpoint`` into a fresh state of ``step`` (with ``loader_local_dir`` and ``share_reads`` if
  given; ``whole``: every rank asks for all of ``w``; ``node_group``: the loader's ``parallel_group`` is the
  ranks of this rank's node) and compare; ``audit``: also report the load's listings of the checkpoint's
  directory and the files it opened there (``persistent_io``: Python's audit events, no code replaced);
  ``loads``: several loads in turn in the same processes, each a dict of options over the common ones
  (``RESULT``'s ``loads``); ``direct``: our load strategy's ``load()`` called directly, not through megatron's
  ``load()``. Each load reports the data files this rank fetched from an object store (``fetched``: the log lines)
  and, where it failed, the traceback (``trace``).

``msc``: turn on megatron-core's multi-storage-client support (``msc://`` checkpoint paths, ``--enable-msc``).
Prints one line ``RESULT {...}``: what this rank saw, the warnings and errors it logged, the data files its drain
copied (``drained``), the replicas it received (``received``) and the advice it gave about a local tier
in memory (``advice``).
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import sys
import time
import traceback
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor

from fastpersist_dist import (
    ASYNC_SAVE_KWARGS,
    AsyncSaveQueue,
    FastPersistLoadStrategy,
    FastPersistSaveStrategy,
    TierConfig,
    checkpoint_state,
    remove_checkpoint,
    wait_copies,
    wait_durable,
)
from fastpersist_dist.util.events import COPIED, FETCHED, event_of, field_of

from .helpers import empty_like_request, global_tensor, sharded


def state(rank: int, world: int, step: int, rows: int = 64) -> dict:
    """``rows`` rows of ``w`` per rank (made from the step and the rank only: a large state costs no rank the
    whole tensor), ``b`` replicated: what every scenario saves (``step``: the values)."""
    local = torch.randn((rows, 256), generator=torch.Generator().manual_seed(step * 1000 + rank))
    return {"w": ShardedTensor.from_rank_offsets("w", local, (0, rank, world)),
            "b": sharded("b", global_tensor("b", (1000,), salt=step), rank, world, None)}


def whole_state(rank: int, world: int, step: int, rows: int = 64) -> dict:
    """The whole of :func:`state`'s tensors, as a rank that asks for all of them loads it (a resharding)."""
    full = torch.cat([state(r, world, step, rows)["w"].data for r in range(world)])
    return {"w": ShardedTensor.from_rank_offsets("w", full, replica_id=rank), "b": state(rank, world, step, rows)["b"]}


def _save(rank: int, world: int, args: dict) -> dict:
    ckpt = args["checkpoint"]
    if rank == 0 and "://" not in ckpt:
        os.makedirs(ckpt, exist_ok=True)
    dist.barrier()
    tiers = TierConfig(args["local_dir"], replicas=args.get("replicas", 0), persistent=args.get("persistent", True),
                       keep_local=args.get("keep_local", 2))
    strategy = FastPersistSaveStrategy(args.get("format"), tiers=tiers)
    sd = state(rank, world, args["step"], args.get("rows", 64))
    saved: dict = {}
    try:
        if args.get("async"):
            queue = AsyncSaveQueue()
            queue.schedule(dist_checkpointing.save(sd, ckpt, sharded_strategy=strategy, async_sharded_save=True,
                                                   **ASYNC_SAVE_KWARGS))
            queue.close()
        else:
            dist_checkpointing.save(sd, ckpt, sharded_strategy=strategy)
    except Exception as e:  # noqa: BLE001 - reported to the test
        saved["error"] = f"{type(e).__name__}: {e}"
    if args.get("returned"):  # a directory the test watches: this rank's save() call is over
        open(os.path.join(args["returned"], f"rank{rank}"), "w").close()
    saved["state_after_save"] = _state(ckpt)
    if args.get("wait_durable"):
        saved["durable"] = wait_durable(ckpt, timeout=args.get("timeout", 120))
    if args.get("wait_copies"):
        saved["copied"] = wait_copies(timeout=args.get("timeout", 120))
    saved["state"] = _state(ckpt)
    return saved


def _state(ckpt: str) -> str:
    """The checkpoint's state, or why it cannot be asked now (an object store down)."""
    try:
        return str(checkpoint_state(ckpt))
    except Exception as e:  # noqa: BLE001 - reported to the test
        return f"{type(e).__name__}: {e}"


def _remove(rank: int, args: dict) -> dict:
    """Rank 0: leave the file ``gate``.waiting, then, once the file ``gate`` exists, ask for the removal of
    ``checkpoint`` and wait for this process's copies and removals; whether they ended within ``timeout``."""
    if rank != 0:
        return {}
    open(f"{args['gate']}.waiting", "w").close()
    end = time.monotonic() + args.get("timeout", 120)
    while not os.path.exists(args["gate"]):
        if time.monotonic() > end:
            return {"error": f"no {args['gate']}"}
        time.sleep(0.01)
    remove_checkpoint(args["checkpoint"])
    return {"copied": wait_copies(timeout=args.get("timeout", 120))}


def _node_group(rank: int, world: int) -> dist.ProcessGroup:
    """The ranks of this rank's node, as a process group (made on every rank, for every node, in order)."""
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    groups = [dist.new_group(list(range(first, first + per_node))) for first in range(0, world, per_node)]
    return groups[rank // per_node]


def _load(rank: int, world: int, args: dict) -> dict:
    ckpt = args["checkpoint"]
    rows = args.get("rows", 64)
    want = whole_state(rank, world, args["step"], rows) if args.get("whole") else state(rank, world, args["step"], rows)
    request = {k: empty_like_request(v) for k, v in want.items()}
    loader = FastPersistLoadStrategy(local_dir=args.get("loader_local_dir"),
                                     share_reads=args.get("share_reads", "auto"),
                                     parallel_group=_node_group(rank, world) if args.get("node_group") else None)
    out: dict = {"fetched": []}
    seen: list[str] = []
    if args.get("audit"):
        sys.addaudithook(_persistent_io(ckpt, seen))
    fetched = logging.Handler(logging.INFO)  # the files this rank fetched from an object store
    fetched.addFilter(lambda record: event_of(record) == FETCHED)
    fetched.emit = lambda record: out["fetched"].append(field_of(record, "file"))  # type: ignore[method-assign]
    logging.getLogger("fastpersist_dist").addHandler(fetched)
    started = time.perf_counter()
    try:
        if args.get("direct"):
            loaded = loader.load(request, ckpt)
        else:
            loaded = dist_checkpointing.load(request, ckpt, sharded_strategy=loader)
    except Exception as e:  # noqa: BLE001 - reported to the test
        out["error"] = f"{type(e).__name__}: {e}"
        out["trace"] = traceback.format_exc()
    else:
        out["equal"] = all(torch.equal(loaded[k], v.data) for k, v in want.items())
    finally:
        logging.getLogger("fastpersist_dist").removeHandler(fetched)
    out["seconds"] = time.perf_counter() - started
    out["persistent_io"] = list(seen)
    seen.append("")  # the hook, which stays installed, records no more
    out["state"] = _state(ckpt)
    return out


def _persistent_io(ckpt: str, seen: list[str]):
    """An audit hook appending to ``seen`` "list NAME" for each listing of ``ckpt`` (or a directory in it) and
    "open NAME" for each file opened there, names relative to ``ckpt``, until ``seen`` ends with ""."""
    top = os.path.realpath(ckpt)

    def hook(event: str, args: tuple) -> None:
        if event not in ("os.listdir", "os.scandir", "open") or (seen and seen[-1] == "") or not args:
            return
        path = args[0]
        if not isinstance(path, (str, bytes, os.PathLike)):  # a descriptor (os.listdir(fd), open(fd))
            return
        path = os.path.realpath(os.fsdecode(path) or ".")
        if path == top or path.startswith(top + os.sep):
            seen.append(f"{'open' if event == 'open' else 'list'} {os.path.relpath(path, top)}")

    return hook


def main(action: str, args: dict) -> dict:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # tests/nodes.py asks a hung rank for its stacks
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s %(message)s")
    warnings: list[str] = []
    warned: list[tuple[Optional[str], Optional[str]]] = []  # each warning's event and the file it names, if any

    def warning(record: logging.LogRecord) -> None:
        warnings.append(record.getMessage())
        warned.append((event_of(record), field_of(record, "file")))

    handler = logging.Handler(logging.WARNING)
    handler.emit = warning  # type: ignore[method-assign]
    logging.getLogger("fastpersist_dist").addHandler(handler)
    # What this rank logged of: when its drain copied its data file, the replicas it received, and the advice
    # about a local tier in memory without huge pages
    kept: dict[str, list[str]] = {"drained": [], "received": [], "advice": []}
    copied = logging.Handler(logging.DEBUG)
    copied.addFilter(lambda record: event_of(record) == COPIED)
    copied.emit = lambda record: kept["drained"].append(field_of(record, "file"))  # type: ignore[method-assign]
    logging.getLogger("fastpersist_dist.engine.tiers.drain").setLevel(logging.DEBUG)
    logging.getLogger("fastpersist_dist.engine.tiers.drain").addHandler(copied)
    for name, key, says in (("engine.tiers.replicate", "received", " received the replica "),
                            ("engine.tiers.save", "advice", " without huge pages")):
        logging.getLogger(f"fastpersist_dist.{name}").setLevel(logging.DEBUG)
        lines = logging.Handler(logging.DEBUG)
        lines.addFilter(lambda record, says=says: says in record.getMessage())
        lines.emit = lambda record, key=key: kept[key].append(record.getMessage())  # type: ignore[method-assign]
        logging.getLogger(f"fastpersist_dist.{name}").addHandler(lines)
    if args.get("msc"):
        from megatron.core.msc_utils import MultiStorageClientFeature

        MultiStorageClientFeature.enable()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    result: dict = {"rank": rank, "node": os.environ["GROUP_RANK"], "warnings": warnings, "warned": warned, **kept}
    if action == "save":
        result["saves"] = [_save(rank, world, one) for one in args["saves"]]
        if args.get("remove"):
            result["removal"] = _remove(rank, args["remove"])
    elif "loads" in args:  # several loads in turn, each with its own options over the common ones
        result["loads"] = [_load(rank, world, {**args, **one}) for one in args["loads"]]
    else:
        result.update(_load(rank, world, args))
    if not args.get("exit_with_copies"):  # else the process's exit waits for them, after destroy_process_group
        wait_copies()
    _meet_at_exit(world, args.get("meet_timeout", 30))
    dist.destroy_process_group()
    return result


def _meet_at_exit(world: int, timeout: float = 30) -> None:
    """Wait until every rank is done, through the rendezvous store: no rank closes its connections while a peer
    still uses them. Not a gloo barrier: after the S3 outage test, one rank's final barrier here at times never
    completed while its peer's did. Raises after ``timeout`` s (a killed node never comes): the node fails."""
    store = dist.distributed_c10d._get_default_store()
    store.add("tiers-driver-done", 1)
    end = time.monotonic() + timeout
    while store.add("tiers-driver-done", 0) < world:
        if time.monotonic() > end:
            raise RuntimeError(f"not every rank finished within {timeout:.0f} s of this one")
        time.sleep(0.05)


if __name__ == "__main__":
    result = main(sys.argv[1], json.loads(sys.argv[2]))
    sys.stdout.write(f"RESULT {json.dumps(result)}\n")  # one write: see tests/megatron_lm_driver.py
    sys.stdout.flush()
