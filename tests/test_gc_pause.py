"""The garbage collector paused around a save's allocation-heavy steps, and given back.

Blocks on several threads at once share the pause as they share the switch interval (``util/while_inside.py``;
tests/test_lock_handoffs.py overlaps two threads).
"""

from __future__ import annotations

import gc

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


def test_paused_inside_and_back_after(collector_on):
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():  # the commit's steps inside the save call's, say
            assert not gc.isenabled()
        assert not gc.isenabled(), "the outer block is still inside"
    assert gc.isenabled()


def test_a_collector_the_program_turned_off_stays_off(collector_on):
    gc.disable()
    with gc_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()
