"""Where the seconds of a save go, for the log: the profile behind docs/performance.md."""

from __future__ import annotations

import time


class Phases:
    """Seconds per named phase: consecutive steps (:meth:`mark`) or repeated ones (:meth:`add`)."""

    def __init__(self) -> None:
        self._last = time.perf_counter()
        self._spent: dict[str, float] = {}

    def mark(self, name: str) -> None:
        """Charge the time since the previous mark (or creation) to ``name``."""
        now = time.perf_counter()
        self.add(name, now - self._last)
        self._last = now

    def add(self, name: str, seconds: float) -> None:
        """Charge ``seconds`` to ``name``."""
        self._spent[name] = self._spent.get(name, 0.0) + seconds

    def __str__(self) -> str:
        total = sum(self._spent.values())
        return f"{total:.3f} s (" + ", ".join(f"{name} {t:.3f}" for name, t in self._spent.items()) + ")"
