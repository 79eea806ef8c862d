"""``FastPersistSaveStrategy``: megatron's save-strategy contract over our save engine.

Thin: the engine (``save_engine``) stages, plans, snapshots and writes; the
megatron-core adapter (``compat``) supplies the base class ``save()`` keeps
and the ``AsyncRequest`` type its async queue runs. ``save`` runs the very
same job synchronously.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Union

import torch.distributed as dist

from .. import compat
from ..engine.commit import keep_committed_aux_files
from ..engine.save import SaveEngine
from ..engine.staging import preprocessed
from ..engine.tiers.save import TieredSave
from ..engine.tiers.stand_in import persistent_for
from ..format.kinds import checkpoint_format as checkpoint_format_named
from ..storage.persistent import checkpoint_url, is_object_store
from ..util.config import TierConfig, WriteConfig


class FastPersistSaveStrategy(compat.SaveStrategyBase):
    """Writes each rank's share of the checkpoint through DeepSpeed DeepNVMe.

    Args:
        checkpoint_format: ``"torch_dist"`` (torch DCP files that megatron's
            stock loader and ``torch.distributed.checkpoint`` read, plus our
            checksum sidecar) or ``"fastpersist"`` (our native format, read by
            :class:`FastPersistLoadStrategy`, which a plain ``load()`` uses
            for both formats). Default: ``"torch_dist"`` on megatron-core
            0.17+, ``"fastpersist"`` on 0.16.
        write_common_pt: on megatron-core 0.19+ (whose ``save()`` hands the
            common state to the strategy), also commit it as ``common.pt``, so
            megatron-core 0.16 to 0.18 can load a torch_dist checkpoint too (the
            native format always has one: megatron's load() reads the common
            state before any strategy, from ``common.pt`` or through DCP). Older
            megatron-core's ``save()`` writes ``common.pt`` itself.
        config: a :class:`fastpersist_dist.util.config.WriteConfig`, or its knobs as
            keyword arguments.
        parallel_group: the ranks that can hold replicas of this rank's shards,
            as for megatron's ``FullyParallelSaveStrategyWrapper``: usually
            ``parallel_state.get_data_parallel_group(with_context_parallel=True)``.
            Shard lists are exchanged and the write plan made within it, so the
            metadata a rank sends and plans over does not grow with the world
            size; bytes are balanced over the group's ranks. None (default):
            the whole world is one group.
        local_dir: a tiered save (docs/tiers.md): each rank writes into its
            node's local tier at this path (the same on every node, each
            node's own storage), committed there; the checkpoint is then copied
            to the ``checkpoint_dir`` given to ``save()`` in the background and
            committed there last (``fastpersist_dist.wait_durable``).
        replicas: with ``local_dir``, how many other nodes also keep each
            node's files in their local tiers (any one lost node recoverable).
        keep_local: with ``local_dir``, the checkpoints each node keeps there.
        persistent: with ``local_dir``, False saves local checkpoints only
            (never copied to the persistent tier).
        tiers: a :class:`fastpersist_dist.TierConfig` instead of the four above.
    """

    def __init__(
        self,
        checkpoint_format: Optional[str] = None,
        config: Optional[WriteConfig] = None,
        write_common_pt: bool = False,
        parallel_group: Optional[dist.ProcessGroup] = None,
        local_dir: Optional[str] = None,
        replicas: int = TierConfig.replicas,
        keep_local: int = TierConfig.keep_local,
        persistent: bool = True,
        tiers: Optional[TierConfig] = None,
        **knobs: Any,
    ):
        fmt = checkpoint_format_named(checkpoint_format or compat.DEFAULT_FORMAT)
        super().__init__(fmt.backend, fmt.version)
        if config is not None and knobs:
            raise ValueError("pass either config= or individual knobs, not both")
        self.config = config or WriteConfig(**knobs)
        self.checkpoint_format = fmt.name
        if tiers is not None and local_dir is not None:
            raise ValueError("pass either tiers= or local_dir= (and its options), not both")
        self.tiers = tiers or (TierConfig(local_dir, replicas, keep_local, persistent) if local_dir is not None
                               else None)
        # megatron's load() reads the common state before any strategy: a tiered checkpoint's is in common.pt,
        # committed to the persistent directory with the local commit (its DCP files arrive there later)
        self.write_common_pt = write_common_pt or not fmt.dcp_readable or self.tiers is not None
        self._engine = SaveEngine(self.config, fmt, parallel_group)

    def load_ops(self, sharded_state_dict: Optional[dict] = None) -> None:
        """Load DeepSpeed's native ops and start this rank's writer process now (seconds, once per process).

        Call it at start-up: otherwise the first synchronous save loads the ops,
        and the first async save starts the writer process (without blocking,
        but it becomes durable that much later). Given the sharded state dict
        that async saves will save (then a collective, on every rank), it also
        plans them and allocates their snapshot buffer, which the first async
        save call would otherwise do while training waits.
        """
        self._engine.load_ops()
        if sharded_state_dict is not None:
            sharded, common = preprocessed(sharded_state_dict)
            self._engine.reserve_snapshot(compat.strategy_input(sharded, common, dist.get_rank()))

    @property
    def plan_reused(self) -> bool:
        """Whether the last save reused the cached write plan (same shard structure as the one before)."""
        return self._engine.plan_reused

    @property
    def can_handle_sharded_objects(self) -> bool:
        """ShardedObjects go into our data files too (checksummed like tensors)."""
        return True

    def save(self, sharded_state_dict: Any, checkpoint_dir: Union[str, Path]) -> None:
        """Synchronous save: tensors are written from where they are, without a snapshot copy.

        A ``checkpoint_dir`` that is a node's copy standing in for a persistent
        directory (``engine/tiers/stand_in.py``) saves to that directory; the
        files megatron-core itself wrote are read where it was given.
        """
        aux = self._aux_files(sharded_state_dict, checkpoint_dir)
        url = persistent_for(str(checkpoint_dir))
        self._engine.prepare(sharded_state_dict, url, False, aux, tier=self._tier(url)).run()

    def async_save(
        self, sharded_state_dict: Any, checkpoint_dir: Union[str, Path], async_strategy: Optional[str] = None,
    ) -> Any:
        """Snapshot every shard this rank writes; return the ``AsyncRequest`` that writes and commits it.

        ``async_strategy`` ("mcore" or "nvrx", megatron-core 0.17+) picks the
        request type of the queue that will run it.
        """
        aux = self._aux_files(sharded_state_dict, checkpoint_dir)
        request, unavailable = _request_type(async_strategy)
        # A queue this rank cannot serve is refused on every rank by the plan exchange, before anything is touched.
        url = persistent_for(str(checkpoint_dir))
        job = self._engine.prepare(sharded_state_dict, url, True, aux, refusal=unavailable, tier=self._tier(url))
        return request(job.write, job.args, job.finalize)

    def _tier(self, url: str) -> Optional[TieredSave]:
        """Collective where tiered: this save's copies."""
        if self.tiers is None:
            return None
        return TieredSave.start(self.tiers.for_checkpoint(url), url,
                                compat.megatron_config(self.backend, self.version))

    def _aux_files(self, sharded_state_dict: Any, checkpoint_dir: Union[str, Path]) -> dict[str, bytes]:
        """The files rank 0 commits beside the checkpoint (``common.pt``); a committed one there stays until then.

        First thing, before any collective: megatron-core <= 0.18's ``save()``
        has just rewritten ``common.pt`` of whatever checkpoint is committed in
        ``checkpoint_dir``; its bytes are taken for this save's commit and the
        committed file is put back, so a save refused from here on (its
        agreement needs rank 0) leaves that checkpoint whole.
        """
        rank = dist.get_rank()
        aux = compat.common_files(sharded_state_dict, checkpoint_url(checkpoint_dir), rank, self.write_common_pt)
        if rank == 0 and not is_object_store(checkpoint_dir):
            keep_committed_aux_files(checkpoint_url(checkpoint_dir), "rank 0")
        return aux


def _request_type(async_strategy: Optional[str]) -> tuple[Any, Optional[str]]:
    """The ``AsyncRequest`` class of the caller's queue, or why this rank has none.

    megatron raises its own error here (``ModuleNotFoundError`` for "nvrx"
    without nvidia-resiliency-ext) on each rank by itself; agreed instead, no
    rank returns before rank 0 has put back the committed ``common.pt``.
    """
    try:
        return compat.request_type(async_strategy), None
    except Exception as e:  # noqa: BLE001 - whatever megatron raises, every rank must refuse together
        return None, f"rank {dist.get_rank()}: async_strategy={async_strategy!r} cannot be served: {type(e).__name__}: {e}"
