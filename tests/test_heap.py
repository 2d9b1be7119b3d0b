"""The garbage collector paused in dpcs's passes (`dpcs_compiler.heap`)."""

from __future__ import annotations

import gc
import threading

import pytest

from dpcs_compiler.heap import paused_collector
from dpcs_compiler.passes.infra import AnalysisCache, PassContext


@pytest.fixture(autouse=True)
def collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


def test_the_collector_is_off_in_the_block_and_on_after_it():
    with paused_collector():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_nested_blocks_turn_it_on_only_at_the_outermost_end():
    with paused_collector():
        with paused_collector():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer pass still runs
    assert gc.isenabled()


def test_it_comes_back_on_when_the_block_raises():
    with pytest.raises(ValueError, match="in a pass"), paused_collector():
        raise ValueError("in a pass")
    assert gc.isenabled()


def test_a_collector_the_user_turned_off_stays_off():
    gc.disable()
    with paused_collector():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_cycles_made_in_the_block_are_collected_after_it():
    class Node:
        pass

    def make_cycle() -> Node:
        a, b = Node(), Node()
        a.other, b.other = b, a
        return a

    import weakref

    with paused_collector():
        ref = weakref.ref(make_cycle())
        assert ref() is not None  # nothing collects it automatically here
        gc.collect()  # an explicit collection still runs
        assert ref() is None
        ref = weakref.ref(make_cycle())
    assert ref() is not None
    gc.collect()
    assert ref() is None


def test_blocks_in_two_threads_leave_it_on_when_both_end():
    inside, release = threading.Barrier(2, timeout=60), threading.Event()  # fails, never hangs

    def other() -> None:
        with paused_collector():
            inside.wait()
            release.wait(timeout=60)

    thread = threading.Thread(target=other)
    thread.start()
    with paused_collector():
        inside.wait()
    assert not gc.isenabled()  # the other thread's block still runs
    release.set()
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert gc.isenabled()


def test_a_pass_runs_with_the_collector_paused():
    ctx = PassContext(plan=None, analyses=AnalysisCache())
    with ctx.instrumented("stage", "pass"):
        assert not gc.isenabled()
    assert gc.isenabled()
