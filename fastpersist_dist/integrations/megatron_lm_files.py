"""Megatron-LM's own calls on a tiered checkpoint's directory, kept off the persistent tier while it saves.

Megatron-LM hands each checkpoint to megatron-core's ``dist_checkpointing.save()``,
which looks into the checkpoint directory on rank 0 before any strategy runs
(on ``msc://`` an S3 LIST) and writes ``metadata.json`` there at finalize;
then Megatron-LM writes its tracker file (``latest_checkpointed_iteration.txt``)
beside it. With tiers that directory is the persistent tier: a tier that cannot
be reached (an object store down) would fail the save before and after our
strategy, and stop training, though the save itself needs only the local tiers.
:func:`local_first` replaces Megatron-LM's two names for those calls in its
``megatron.training.checkpointing``:

* ``dist_checkpointing`` (:class:`LocalFirstCheckpointing`): ``save()`` with our
  tiered strategy gives megatron-core this node's copy of the checkpoint
  (``engine/tiers/stand_in.py``); the strategy saves to the persistent directory,
  ``metadata.json`` with it. All else is megatron-core's.
* ``maybe_msc`` (:class:`DeferredWrites`; Megatron-LM 0.19's name for its file
  calls, where object stores are supported): a file written through it that
  cannot be written now is written in the background once the copies of the
  checkpoints saved before are done, tried again for ``retry_s``
  (``tiers/background.after_copies``): the tracker never names a checkpoint
  before that checkpoint's files are there. Reads are Megatron-LM's own.
"""

from __future__ import annotations

import io
import logging
from types import ModuleType
from typing import Any, Callable, Optional

from ..engine.tiers.background import after_copies
from ..engine.tiers.stand_in import stand_in
from ..strategies.fastpersist_save import FastPersistSaveStrategy
from ..util.config import TierConfig
from ..util.events import UNREACHABLE, event

logger = logging.getLogger(__name__)

SAVE_SEAM = "dist_checkpointing"  # Megatron-LM's name for megatron-core's module, whose save() it calls
FILES_SEAM = "maybe_msc"  # Megatron-LM 0.19's name for its file calls (0.17/0.18 have none: no object stores)


def _tiers_of(strategy: Any) -> Optional[TierConfig]:
    """The tiers of our strategy, or of ours inside megatron's fully-parallel wrapper; None for any other."""
    ours = getattr(strategy, "base_strategy", strategy)
    return ours.tiers if isinstance(ours, FastPersistSaveStrategy) else None


class LocalFirstCheckpointing:
    """Stands in for megatron-core's ``dist_checkpointing`` module in Megatron-LM's checkpointing module."""

    def __init__(self, module: ModuleType):
        self._module = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    def save(self, sharded_state_dict: Any, checkpoint_dir: Any, sharded_strategy: Any = None, *args: Any,
             **kwargs: Any) -> Any:
        """megatron-core's ``save()``, given this node's copy of the checkpoint where the strategy is tiered."""
        tiers = _tiers_of(sharded_strategy)
        if tiers is not None:
            checkpoint_dir = stand_in(tiers.local_dir, str(checkpoint_dir))
        return self._module.save(sharded_state_dict, checkpoint_dir, sharded_strategy, *args, **kwargs)


class DeferredWrites:
    """Stands in for megatron-core's ``maybe_msc`` in Megatron-LM's checkpointing module: writes that fail now are
    made later (see the module)."""

    def __init__(self, files: Any, retry_s: float):
        self._files = files
        self._retry_s = retry_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self._files, name)

    def open(self, path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if "w" not in mode:
            return self._files.open(path, mode, *args, **kwargs)

        def write(data: Any) -> None:
            with self._files.open(path, mode, *args, **kwargs) as f:
                f.write(data)

        return _WrittenOnClose(write, str(path), self._retry_s, binary="b" in mode)


class _WrittenOnClose(io.StringIO):
    """What Megatron-LM writes, held until closed, then written; where that fails, written later."""

    def __init__(self, write: Callable[[Any], None], path: str, retry_s: float, binary: bool):
        super().__init__()
        self._write, self._path, self._retry_s, self._binary = write, path, retry_s, binary
        self._bytes = io.BytesIO()

    def write(self, data: Any) -> int:  # type: ignore[override]
        return self._bytes.write(data) if self._binary else super().write(data)

    def close(self) -> None:
        if not self.closed:
            data = self._bytes.getvalue() if self._binary else self.getvalue()
            try:
                self._write(data)
            except Exception as e:  # noqa: BLE001 - the store's own errors (multi-storage-client: RuntimeError)
                logger.warning("fastpersist: cannot write %s now (%s); writing it once the checkpoints saved before "
                               "are copied to the persistent tier (for %.0f s)", self._path, e, self._retry_s,
                               extra=event(UNREACHABLE, file=self._path))
                after_copies(lambda: self._write(data), self._path, self._retry_s)
        super().close()


def local_first(original: Callable[[str], Any], tiers: Optional[TierConfig]) -> dict[str, Any]:
    """What Megatron-LM's names for these calls are set to: for tiered saves the stand-ins above, else its own
    objects again; ``original(name)``: Megatron-LM's own object of that name (None where its version has none)."""
    save, files = original(SAVE_SEAM), original(FILES_SEAM)
    if tiers is None:
        return {name: own for name, own in ((SAVE_SEAM, save), (FILES_SEAM, files)) if own is not None}
    replacements: dict[str, Any] = {SAVE_SEAM: LocalFirstCheckpointing(save)}
    if files is not None:
        replacements[FILES_SEAM] = DeferredWrites(files, tiers.retry_s)
    return replacements
