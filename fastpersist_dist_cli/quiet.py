"""Known harmless warnings of our dependencies, hidden in the processes of our own commands.

Installed by ``fastpersist-dist`` only, never by ``import fastpersist_dist``: a
user's training script keeps every warning its dependencies give. Each entry
is true but says nothing about checkpointing, and each is repeated per process.
"""

from __future__ import annotations

import logging
import os
import re
import warnings

# (category, start of the message)
WARNINGS: tuple[tuple[type[Warning], str], ...] = (
    # megatron-core's import on hosts without them: four per process, its fallbacks are used
    (UserWarning, "Transformer Engine and Apex are not installed"),
    # megatron-core 0.19's import without absl-py: it logs through `logging` instead
    (UserWarning, "absl.logging is not installed"),
    # torch.distributed.checkpoint's old name, called by megatron's torch_dist loader
    (FutureWarning, "`load_state_dict` is deprecated"),
)
# Start of messages of DeepSpeed's logger
DEEPSPEED_MESSAGES: tuple[str, ...] = (
    "Setting accelerator to CPU",  # every process on a host without a GPU
    "Offloading to NVMe can generate heavy write traffic",  # advice about ZeRO offload, once per writer
)


class _DropKnown(logging.Filter):
    """Drops DeepSpeed's records that start with one of ``DEEPSPEED_MESSAGES``."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(DEEPSPEED_MESSAGES)


def quiet_dependencies() -> None:
    """Hide the known warnings in this process and in the processes it spawns (``PYTHONWARNINGS``).

    Forked ranks inherit the filters; processes that megatron spawns (a
    multiprocessing manager per rank for torch_dist) start a fresh interpreter
    and read ``PYTHONWARNINGS``. DeepSpeed logs through a logger with its own
    handler, so a filter on that logger (kept when DeepSpeed configures it on
    import) drops its records.
    """
    for category, start in WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(start), category=category)
    entries = [f"ignore:{start}:{category.__name__}" for category, start in WARNINGS]
    inherited = [e for e in os.environ.get("PYTHONWARNINGS", "").split(",") if e]
    os.environ["PYTHONWARNINGS"] = ",".join(inherited + [e for e in entries if e not in inherited])
    deepspeed = logging.getLogger("DeepSpeed")
    if not any(isinstance(f, _DropKnown) for f in deepspeed.filters):
        deepspeed.addFilter(_DropKnown())
