"""The cyclic garbage collector paused while a save's short, allocation-heavy steps run.

A save's metadata exchange and commit build many small objects, enough to set off
a full collection over the trainer's whole heap (megatron's, torch's, the
framework's objects): on the 2-core development VM one such collection took
0.48 s, on the local commit's thread beside training, which held that commit, and
so the checkpoint's durability, back by as much. Paused, the collection runs at
the next allocation after the step instead, where it would have run soon anyway.
The pause is process-wide and held while any thread is inside (``while_inside.py``),
since the trainer's thread and the background commits may pause at once: the
collector comes back when the last one ends, and only if it was on when the first
began.
"""

from __future__ import annotations

import gc
from typing import Callable, Optional

from .while_inside import WhileInside


def _pause() -> Optional[Callable[[], None]]:
    if not gc.isenabled():  # the program turned it off: it stays off
        return None
    gc.disable()
    return gc.enable


gc_paused = WhileInside(_pause)
"""``with gc_paused():`` no cyclic garbage collection within the block (nor in another thread meanwhile)."""
