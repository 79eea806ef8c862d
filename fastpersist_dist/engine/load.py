"""Loads: fill requested shards from any saved sharding, verifying checksums. Version-agnostic.

:class:`LoadEngine` runs one load of a committed checkpoint (index, readers,
shared reads, the log line) for the strategy adapter, which hands megatron's
own checkpoints (no index of ours) to megatron's loader instead.

Each requested ShardedTensor is a box of its global tensor; every stored
extent that intersects it contributes exactly the intersecting elements, so a
checkpoint saved on 2 ranks loads whole on 1 rank or split on 4. Coverage is
counted: a request not fully covered by the checkpoint is an error, never
uninitialized memory (where ``allow_shape_mismatch`` lets a request reach past
the saved tensor, the rest is zero). Both formats load here: the index lists
every record's byte range, so a ``torch_dist`` record is read like a native
one, past its ``torch.save`` framing.
"""

from __future__ import annotations

import functools
import io
import logging
import math
import os
import pickle
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from typing import Any, Callable, Iterable, Optional, Union

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

from ..format.coverage import record_extents
from ..format.index_pages import Box, PagedIndex
from ..format.kinds import BY_CONTAINER, DCP_METADATA_FILE
from ..format.layout import Extent, intersect
from ..format.records import INDEX_FILE, KIND_OBJECT, KIND_TENSOR, CheckpointIndex, ShardRecord, dtype_from_name
from ..format.tiers import TierManifest
from ..storage.deepspeed_ops import aio_resources
from ..storage.reader import ShardReader
from ..storage.mounts import on_memory_filesystem
from ..storage.stream_reader import BoxRead, StreamReader, open_stream
from ..util import progress
from ..util.config import ReadConfig
from ..util.errors import FastPersistError
from .index_reader import check_markers, read_index, read_top
from .read_exchange import ReadExchange, comm_device, read_order, recovery_group, shared_load, sharing_group
from .tiers.copies import Copies, copies_for_load, tiers_manifest
from .tiers.retention import reading

logger = logging.getLogger(__name__)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def foreign_checkpoint(checkpoint_dir: str) -> bool:
    """A torch DCP checkpoint with no FastPersist index: megatron's own, or any DCP writer's."""
    return (not os.path.lexists(os.path.join(checkpoint_dir, INDEX_FILE))
            and os.path.lexists(os.path.join(checkpoint_dir, DCP_METADATA_FILE)))


