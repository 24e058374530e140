"""Ctrl-C that a finalizer would swallow, raised again where it counts.

Python raises a Ctrl-C's ``KeyboardInterrupt`` in whatever Python code runs next in the main thread. When that is a
callback run as an object dies (``weakref.finalize``, ``__del__``: the live-memory tracker's and the stage options'
bookkeeping run thousands of them during a profile or a step), the exception cannot leave it: Python prints
"Exception ignored in: <finalize object ...>" and carries on, and the Ctrl-C is lost (issue 40: ``fit`` and
``memsched train`` went on to the end). :func:`interrupts_delivered` installs, for its block, a SIGINT handler that
hands the signal to the handler it replaced (Python's own, or a notebook's), except inside such a callback: there it
sends the signal again a few milliseconds later, from a helper thread, to land in the code after it.
"""

import contextlib
import signal
import threading
import weakref

RETRY_S = 0.002  # seconds before a signal that arrived inside a finalizer is sent again
_CALLBACKS = {weakref.finalize.__call__.__code__}  # the frames of a callback run as an object dies
_NAMES = {"__del__"}


def _inside_finalizer(frame) -> bool:
    while frame is not None:
        if frame.f_code in _CALLBACKS or frame.f_code.co_name in _NAMES:
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def interrupts_delivered():
    """For the block: a Ctrl-C that arrives inside a finalizer is raised just after it instead of being lost.
    A no-op outside the main thread, and where SIGINT is ignored or left to the operating system's default."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    replaced = signal.getsignal(signal.SIGINT)
    if not callable(replaced):  # SIG_IGN, SIG_DFL or a handler not installed from Python: left alone
        yield
        return

    def handler(signum, frame):
        if _inside_finalizer(frame):
            threading.Timer(RETRY_S, signal.raise_signal, (signal.SIGINT,)).start()
            return
        replaced(signum, frame)

    signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, replaced)


@contextlib.contextmanager
def interrupts_deferred():
    """For the block: a Ctrl-C is held, and handed to the handler it replaced (raised) once the block ends. A
    no-op outside the main thread, and where SIGINT is ignored or left to the operating system's default."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    replaced = signal.getsignal(signal.SIGINT)
    if not callable(replaced):
        yield
        return
    held = []
    signal.signal(signal.SIGINT, lambda signum, frame: held.append((signum, frame)))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, replaced)
        if held:
            replaced(*held[0])
