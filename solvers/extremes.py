"""The two extreme chain schedules.

* ``store_all``: every forward with autograd, then every backward: no
  recomputation, the largest useful budget.
* ``recompute_all``: keep only the input; before each backward, recompute the
  chain from the input up to that stage (Revolve with one snapshot): the
  smallest memory of any schedule that holds at most one checkpoint.
"""

from planner.chain import Chain
from planner.ops import Op
from solvers.result import Solution


def store_all_schedule(length: int) -> tuple:
    """``F_all 0..L-1, Loss, B L-1..0``."""
    return (*(Op("F_all", i) for i in range(length)), Op("Loss"), *(Op("B", i) for i in reversed(range(length))))


def store_all(chain: Chain, budget: int) -> Solution:
    """Store everything; optimal (no recomputation) whenever it fits."""
    return Solution(store_all_schedule(chain.length), optimal=True)


def recompute_all(chain: Chain, budget: int) -> Solution:
    """Recompute from the input before every backward: quadratic time, minimal checkpoint memory."""
    schedule = []
    for target in reversed(range(chain.length)):
        if target > 0:
            schedule.append(Op("F_ck", 0))
            schedule.extend(Op("F_none", k) for k in range(1, target))
        schedule.append(Op("F_all", target))
        if target == chain.length - 1:
            schedule.append(Op("Loss"))
        schedule.append(Op("B", target))
    return Solution(tuple(schedule))