class LoadEngine:
    """Loads of our checkpoints (either format) with one configuration, in any target sharding.

    ``group``: the ranks that share reads (``ReadConfig.share_reads``); None:
    the default process group, up to ``read_exchange.DEFAULT_GROUP_MAX_RANKS``
    ranks. Holds no per-load state: megatron keeps one loader for every load.
    """

    def __init__(self, config: ReadConfig, group: Optional[dist.ProcessGroup] = None):
        self.config = config
        self.group = group

    def load(self, sharded_state_dict: Any, checkpoint_dir: str) -> Any:
        """Replace every ShardedTensor/ShardedObject with its loaded value (tensors in place when possible).

        Collective where reads are shared (``share_reads`` not "off"): over
        the sharing group, and for a tiered checkpoint over the whole job where
        that group is not it (one gather of the bytes ranks need that only
        other nodes hold, mostly none: ``ReadExchange.recover``); a rank that
        fails tells the others, which raise naming it.
        """
        cfg = self.config
        start = time.perf_counter()
        rank = _rank()
        who = f"rank {rank}"
        group = sharing_group(cfg.share_reads != "off", self.group)
        recovery = None  # a tiered load's group for bytes only other nodes hold, where it is not ``group``
        first = group  # the others' next gather: a tiered load's first step (``recovery``), else the sharing group's
        with ExitStack() as closing:
            try:
                manifest, offline = tiers_manifest(checkpoint_dir, cfg.local_dir, who)
                recovery = recovery_group(cfg.share_reads != "off", group)
                if manifest is not None or cfg.local_dir is not None:  # alike on every rank (tiers_manifest)
                    _agree_on_checkpoint(manifest, checkpoint_dir, recovery if recovery is not None else group, who)
                if manifest is None:
                    recovery = None
                first = recovery if recovery is not None else group
                copies = _copies(checkpoint_dir, manifest, who, cfg.local_dir,
                                 first is None or dist.get_rank(first) == 0, offline)
                index_dir = checkpoint_dir if copies is None else copies.index_dir
                closing.enter_context(reading(None if copies is None else copies.local))
                index = read_index(index_dir, who, requested_boxes(nested_values(sharded_state_dict)))
                # Every record, read only where needed: to read for another rank what it cannot reach, to fetch a
                # whole data file from an object store.
                whole = functools.cache(lambda: read_index(index_dir, who))
                if copies is not None:
                    copies.locate(index.files, independent=cfg.share_reads == "off")
                reader = closing.enter_context(ShardReader(
                    checkpoint_dir, index, cfg.verify_checksums, who, *(() if copies is None else (
                        copies, copies.fetcher(whole, who)))))
                stream = open_stream(reader, lambda: aio_resources(cfg.aio), cfg.direct_io)
                loader = Loader(index, reader, rank, cfg.trust_objects, stream, whole)
                dict_list_map_inplace(loader.load, sharded_state_dict)
            except Exception as e:
                if first is not None:
                    shared_load(who).fail_together(e, first)  # the others raise naming this rank
                raise
            nearest = os.path.dirname(reader.path(min(index.files))) if index.files else index_dir
            share = cfg.share_reads == "on" or not on_memory_filesystem(nearest)
            # A tiered checkpoint: each file is read from the nearest intact copy: this node's, else a node's that
            # holds it (a rank there reads it and sends it), else the persistent tier (the rank needing it reads it).
            near = None if copies is None else copies.near()
            loader.run(cfg.read_threads, group, share, near, recovery)
        seconds = time.perf_counter() - start
        sent, received = loader.exchanged
        (logger.info if rank == 0 else logger.debug)(
            "fastpersist: rank %d loaded %.3f GiB from %s in %.2f s (%.2f GiB/s, checksums %s, %s%s)",
            rank, loader.nbytes / 2**30, checkpoint_dir, seconds, loader.nbytes / 2**30 / max(seconds, 1e-9),
            "verified" if cfg.verify_checksums else "not verified", "O_DIRECT aio" if stream else "pread",
            f"; read for other ranks {sent / 2**30:.3f} GiB, received {received / 2**30:.3f} GiB"
            if sent or received else "",
        )
        return sharded_state_dict

    def tensors_metadata(self, checkpoint_dir: str) -> dict[str, ShardedTensor]:
        """Global shape and dtype of every stored tensor, as data-less ShardedTensors (a paged index: no page read)."""
        who = f"rank {_rank()}"
        index_dir = self._index_dir(checkpoint_dir, who)
        top = read_top(index_dir, who)
        check_markers(index_dir, top, who)
        return tensors_metadata(top)

    def sharded_metadata(self, checkpoint_dir: str) -> dict[str, Any]:
        """Tensor metadata plus every stored ShardedObject, keyed by its unique key."""
        who = f"rank {_rank()}"
        return sharded_metadata(read_index(self._index_dir(checkpoint_dir, who), who))

    def _index_dir(self, checkpoint_dir: str, who: str) -> str:
        """Where the index of ``checkpoint_dir`` is read: this node's copy of a tiered checkpoint, or there."""
        manifest, offline = tiers_manifest(checkpoint_dir, self.config.local_dir, who)
        copies = _copies(checkpoint_dir, manifest, who, self.config.local_dir, offline=offline)
        return checkpoint_dir if copies is None else copies.index_dir


def _copies(checkpoint_dir: str, manifest: Optional[TierManifest], who: str, local_dir: Optional[str],
            check: bool = True, offline: bool = False) -> Optional[Copies]:
    """Where a load reads the tiered checkpoint with ``manifest``; None for one that is not tiered (no manifest).
    ``check``, ``offline``: see ``copies_for_load``."""
    return None if manifest is None else copies_for_load(checkpoint_dir, manifest, who, local_dir, check, offline)


def _agree_on_checkpoint(manifest: Optional[TierManifest], checkpoint_dir: str,
                         group: Optional[dist.ProcessGroup], who: str) -> None:
    """Collective over ``group`` (None: no other rank reads with this one): raise on every rank where the ranks'
    tiers manifests (None: not tiered) name different checkpoints, as where a node's copy is read while the
    persistent tier is out of reach and is not of the checkpoint the others read: one all-reduce of the
    checkpoint id's first 60 bits (0: not tiered), negated and not."""
    if group is None:
        return
    mine = 0 if manifest is None else int(manifest.checkpoint_id[:15], 16)
    ids = torch.tensor([mine, -mine], dtype=torch.int64, device=comm_device(group))
    dist.all_reduce(ids, op=dist.ReduceOp.MAX, group=group)
    if ids[0].item() != -ids[1].item():
        mine_is = "not tiered" if manifest is None else manifest.checkpoint_id
        raise FastPersistError(f"{who}: the ranks of this load read different checkpoints of {checkpoint_dir} (this "
                               f"rank: {mine_is}): with the persistent tier out of reach, some node's copy is of "
                               "another save into that directory; load once the persistent tier answers")


