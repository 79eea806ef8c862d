"""torchtitan's checkpoints through FastPersist: its checkpoint manager with our DCP writer and reader.

torchtitan (0.3) builds its checkpoint manager from the ``checkpoint`` field of
the trainer's config (``config.checkpoint.build(...)`` makes the class that
config is nested in), as it does for its own ``TorchFTCheckpointManager``.
:class:`FastPersistCheckpointManager` is its ``CheckpointManager`` with the two
calls into DCP replaced: ``dcp_save`` writes through :class:`FastPersistWriter`
(``dcp.save``, or ``dcp.async_save`` for either ``async_mode``) and
``dcp_load`` reads through :class:`FastPersistReader`, every block checked.
Everything else stays torchtitan's: intervals, ``step-N`` folders, ``load_step``,
``keep_latest_k``, the last step's model-only or HF export (torchtitan's own
safetensors writer), resuming from the latest folder with a ``.metadata``
(ours commits it last). Checkpoints of torchtitan's own writer are read too
(without checksums: they have no index of ours)::

    from fastpersist_dist.torchtitan import FastPersistCheckpointManager

    config.checkpoint = FastPersistCheckpointManager.Config(enable=True, interval=500)
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Union

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse
from torchtitan.components.checkpointer import MODEL, AsyncMode, CheckpointManager
from torchtitan.tools.utils import GarbageCollection

from ..strategies.dcp_reader import FastPersistReader
from ..strategies.dcp_writer import FastPersistWriter
from ..util.config import WriteConfig


class FastPersistCheckpointManager(CheckpointManager):
    """torchtitan's ``CheckpointManager``, its DCP checkpoints written and read by FastPersist."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        write: WriteConfig = field(default_factory=WriteConfig)
        """How each rank streams its data file: :class:`fastpersist_dist.WriteConfig`'s knobs."""

    def __init__(self, config: Config, **components: Any) -> None:
        super().__init__(config, **components)
        self.write_config = config.write

    @torch.no_grad()
    def dcp_save(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: AsyncMode,
                 enable_garbage_collection: bool = False,
                 to_hf: bool = False) -> Union[Future, AsyncSaveResponse, None]:
        """``state_dict`` into ``checkpoint_id`` through our writer, in torchtitan's ``async_mode``; an HF export
        (``to_hf``) is torchtitan's own."""
        if to_hf:
            return super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        writer = FastPersistWriter(checkpoint_id, config=self.write_config)
        result: Union[Future, AsyncSaveResponse, None] = None
        if async_mode == AsyncMode.ASYNC:
            result = dcp.async_save(state_dict, storage_writer=writer, process_group=self.pg)
        elif async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            result = dcp.async_save(state_dict, storage_writer=writer, process_group=self.pg,
                                    async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=self.stager)
        else:
            dcp.save(state_dict, storage_writer=writer)
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return result

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool,
                 from_quantized: bool) -> None:
        """``checkpoint_id`` into ``state_dict`` through our reader, and the model from it; HF weights
        (``from_hf``) are read by torchtitan's own reader."""
        if from_hf:
            super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
            return
        dcp.load(state_dict, storage_reader=FastPersistReader(checkpoint_id))
        if MODEL in self.states:  # the model's entries are flattened into state_dict: load them into it
            self.states[MODEL].load_state_dict(state_dict)
