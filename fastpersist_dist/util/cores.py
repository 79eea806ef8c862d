"""How many cores one rank may count on: what decides whether work runs beside the write or on its own thread."""

from __future__ import annotations

import os


def cores_per_local_rank() -> float:
    """The cores this process may use, shared with the other ranks of its node (torchrun's LOCAL_WORLD_SIZE)."""
    return len(os.sched_getaffinity(0)) / max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
