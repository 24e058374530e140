"""What a solver hands back before the simulator judges it, and the parameters it is given."""

import inspect
from dataclasses import dataclass, field

from planner.errors import MemschedError


@dataclass(frozen=True)
class Solution:
    """A schedule (tuple of :class:`planner.plan.Op`), the parameters that produced it, and whether it is optimal."""

    schedule: tuple
    params: dict = field(default_factory=dict)
    optimal: bool = False


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
