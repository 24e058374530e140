"""Time limits and Ctrl-C for every solver: one deadline per solve, tables filled in interruptible chunks.

* :class:`Deadline`: one clock per solve; each phase gets what is left, and :class:`TimeLimitReached` says a
  phase stopped half-way and how far it got (:func:`enough_time` rounds the limit to suggest).
* :func:`fill_by_spans`: numba tables filled in chunks of a few milliseconds, so that a Ctrl-C is raised
  between two kernel calls (never inside numba's boxing of a result).
* :func:`run_interruptibly`: a native solver (HiGHS, CP-SAT) in a worker thread, stopped within a second on
  Ctrl-C. docs/solvers.md explains why.
"""

import math
import threading
import time

from planner.errors import MemschedError

CHUNK_WORK = 2_000_000  # inner-loop steps per kernel call: a few milliseconds
STOP_GRACE = 1.0  # seconds a stopped solver is waited for after Ctrl-C


class TimeLimitReached(MemschedError):
    """A phase of a solve stopped at the deadline: ``what`` it was doing (e.g. "building the model"), the fraction
    ``done`` of it (0..1), the seconds of the solve ``elapsed`` so far, and the seconds the solve would have
    needed to finish the phase at the rate seen (:class:`Progress`). The entry point turns it into its own
    one-line message (or falls back on a schedule it already has)."""

    def __init__(self, what: str, done: float, elapsed: float, needed: float = None):
        super().__init__(f"the time limit ran out while {what} ({100 * done:.0f}% done after {elapsed:.1f} s)")
        self.what, self.done, self.elapsed = what, done, elapsed
        self._needed = needed

    def needed(self) -> float:
        """Seconds from the start of the solve to the end of the phase, at the rate seen so far."""
        return self._needed if self._needed is not None else self.elapsed / max(self.done, 0.02)


class Progress:
    """A phase of ``total`` units of work under ``deadline``: :meth:`step` after each piece raises
    :class:`TimeLimitReached` once the deadline has passed. The rate is measured from the end of the first
    piece, which may include a one-off cost (numba compiling a kernel, the first time on a machine)."""

    def __init__(self, deadline, what: str, total: float):
        self.deadline, self.what, self.total = deadline, what, max(total, 1e-300)
        self.base = None  # (seconds of the solve, work done) after the first piece

    def step(self, done: float) -> None:
        deadline = self.deadline
        if deadline is None or deadline.seconds is None:
            return
        now = deadline.elapsed()
        if self.base is None:  # the rate is measured from here: one more piece, even past the deadline
            self.base = (now, done)
            return
        if now < deadline.seconds:
            return
        needed = None
        since, before = self.base
        if done > before and now > since:
            needed = now + (now - since) / (done - before) * (self.total - done)
        raise TimeLimitReached(self.what, done / self.total, now, needed)


class Deadline:
    """One clock for a whole solve: ``seconds`` from its creation (None: no limit).

    Pass it down to every phase; each takes what is :meth:`left`. A phase
    that can stop half-way steps a :class:`Progress` between its pieces.
    """

    def __init__(self, seconds=None):
        self.seconds = None if seconds is None else float(seconds)
        self.started = time.perf_counter()

    @classmethod
    def of(cls, limit) -> "Deadline":
        """``limit`` itself when it is a Deadline, else a new one of ``limit`` seconds (None: none)."""
        return limit if isinstance(limit, Deadline) else cls(limit)

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def left(self):
        """Seconds left (negative once passed), or None without a limit."""
        return None if self.seconds is None else self.seconds - self.elapsed()

    def exclude(self, call):
        """``call()``, the seconds it takes left out of the deadline: a numba kernel compiled (or loaded from
        numba's cache) on its first call in a process, a one-off cost that no time limit is meant to cover."""
        began = time.perf_counter()
        outcome = call()
        self.started += time.perf_counter() - began
        return outcome

    def passed(self, margin: float = 0.0) -> bool:
        """True when less than ``margin`` seconds are left."""
        left = self.left()
        return left is not None and left <= margin


def enough_time(seconds: float) -> int:
    """A round time limit (1, 2, 5, 10, 20, 50, ... s) of at least ``seconds``: what to suggest to the user."""
    for power in range(0, 7):
        for step in (1, 2, 5):
            if step * 10**power >= seconds:
                return step * 10**power
    return int(math.ceil(seconds))


def run_interruptibly(run, stop, grace: float = STOP_GRACE):
    """``run()`` (a native solver call that releases the GIL) in a daemon thread while this thread waits, so that
    Ctrl-C is raised here at once: then ``stop()`` asks the solver to stop, it is waited for at most ``grace``
    seconds and the :class:`KeyboardInterrupt` re-raised. Outside the main thread ``run()`` is called directly."""
    if threading.current_thread() is not threading.main_thread():
        return run()
    outcome = {}

    def target():
        try:
            outcome["value"] = run()
        except BaseException as exc:  # handed to the waiting thread
            outcome["error"] = exc

    worker = threading.Thread(target=target, name="memsched-solver", daemon=True)
    worker.start()
    try:
        while worker.is_alive():
            worker.join(0.05)
    except KeyboardInterrupt:
        stop()
        until = time.monotonic() + grace
        while worker.is_alive() and time.monotonic() < until:
            try:
                worker.join(max(0.0, until - time.monotonic()))
            except KeyboardInterrupt:  # a second Ctrl-C: already stopping
                pass
        raise
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def fill_by_spans(length: int, work, fill, deadline: Deadline = None, what: str = "filling a table",
                  warm_up=None) -> None:
    """Fill a table of sub-chains span by span: ``fill(first, last)`` (a kernel filling spans ``first..last-1``
    in place) over consecutive ranges of spans ``1..length``, each worth about :data:`CHUNK_WORK` inner steps
    (``work(span)`` being one span's), so that a Ctrl-C is raised between two kernel calls; ``deadline`` is
    checked between them (:class:`TimeLimitReached` naming ``what``). ``warm_up()`` runs first, its seconds
    left out of the deadline (:meth:`Deadline.exclude`): the kernels' compilation, and whatever they fill
    before the spans."""
    if warm_up is not None:
        if deadline is None:
            warm_up()
        else:
            deadline.exclude(warm_up)
    progress = Progress(deadline, what, sum(work(span) for span in range(1, length + 1)))
    first, total, done = 1, 0, 0
    for span in range(1, length + 1):
        total += work(span)
        if total >= CHUNK_WORK or span == length:
            fill(first, span + 1)
            done += total
            if span < length:
                progress.step(done)
            first, total = span + 1, 0