class Loader:
    """One load: the index grouped by key, and an open reader.

    :meth:`load` plans the reads of one requested item (use it with megatron's
    ``dict_list_map_inplace``); :meth:`run` executes them.
    """

    def __init__(self, index: CheckpointIndex, reader: ShardReader, rank: int, trust_objects: bool,
                 stream: Optional[StreamReader] = None, whole: Optional[Callable[[], CheckpointIndex]] = None):
        self.reader = reader
        self.whole = whole or (lambda: index)  # every record: ``index`` holds those of this rank's requests
        self.stream = stream  # O_DIRECT aio reads of the tensors, where open_stream chose them
        self.rank = rank
        self.trust_objects = trust_objects
        self.fmt = BY_CONTAINER[index.container]
        self.tensors: dict[str, list[ShardRecord]] = defaultdict(list)
        self.objects: dict[tuple[str, tuple[int, ...]], ShardRecord] = {}
        for r in index.records:
            if r.kind == KIND_TENSOR:
                self.tensors[r.key].append(r)
            else:
                self.objects[(r.key, r.global_offset)] = r
        self.nbytes = 0
        self.exchanged = (0, 0)  # bytes sent to and received from other ranks by the last run()
        # Reads are planned per request, then run in file order (see run()).
        self.reads: list[BoxRead] = []

    def load(self, item: Any) -> Any:
        """The loaded value of a ShardedTensor (reads planned) or ShardedObject (read now); others unchanged."""
        if isinstance(item, ShardedTensor):
            return self.load_tensor(item)
        if isinstance(item, ShardedObject):
            return self.load_object(item)
        return item

    def load_tensor(self, sh: ShardedTensor) -> torch.Tensor:
        """Plan the reads filling ``sh``; returns its destination tensor (``sh.data`` when it fits)."""
        where = f"rank {self.rank}: tensor '{sh.key}' (global offset {tuple(sh.global_offset)})"
        records = self.tensors.get(sh.key)
        if not records:
            raise FastPersistError(f"{where} is not in checkpoint {self.reader.dir}")
        saved_shape = records[0].global_shape
        if saved_shape != tuple(sh.global_shape) and not sh.allow_shape_mismatch:
            raise FastPersistError(
                f"{where}: requested global shape {tuple(sh.global_shape)} but the checkpoint holds {saved_shape}"
            )
        dest = sh.data
        if not isinstance(dest, torch.Tensor) or tuple(dest.shape) != tuple(sh.local_shape):
            dest = torch.empty(sh.local_shape, dtype=sh.dtype)
        box_dest = dest.detach()  # loads in place, also into parameters that require grad
        for _ in range(sh.prepend_axis_num):
            box_dest = box_dest.unsqueeze(0)
        req_off = tuple(sh.global_offset)
        req_shape = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
        covered = 0
        for rec in records:
            for ext in record_extents(rec):
                inter = intersect(req_off, req_shape, ext.offset, ext.shape)
                if inter is None:
                    continue
                off, shape = inter
                view = box_dest[tuple(slice(o - r, o - r + n) for o, r, n in zip(off, req_off, shape))]
                self.reads.append(BoxRead(rec, ext, tuple(o - e for o, e in zip(off, ext.offset)), shape, view))
                covered += math.prod(shape)
        wanted = intersect(req_off, req_shape, (0,) * len(saved_shape), saved_shape)
        expected = 0 if wanted is None else math.prod(wanted[1])
        if covered != expected:
            kind = "overlapping shards in the index" if covered > expected else "shards missing from the checkpoint"
            raise FastPersistError(f"{where}: {covered} of {expected} elements found ({kind})")
        if expected < math.prod(req_shape):  # allow_shape_mismatch: no stale or uninitialized elements
            dest.detach().zero_()
        self.nbytes += covered * dtype_from_name(records[0].dtype).itemsize
        return dest

    def run(self, threads: int, group: Optional[dist.ProcessGroup] = None, share: bool = True,
            near: Optional[frozenset[str]] = None, recovery: Optional[dist.ProcessGroup] = None) -> None:
        """Execute the planned reads sorted by file and offset: sequential I/O, whatever the dict order.

        With a stream, large aio reads into its locked double buffer (see
        storage/stream_reader.py); else with ``threads`` > 1, consecutive preads
        run on a small pool, so one read's I/O overlaps another's checksum and copy.
        With ``group`` (collective over it), bytes several ranks need are read
        once and sent to the others (see read_exchange.py), unless a rank of
        the group passes ``share=False``. ``near``: a tiered checkpoint's files
        on this node; within ``group`` a file is read by a rank of a node that
        holds it, the rank needing it reading it from a farther copy (the
        persistent tier) only where no rank holds it near. Where ``recovery``
        is given (the whole job, where ``group`` is not; collective over it),
        the bytes of files of which no copy opens here are first read for this
        rank by ranks of the job that can, if any rank needs such bytes.
        """
        reads, self.reads = sorted(self.reads, key=read_order), []
        shown = progress.task("load", sum(r.dest.nbytes for r in reads))
        exchange = None
        block = self.reader.index.checksum_block_bytes if self.reader.verify else None
        if near is not None and recovery is not None:
            exchange = ReadExchange.recover(reads, recovery, block, self.reader.who, self.reader.reachable,
                                            self._extent)
        if exchange is None and group is not None:
            exchange = ReadExchange.start(reads, group, block, self.reader.who, share, near, self._extent)
        if exchange is not None:
            reads = exchange.reads
            self.exchanged = (exchange.sent_bytes, exchange.received_bytes)

        def placed(dest: torch.Tensor) -> None:
            if exchange is None or not exchange.placed(dest):
                shown.add(dest.nbytes)

        if exchange is None:
            self._read(reads, threads, placed)
        else:
            exchange.complete(lambda: self._read(reads, threads, placed), shown.add)

    def _extent(self, file: str, offset: int, byte_start: int) -> tuple[ShardRecord, Extent]:
        """The record at ``offset`` of ``file`` and its extent starting at ``byte_start``: one this rank reads for
        another rank without requesting it, found in the whole index, which the reader then reads by."""
        index = self.whole()
        self.reader.widen(index)
        record = next(r for r in index.records if r.file == file and r.offset == offset)
        return record, next(e for e in record_extents(record) if e.byte_start == byte_start)

    def _read(self, reads: list[BoxRead], threads: int, placed: Callable[[torch.Tensor], None]) -> None:
        """Run ``reads`` (in this order) with the stream or preads; ``placed(dest)`` after each is in place."""
        if self.stream is not None:
            self.stream.run(reads, placed)
            return
        if threads <= 1 or len(reads) < 2:
            for r in reads:
                self.reader.read_box(r.record, r.extent, r.sub_off, r.sub_shape, r.dest)
                placed(r.dest)
            return
        self.reader.open_all({r.record.file for r in reads})
        with ThreadPoolExecutor(threads, thread_name_prefix="fastpersist-read") as pool:
            for r, done in [(r, pool.submit(self.reader.read_box, r.record, r.extent, r.sub_off, r.sub_shape, r.dest))
                            for r in reads]:
                done.result()
                placed(r.dest)

    def load_object(self, sh: ShardedObject) -> Any:
        """Read, verify and unpickle a ShardedObject (``weights_only`` unless objects are trusted)."""
        where = f"rank {self.rank}: object '{sh.unique_key}'"
        rec = self.objects.get((sh.key, tuple(sh.global_offset)))
        if rec is None:
            raise FastPersistError(f"{where} is not in checkpoint {self.reader.dir}")
        payload = self.reader.read_object(rec)
        self.nbytes += len(payload)
        try:
            loaded = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=not self.trust_objects)
        except pickle.UnpicklingError as e:
            raise FastPersistError(
                f"{where} needs types outside torch's weights_only allow-list ({e}); for a checkpoint you trust, "
                "use FastPersistLoadStrategy(trust_objects=True) or torch.serialization.add_safe_globals"
            ) from e
        return self.fmt.object_from_loaded(loaded, where)


