"""A short interpreter switch interval while our background threads move a checkpoint's bytes.

The drain's copies and the replicas' transfers run on threads of the trainer's
process. They release the interpreter lock in every read, write, hash and send,
and need it back after each: hundreds of times per GiB. A training loop busy in
Python holds the lock until the switch interval (5 ms by default) makes it let
go, so the copy waits up to that long at every step. On the 2-core development
VM a checked 1 GiB copy from tmpfs to the disk took 0.84 s alone, 1.68 s beside
a thread looping in Python, and 0.75 to 0.81 s beside it with a 0.5 ms
interval; the loop ran at 0.85 to 0.95x of its speed alone during the copy
either way, so it pays for half as long.

While any such work runs in the process, the interval is ``BACKGROUND_SWITCH_S``
(unless already shorter); the last one to end restores the interval it found,
unless something else changed it meanwhile. Where no thread waits for the lock,
the interval changes nothing.
"""

from __future__ import annotations

import math
import sys
import threading
from contextlib import contextmanager
from typing import Iterator, Optional

BACKGROUND_SWITCH_S = 0.0005

_lock = threading.Lock()
_active = 0  # threads inside prompt_lock_handoffs()
_saved: Optional[float] = None  # the interval found by the first of them (None: it was not longer)


@contextmanager
def prompt_lock_handoffs() -> Iterator[None]:
    """Within the block (and any other thread's), a thread busy in Python hands the interpreter lock on within
    ``BACKGROUND_SWITCH_S`` to a thread of ours waiting for it."""
    global _active, _saved
    with _lock:
        if _active == 0 and sys.getswitchinterval() > BACKGROUND_SWITCH_S:
            _saved = sys.getswitchinterval()
            sys.setswitchinterval(BACKGROUND_SWITCH_S)
        _active += 1
    try:
        yield
    finally:
        with _lock:
            _active -= 1
            if _active == 0 and _saved is not None:
                if math.isclose(sys.getswitchinterval(), BACKGROUND_SWITCH_S):  # nobody else set it meanwhile
                    sys.setswitchinterval(_saved)
                _saved = None
