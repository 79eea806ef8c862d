"""Known harmless warnings of our dependencies, hidden in the processes of our own commands.

Installed first thing by ``import fastpersist_dist`` where ``QUIET_ENV`` is set:
the ``fastpersist-dist`` command sets it, and the processes it starts (a rank's
writer) inherit it. A user's training script keeps every warning its
dependencies give. Each entry
is true but says nothing about checkpointing, and each is repeated per process.
"""

from __future__ import annotations

import logging
import os
import re
import warnings

QUIET_ENV = "FASTPERSIST_QUIET"

# (category, start of the message; no ',' or ':', which PYTHONWARNINGS cannot hold)
WARNINGS: tuple[tuple[type[Warning], str], ...] = (
    # megatron-core's import on hosts without them: four per process, its fallbacks are used
    (UserWarning, "Transformer Engine and Apex are not installed"),
    # megatron-core 0.19's import without absl-py: it logs through `logging` instead
    (UserWarning, "absl.logging is not installed"),
    # torch.distributed.checkpoint's old name, called by megatron's torch_dist loader
    (FutureWarning, "`load_state_dict` is deprecated"),
    # megatron 0.19's torch_dist loader reads each rank's part with no_dist=True and positional arguments
    (UserWarning, "torch.distributed is disabled"),
    (UserWarning, "The argument order of load has been changed"),
)
# logger -> start of its messages
LOGGED: dict[str, tuple[str, ...]] = {
    "DeepSpeed": (
        "Setting accelerator to CPU",  # every process on a host without a GPU
        "Offloading to NVMe can generate heavy write traffic",  # advice about ZeRO offload, once per writer
    ),
    # a CPU-only torch on a host with a CUDA toolkit, when DeepSpeed's op builder imports it: our ops are CPU ops
    "torch.utils.cpp_extension": ("No CUDA runtime is found",),
    # megatron 0.19: its own load() calls its deprecated load_common, its own save() its "mcore" async path
    "megatron.core.dist_checkpointing.strategies.common": ("load_common is deprecated",),
    "megatron.core.dist_checkpointing.strategies.torch": ("MCore's async save is deprecated",),
}


class _DropKnown(logging.Filter):
    """Drops the records whose message starts with one of ``starts``."""

    def __init__(self, starts: tuple[str, ...]):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.starts)


def quiet_dependencies() -> None:
    """Hide the known warnings in this process and in the processes it spawns (``PYTHONWARNINGS``).

    Forked ranks inherit the filters; processes that megatron spawns (a
    multiprocessing manager per rank for torch_dist) start a fresh interpreter
    and read ``PYTHONWARNINGS``; our own writer processes see ``QUIET_ENV``
    and call this before importing any dependency. DeepSpeed and torch log through loggers with
    their own handlers, so a filter on each logger (kept when the library
    configures it on import) drops the known records.
    """
    os.environ[QUIET_ENV] = "1"
    for category, start in WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(start), category=category)
    entries = [f"ignore:{start}:{category.__name__}" for category, start in WARNINGS]
    inherited = [e for e in os.environ.get("PYTHONWARNINGS", "").split(",") if e]
    os.environ["PYTHONWARNINGS"] = ",".join(inherited + [e for e in entries if e not in inherited])
    for name, starts in LOGGED.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropKnown) for f in logger.filters):
            logger.addFilter(_DropKnown(starts))