def requested_boxes(items: Iterable[Any]) -> dict[str, list[Box]]:
    """Key -> the global boxes requested (an object: its cell), to read only the index pages meeting them."""
    wants: dict[str, list[Box]] = defaultdict(list)
    for item in items:
        if isinstance(item, ShardedTensor):
            low = tuple(item.global_offset)
            shape = (1,) * item.prepend_axis_num + tuple(item.local_shape)
            wants[item.key].append((low, tuple(o + n for o, n in zip(low, shape))))
        elif isinstance(item, ShardedObject):
            low = tuple(item.global_offset)
            wants[item.key].append((low, tuple(o + 1 for o in low)))
    return dict(wants)


def tensors_metadata(index: Union[CheckpointIndex, PagedIndex]) -> dict[str, ShardedTensor]:
    """Global shape and dtype of every stored tensor, as data-less ShardedTensors (of a paged index: its top level)."""
    if isinstance(index, PagedIndex):
        shapes = {k: (e.dtype, e.global_shape) for k, e in index.keys.items() if e.kind == KIND_TENSOR}
    else:
        shapes = {r.key: (r.dtype, r.global_shape) for r in index.records if r.kind == KIND_TENSOR}
    return {key: ShardedTensor.from_rank_offsets(key, torch.empty(shape, dtype=dtype_from_name(dtype), device="meta"))
            .without_data() for key, (dtype, shape) in shapes.items()}


def sharded_metadata(index: CheckpointIndex) -> dict[str, Any]:
    """Tensor metadata plus every stored ShardedObject, keyed by its unique key."""
    out: dict[str, Any] = dict(tensors_metadata(index))
    for r in index.records:
        if r.kind == KIND_OBJECT:
            obj = ShardedObject(r.key, None, r.global_shape, r.global_offset, 0)
            out[obj.unique_key] = obj
    return out
