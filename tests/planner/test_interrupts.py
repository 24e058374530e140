"""A Ctrl-C that arrives while a finalizer runs (planner/interrupts.py, issue 40 item 4): Python prints "Exception
ignored" and loses it; inside :func:`interrupts_delivered` (fit, the command line) it is raised just after."""

import signal
import sys
import time
import weakref

import pytest

from planner.execute.live_memory import LiveMemoryTracker
from planner.interrupts import interrupts_deferred, interrupts_delivered


@pytest.fixture
def python_handler():
    """Python's own SIGINT handler (a test runner may have replaced it), restored after."""
    before = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


class Dies:
    pass


def interrupt_inside_a_finalizer():
    """An object whose finalizer receives SIGINT as it runs; then 0.5 s of ordinary work: whether the Ctrl-C was
    raised there."""
    weakref.finalize(Dies(), signal.raise_signal, signal.SIGINT)  # the object dies at once: the callback runs
    try:
        until = time.monotonic() + 0.5
        while time.monotonic() < until:
            time.sleep(0.001)
    except KeyboardInterrupt:
        return True
    return False


def test_python_loses_a_ctrl_c_that_lands_in_a_finalizer(python_handler, monkeypatch):
    ignored = []
    monkeypatch.setattr(sys, "unraisablehook", ignored.append)  # "Exception ignored in: <finalize object ...>"
    assert not interrupt_inside_a_finalizer()
    assert [type(u.exc_value) for u in ignored] == [KeyboardInterrupt]


def test_inside_the_block_it_is_raised_just_after(python_handler):
    with interrupts_delivered():
        assert interrupt_inside_a_finalizer()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler before, put back


def test_a_ctrl_c_in_the_trackers_finalizer_stops_fit(python_handler, monkeypatch):
    """The live-memory tracker's finalizers run thousands of times in a profile: a Ctrl-C landing in one was lost
    and fit returned as if nothing was pressed."""
    from fixtures.hf_gpt2 import build
    from planner import fit

    released = LiveMemoryTracker._released
    sent = []

    def interrupted_once(self, key):
        if not sent:
            sent.append(True)
            signal.raise_signal(signal.SIGINT)
        released(self, key)

    monkeypatch.setattr(LiveMemoryTracker, "_released", interrupted_once)
    model, batch = build(batch=2)
    with pytest.raises(KeyboardInterrupt):
        fit(model, batch, "60%", warmup=0, repeats=1, progress=False)
    assert sent


def test_a_deferred_ctrl_c_is_raised_when_the_block_ends(python_handler):
    """Around a capture by torch.export, where a KeyboardInterrupt raised in Python called from C++ ended the
    process (status 134)."""
    finished = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_deferred():
            signal.raise_signal(signal.SIGINT)
            time.sleep(0.01)
            finished.append(True)  # the block ran to its end
    assert finished and signal.getsignal(signal.SIGINT) is signal.default_int_handler
