"""The cyclic garbage collector is held off inside a save or a load and restored after, however they end."""

from __future__ import annotations

import gc
import threading

import pytest

from ckptd.client.collector import collector_paused, paused


@pytest.fixture(autouse=True)
def _collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    if was:
        gc.enable()
    else:
        gc.disable()


def test_paused_inside_and_enabled_again_after_nested_calls():
    with collector_paused():
        assert not gc.isenabled()
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer call still runs
    assert gc.isenabled()


def test_a_collector_the_caller_disabled_stays_disabled():
    gc.disable()
    with collector_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_an_error_inside_still_restores_the_collector():
    @paused
    def fails() -> None:
        assert not gc.isenabled()
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        fails()
    assert gc.isenabled()


def test_the_decorator_keeps_the_function_and_its_result():
    @paused
    def add(a: int, b: int = 1) -> int:
        """Adds."""
        return a + b

    assert add(2, b=3) == 5
    assert add.__name__ == "add" and add.__doc__ == "Adds."


def test_overlapping_calls_in_two_threads_enable_it_once_both_are_done():
    inside, leave_first, first_left = threading.Event(), threading.Event(), threading.Event()

    def first() -> None:
        with collector_paused():
            inside.set()
            leave_first.wait(10)
        first_left.set()

    t = threading.Thread(target=first)
    t.start()
    assert inside.wait(10)
    with collector_paused():
        leave_first.set()
        assert first_left.wait(10)
        assert not gc.isenabled()  # the first thread left; this call still runs
    t.join(10)
    assert gc.isenabled()
