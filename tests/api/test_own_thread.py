"""mmsparse's own thread (runtime/own_thread.py): work runs there, never on the caller's thread, and work already
on it runs in place (a kept mask's build that asks for scratch would otherwise wait on itself)."""

from __future__ import annotations

import threading

import pytest

from mmsparse.runtime.own_thread import on_own_thread


def test_work_runs_on_one_thread_of_its_own_and_nests_in_place():
    caller = threading.get_ident()
    outer, inner = on_own_thread(lambda: (threading.get_ident(), on_own_thread(threading.get_ident)))
    assert outer != caller and inner == outer
    assert on_own_thread(threading.get_ident) == outer  # one worker for the process


def test_an_exception_reaches_the_caller():
    def fail():
        raise ValueError("from the own thread")

    with pytest.raises(ValueError, match="from the own thread"):
        on_own_thread(fail)
