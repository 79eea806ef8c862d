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
(``FASTPERSIST_BACKGROUND_SWITCH_S`` in the environment, if set; 0 leaves the
interval alone), unless already shorter; the last one to end restores the
interval it found, unless something else changed it meanwhile. Where no thread
waits for the lock, the interval changes nothing.
"""

from __future__ import annotations

import math
import os
import sys
from typing import Callable, Optional

from .while_inside import WhileInside

BACKGROUND_SWITCH_S = 0.0005
SWITCH_ENV = "FASTPERSIST_BACKGROUND_SWITCH_S"


def wanted_interval() -> float:
    """The switch interval while bytes move: ``FASTPERSIST_BACKGROUND_SWITCH_S`` if set (0: the interpreter's
    is left alone), else ``BACKGROUND_SWITCH_S``."""
    text = os.environ.get(SWITCH_ENV, "")
    try:
        want = float(text) if text else BACKGROUND_SWITCH_S
    except ValueError:
        want = -1.0
    if not want >= 0:
        raise ValueError(f"{SWITCH_ENV}={text!r}: a number of seconds, 0 or more, is wanted")
    return want


def _shorten() -> Optional[Callable[[], None]]:
    """The switch interval set to the one wanted where that is shorter; how to give the one found back, unless
    something else changed it meanwhile."""
    want, found = wanted_interval(), sys.getswitchinterval()
    if not want or found <= want:
        return None
    sys.setswitchinterval(want)

    def restore() -> None:
        if math.isclose(sys.getswitchinterval(), want):  # nobody else set it meanwhile
            sys.setswitchinterval(found)

    return restore


prompt_lock_handoffs = WhileInside(_shorten)
"""``with prompt_lock_handoffs():`` within the block (and any other thread's), a thread busy in Python hands the
interpreter lock on within the switch interval wanted (:func:`wanted_interval`) to a thread of ours waiting for
it."""
