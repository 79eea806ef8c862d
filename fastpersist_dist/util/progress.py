"""Progress of long operations (bytes done of a total) for the command line's display.

The engine reports at item granularity (a record written, a read done, a record
checksummed) through :func:`task`. Nothing is shown unless a command installed
a display with :func:`shown` (only ``fastpersist-dist`` does): a library user
sees nothing and pays one global lookup per item.

On a terminal the display is one line on stderr, rewritten at most every
``TTY_INTERVAL_S`` and cleared when the operation ends; elsewhere (CI logs) it
prints a plain line at most every ``LOG_INTERVAL_S``, so short operations print
nothing.
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Optional, TextIO

GiB = 2**30
TTY_INTERVAL_S = 0.2
LOG_INTERVAL_S = 5.0


def format_eta(seconds: float) -> str:
    """``m:ss`` or ``h:mm:ss``."""
    whole = int(seconds + 0.5)
    hours, rest = divmod(whole, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def format_progress(label: str, done: int, total: int, elapsed: float) -> str:
    """One progress line: bytes done of total, percent, GiB/s so far and the ETA at that rate."""
    pct = 100.0 * done / total if total else 100.0
    rate = done / elapsed if elapsed > 0 else 0.0
    eta = format_eta((total - done) / rate) if rate > 0 else "?"
    return f"{label}: {done / GiB:.2f} of {total / GiB:.2f} GiB ({pct:.0f}%), {rate / GiB:.2f} GiB/s, ETA {eta}"


class Task:
    """Bytes done of one operation; :meth:`add` after each item (a no-op without a display)."""

    def add(self, nbytes: int) -> None:
        """Count ``nbytes`` more as done."""


_NO_TASK = Task()


class ProgressLine:
    """Shows tasks on ``stream``: an updating line on a terminal, rate-limited plain lines elsewhere."""

    def __init__(self, stream: TextIO = sys.stderr, label: str = "", tty: Optional[bool] = None,
                 clock: Callable[[], float] = time.monotonic):
        self.stream = stream
        self.label = label  # what is running, e.g. "fastpersist 1/3 save"; set by the command as it goes
        self.tty = stream.isatty() if tty is None else tty
        self.interval = TTY_INTERVAL_S if self.tty else LOG_INTERVAL_S
        self.clock = clock
        self._shown = False  # a terminal line is on screen

    def start(self, what: str, total: int) -> Task:
        """A task of ``total`` bytes, shown under the display's label, else as ``what``."""
        return _LiveTask(self, self.label or what, total)

    def show(self, text: str) -> None:
        """Print ``text``: over the previous line on a terminal, as a new line elsewhere."""
        if self.tty:
            self.stream.write(f"\r\x1b[K{text}")
            self._shown = True
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def clear(self) -> None:
        """Remove the terminal line, so that what is printed next starts on a clean line."""
        if self._shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._shown = False


class _LiveTask(Task):
    def __init__(self, display: ProgressLine, label: str, total: int):
        self.display = display
        self.label = label
        self.total = total
        self.done = 0
        self.start = display.clock()
        self.next_at = self.start + display.interval

    def add(self, nbytes: int) -> None:
        self.done += nbytes
        if self.done >= self.total:
            self.display.clear()
            return
        now = self.display.clock()
        if now >= self.next_at:
            self.next_at = now + self.display.interval
            self.display.show(format_progress(self.label, self.done, self.total, now - self.start))


_display: Optional[ProgressLine] = None


def task(what: str, total: int) -> Task:
    """A task of ``total`` bytes on the installed display, or one that shows nothing."""
    return _NO_TASK if _display is None else _display.start(what, total)


def install(display: Optional[ProgressLine]) -> Optional[ProgressLine]:
    """Show the tasks of this process (and of processes it forks) on ``display``; returns the previous one."""
    global _display
    previous, _display = _display, display
    return previous


@contextmanager
def shown(display: ProgressLine) -> Iterator[ProgressLine]:
    """Show the tasks started inside the block on ``display``."""
    previous = install(display)
    try:
        yield display
    finally:
        display.clear()
        install(previous)
