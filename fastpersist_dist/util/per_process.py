"""One object per process id: state that a forked child must not share with its parent.

A child forked from a trainer (megatron's async caller, a test's rank) inherits
the parent's Python objects, but not its writer process (not the child's to
talk to as its own) nor the right to release its buffers: it makes its own.
"""

from __future__ import annotations

import os
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class PerProcess(Generic[T]):
    """``get()`` returns this process's instance of ``factory()``, made on first use."""

    def __init__(self, factory: Callable[[], T]):
        self._factory = factory
        self._by_pid: dict[int, T] = {}

    def get(self) -> T:
        """This process's instance."""
        pid = os.getpid()
        if pid not in self._by_pid:
            self._by_pid[pid] = self._factory()
        return self._by_pid[pid]

    def made(self) -> bool:
        """Whether this process's instance exists (without making it)."""
        return os.getpid() in self._by_pid
