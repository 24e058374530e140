"""Numba kernels: whether one runs without compiling (so which implementation fills a small table), and their
compilation out of Ctrl-C's way.

A numba kernel compiles on its first call on a machine (seconds: 9.5 CPU s for the first solve of a new install,
issue 40) and is loaded from numba's cache afterwards (milliseconds). A small table is filled in numpy
(solvers/rotor_numpy.py) until its kernel is ready, a large one by the kernel, compiled first by
:func:`compile_for`: a KeyboardInterrupt raised inside numba's compiler can leave its state half-built ("no compiled
object yet for <Library ...>" on every later call, issue 40), so the compiler runs in a helper thread that signals
never reach, and the caller's Ctrl-C is raised at once while the compilation completes behind it.
"""

import contextlib
import time

import numba

from solvers.limits import run_interruptibly

_READY = set()  # kernels known to run without compiling: compiled in this process, or found in numba's cache
_ABSENT = set()  # kernels not in numba's cache when it was read: ready once compiled in this process
NUMPY_SECONDS = 2.0  # seconds of numpy tables a process fills before it compiles the kernels (about 7 s, once)
_SPENT = [0.0]  # seconds this process has spent filling numpy tables


def ready(kernel) -> bool:
    """Whether ``kernel`` (a numba dispatcher made with ``cache=True``) has a compiled version in this process or
    one for its current source in numba's cache (its index names a signature)."""
    if kernel in _READY or kernel.overloads:
        _READY.add(kernel)
        return True
    if kernel in _ABSENT:  # numba's cache read once: not again on every call (a choice is asked per sub-chain)
        return False
    try:
        cached = bool(kernel._cache._cache_file._load_index())  # numba's own check: version and source stamp
    except (AttributeError, OSError, EOFError, ValueError):  # (numba's private layout changed, or a torn index)
        cached = False
    (_READY if cached else _ABSENT).add(kernel)
    return cached


def use_numpy(kernel, work: float, most: float) -> bool:
    """Whether a table of ``work`` inner steps is filled in numpy: at most ``most`` steps (about a second in
    numpy) while ``kernel`` would have to be compiled first, and until this process has spent
    :data:`NUMPY_SECONDS` in numpy tables (many small solves: a partition's, the tests'), the kernels' compilation
    then paying for itself."""
    return work <= most and _SPENT[0] < NUMPY_SECONDS and not ready(kernel)


@contextlib.contextmanager
def in_numpy():
    """Counts the block's seconds as spent filling numpy tables (:func:`use_numpy`)."""
    started = time.perf_counter()
    try:
        yield
    finally:
        _SPENT[0] += time.perf_counter() - started


def compile_for(kernel, *args) -> None:
    """Compile ``kernel`` for the types of ``args`` (or load it from numba's cache) without running it, in a
    helper thread: a Ctrl-C is raised here at once, and the compilation completes behind it (a later call waits
    for numba's compiler lock, then finds it compiled)."""
    signature = tuple(numba.typeof(arg) for arg in args)
    run_interruptibly(lambda: kernel.compile(signature), stop=lambda: None, grace=0.0)
