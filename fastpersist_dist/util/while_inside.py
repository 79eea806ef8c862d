"""A process-wide setting held while any thread is inside a block: made by the first in, undone by the last out.

The trainer's thread and our background threads (commits, copies, replicas) enter
such blocks at overlapping times; a setting saved and restored by each block on its
own would be undone by whichever leaves first.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterator, Optional


class WhileInside:
    """Call it for the context manager. ``make`` changes the setting and returns how to undo it (None where it
    changed nothing)."""

    def __init__(self, make: Callable[[], Optional[Callable[[], None]]]) -> None:
        self._make = make
        self._lock = threading.Lock()
        self._inside = 0
        self._undo: Optional[Callable[[], None]] = None

    @contextmanager
    def __call__(self) -> Iterator[None]:
        with self._lock:
            if self._inside == 0:
                self._undo = self._make()
            self._inside += 1
        try:
            yield
        finally:
            with self._lock:
                self._inside -= 1
                if self._inside == 0 and self._undo is not None:
                    self._undo()
                    self._undo = None
