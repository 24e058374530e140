"""The replay loop the chain, offload and graph simulators share, and the records it returns.

A simulator is any object with three methods: ``initial_state()``, ``step(state, op) -> (new state, peak
bytes, seconds)`` (a ``ValueError`` for an operation that cannot run) and ``check_complete(state)`` (a
:class:`ScheduleError` for a schedule that ends too early). Its states have a ``memory`` field in bytes.
:func:`run` replays a whole schedule with one.
"""

from dataclasses import dataclass
from typing import NamedTuple

from planner.errors import MemschedError


class ScheduleError(MemschedError):
    """A schedule that cannot run: an operation's inputs are missing, or a backward is missing or repeated."""


class Step(NamedTuple):
    """One replayed operation: when it ran and the memory around it (bytes, seconds)."""

    index: int
    op: object  # planner.ops.Op or GraphOp
    start: float
    end: float
    memory_before: int
    peak: int
    memory_after: int


@dataclass(frozen=True)
class SimResult:
    """The simulator's verdict on a schedule."""

    peak_bytes: int
    time: float
    timeline: tuple  # of Step


def backward_peak(memory_before: int, input_gradient: int, bwd_tmp: int, memory_after: int) -> int:
    """The peak of ``B i``: the resident bytes, ``δ_i`` and the stage's backward temporaries, and at least the
    memory after it."""
    return max(memory_before + input_gradient + bwd_tmp, memory_after)


def replay(state, step, schedule, label: str) -> tuple:
    """``(final state, SimResult)``: ``step(state, op) -> (new state, peak bytes, seconds)`` applied to every
    operation in turn (the state has a ``memory`` field in bytes). A ``ValueError`` from ``step`` becomes a
    :class:`ScheduleError` prefixed by ``label`` (formatted with ``index``) and the operation."""
    clock, peak, timeline = 0.0, state.memory, []
    for index, op in enumerate(schedule):
        try:
            new, op_peak, seconds = step(state, op)
        except ValueError as exc:
            raise ScheduleError(f"{label.format(index=index)} ({op}): {exc}") from None
        timeline.append(Step(index, op, clock, clock + seconds, state.memory, op_peak, new.memory))
        clock += seconds
        peak = max(peak, op_peak)
        state = new
    return state, SimResult(peak_bytes=peak, time=clock, timeline=tuple(timeline))


def run(simulator, schedule, label: str) -> tuple:
    """``(final state, SimResult)`` of ``schedule`` replayed from ``simulator.initial_state()`` by
    ``simulator.step``, then checked by ``simulator.check_complete``; an invalid schedule raises
    :class:`ScheduleError` naming the operation (``label``, as for :func:`replay`) or what is missing."""
    state, result = replay(simulator.initial_state(), simulator.step, schedule, label)
    simulator.check_complete(state)
    return state, result
