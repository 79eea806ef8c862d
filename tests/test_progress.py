"""The progress display: its line, its rate limits, and silence without a display."""

from __future__ import annotations

import io

import pytest

from fastpersist_dist.util import progress
from fastpersist_dist.util.progress import LOG_INTERVAL_S, TTY_INTERVAL_S, ProgressLine, format_eta, format_progress

pytestmark = pytest.mark.engine

GiB = 2**30


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_format_progress_line():
    assert format_progress("bench: fastpersist 1/3 save", GiB // 2, 2 * GiB, 2.0) == (
        "bench: fastpersist 1/3 save: 0.50 of 2.00 GiB (25%), 0.25 GiB/s, ETA 0:06"
    )
    assert format_progress("load", 0, GiB, 0.0).endswith("0.00 GiB/s, ETA ?")
    assert format_eta(59.6) == "1:00" and format_eta(3725) == "1:02:05" and format_eta(0) == "0:00"


def test_plain_lines_are_rate_limited_and_short_tasks_print_nothing():
    out, clock = io.StringIO(), Clock()
    display = ProgressLine(out, tty=False, clock=clock)
    quick = display.start("write", 4 * GiB)
    for _ in range(4):
        clock.now += LOG_INTERVAL_S / 10
        quick.add(GiB)
    assert out.getvalue() == ""  # done within one interval
    slow = display.start("write", 100 * GiB)
    for _ in range(40):  # 1 GiB every LOG_INTERVAL_S / 4
        clock.now += LOG_INTERVAL_S / 4
        slow.add(GiB)
    lines = out.getvalue().splitlines()
    assert len(lines) == 10 and lines[0].startswith("write: 4.00 of 100.00 GiB (4%)")
    assert "\r" not in out.getvalue()


def test_terminal_line_is_rewritten_and_cleared_when_done():
    out, clock = io.StringIO(), Clock()
    display = ProgressLine(out, label="verify: checksummed", tty=True, clock=clock)
    task = display.start("checksum", 3 * GiB)
    clock.now += TTY_INTERVAL_S
    task.add(GiB)
    clock.now += TTY_INTERVAL_S / 2
    task.add(GiB)  # within the interval: not shown
    assert out.getvalue() == "\r\x1b[Kverify: checksummed: 1.00 of 3.00 GiB (33%), 5.00 GiB/s, ETA 0:00"
    task.add(GiB)
    assert out.getvalue().endswith("\r\x1b[K")  # done: the line is gone


def test_silent_without_a_display_and_restored_after_shown():
    assert progress.task("write", GiB) is progress.task("load", 1)  # the shared no-op task
    out, clock = io.StringIO(), Clock()
    with progress.shown(ProgressLine(out, tty=False, clock=clock)):
        task = progress.task("write", 2 * GiB)
        clock.now += LOG_INTERVAL_S
        task.add(GiB)
    assert out.getvalue().startswith("write: 1.00 of 2.00 GiB")
    assert progress.task("write", GiB) is progress.task("load", 1)
