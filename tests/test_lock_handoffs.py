"""The switch interval our background threads shorten while they move bytes, and give back."""

from __future__ import annotations

import sys
import threading

import pytest

from fastpersist_dist.util.lock_handoffs import BACKGROUND_SWITCH_S, SWITCH_ENV, prompt_lock_handoffs, wanted_interval

pytestmark = pytest.mark.engine


@pytest.fixture
def interval():
    """The test's own switch interval: 5 ms, the interpreter's default; whatever it was is set again after."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield
    sys.setswitchinterval(before)


def test_shortened_while_any_thread_is_inside_and_given_back_by_the_last(interval):
    inside, leave = threading.Event(), threading.Event()

    def other() -> None:
        with prompt_lock_handoffs():
            inside.set()
            leave.wait()

    thread = threading.Thread(target=other)
    with prompt_lock_handoffs():
        assert sys.getswitchinterval() == pytest.approx(BACKGROUND_SWITCH_S)
        thread.start()
        inside.wait()
    assert sys.getswitchinterval() == pytest.approx(BACKGROUND_SWITCH_S), "the other thread is still inside"
    leave.set()
    thread.join()
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_a_shorter_interval_is_kept_and_one_set_meanwhile_is_not_undone(interval):
    sys.setswitchinterval(0.0001)
    with prompt_lock_handoffs():
        assert sys.getswitchinterval() == pytest.approx(0.0001)
    assert sys.getswitchinterval() == pytest.approx(0.0001)
    sys.setswitchinterval(0.005)
    with prompt_lock_handoffs():
        sys.setswitchinterval(0.002)  # the training script's own choice, made while a copy ran
    assert sys.getswitchinterval() == pytest.approx(0.002)


def test_given_back_when_the_block_raises(interval):
    with pytest.raises(RuntimeError):
        with prompt_lock_handoffs():
            raise RuntimeError("a copy failed")
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_the_environment_sets_the_interval_or_leaves_it_alone(interval, monkeypatch):
    monkeypatch.setenv(SWITCH_ENV, "0.001")
    with prompt_lock_handoffs():
        assert sys.getswitchinterval() == pytest.approx(0.001)
    monkeypatch.setenv(SWITCH_ENV, "0")
    with prompt_lock_handoffs():
        assert sys.getswitchinterval() == pytest.approx(0.005)
    for wrong in ("fast", "-1", "nan"):
        monkeypatch.setenv(SWITCH_ENV, wrong)
        with pytest.raises(ValueError, match=f"{SWITCH_ENV}='{wrong}': a number of seconds, 0 or more"):
            wanted_interval()
