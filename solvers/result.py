"""What a solver hands back before the simulator judges it."""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Solution:
    """A schedule (tuple of :class:`planner.plan.Op`), the parameters that produced it, and whether it is optimal."""

    schedule: tuple
    params: dict = field(default_factory=dict)
    optimal: bool = False
