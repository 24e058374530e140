"""What every solver hands back before the simulator judges it, the errors of a solver that found no schedule,
and the parameters a solver is given."""

import inspect
from dataclasses import dataclass, field
from typing import Optional

from planner.errors import MemschedError
from planner.transfer import Transfer
from solvers.limits import TimeLimitReached, enough_time


@dataclass(frozen=True)
class Solution:
    """A schedule (tuple of :class:`planner.ops.Op` or :class:`planner.ops.GraphOp`), the parameters that produced
    it, whether it is proven optimal, and the relative gap to the solver's bound on the time (0 when optimal; None
    when unknown). Offload solvers add the copy ``transfer`` channel the schedule is judged over and, for the exact
    model, its objective ``model_time`` in seconds (the plan's simulated time is at most that) and its ``stats``."""

    schedule: tuple
    params: dict = field(default_factory=dict)
    optimal: bool = False
    gap: Optional[float] = None
    transfer: Optional[Transfer] = None
    model_time: Optional[float] = None
    stats: dict = field(default_factory=dict)


class NoSchedule(MemschedError):
    """The solver found no schedule: the budget is infeasible (``proven``) or the time limit ran out first
    (``enough``: seconds of time limit to suggest instead, when known)."""

    def __init__(self, message: str, proven: bool, enough: float = None):
        super().__init__(message)
        self.proven = proven
        self.enough = enough


def out_of_time(time_limit: float, exc: TimeLimitReached, size: str) -> NoSchedule:
    """The time limit ran out in a phase before any schedule existed: what to give instead."""
    return NoSchedule(f"the time limit ({time_limit:g} s) ran out before any schedule was found (while {exc.what}: "
                      f"{size}, {100 * exc.done:.0f}% done)", proven=False,
                      enough=enough_time(max(3 * exc.needed(), exc.needed() + 5)))


def solver_params(name: str, function, params: dict, problem: tuple) -> dict:
    """The ``params`` given (not None) that ``function`` takes besides ``problem`` (its problem and budget
    arguments); an unknown one is a one-line :class:`MemschedError` listing the solver's parameters."""
    accepted = set(inspect.signature(function).parameters) - set(problem)
    given = {key: value for key, value in params.items() if value is not None}
    unknown = sorted(set(given) - accepted)
    if unknown:
        options = ", ".join(sorted(accepted)) or "none"
        raise MemschedError(f"solver {name!r} takes no parameter {unknown[0]!r} (its parameters: {options})")
    return given
