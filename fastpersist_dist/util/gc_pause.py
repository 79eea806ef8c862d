"""The cyclic garbage collector paused while a save's short, allocation-heavy steps run.

A save's metadata exchange and commit build many small objects, enough to set off
a full collection over the trainer's whole heap (megatron's, torch's, the
framework's objects): on the 2-core development VM one such collection took
0.48 s, on the local commit's thread beside training, which held that commit, and
so the checkpoint's durability, back by as much. Paused, the collection runs at
the next allocation after the step instead, where it would have run soon anyway.
The pause is process-wide and counted, since the trainer's thread and the
background commits may pause at once: the collector comes back when the last
one ends, and only if it was on when the first began.
"""

from __future__ import annotations

import gc
import threading
from contextlib import contextmanager
from typing import Iterator

_lock = threading.Lock()
_active = 0
_was_enabled = False


@contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection within the block (nor in another thread meanwhile)."""
    global _active, _was_enabled
    with _lock:
        if _active == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _active += 1
    try:
        yield
    finally:
        with _lock:
            _active -= 1
            if _active == 0 and _was_enabled:
                gc.enable()
