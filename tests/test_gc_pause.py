"""The garbage collector paused around a save's allocation-heavy steps, on any thread, and given back."""

from __future__ import annotations

import gc
import threading

import pytest

from fastpersist_dist.util.gc_pause import gc_paused

pytestmark = pytest.mark.engine


@pytest.fixture
def collector_on():
    """The collector on for the test, as it was after."""
    before = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if before else gc.disable)()


def test_paused_while_any_thread_is_inside_and_back_with_the_last(collector_on):
    """The trainer's save and a background commit overlapping: whichever ends first, the collector stays off
    until the other ends too, then comes back."""
    inside, leave = threading.Event(), threading.Event()

    def commit() -> None:
        with gc_paused():
            inside.set()
            leave.wait()

    thread = threading.Thread(target=commit)
    with gc_paused():
        assert not gc.isenabled()
        thread.start()
        inside.wait()
    assert not gc.isenabled(), "the other thread is still inside"
    leave.set()
    thread.join()
    assert gc.isenabled()


def test_a_collector_the_program_turned_off_stays_off(collector_on):
    gc.disable()
    with gc_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()
