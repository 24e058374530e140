"""Offload plans: which items to copy to the host, and when, for a fixed compute schedule.

The compute schedule (store-all by default, a Rotor plan's, or any chain schedule without transfers) is kept as
it is; ``Offload``, ``Release`` and ``Prefetch`` operations are inserted so that the offload simulator predicts
a peak within the budget and the least step time, compute plus stalls:

* :func:`offload`: the exact CP-SAT model (solvers/offload/exact.py) up to :data:`EXACT_UP_TO` stages, started
  from the greedy (solvers/offload/greedy.py), which it uses alone beyond; an infeasible budget is a one-line
  error stating the least peak offloading reaches (solvers/offload/problem.py);
* :func:`offload_greedy`: the greedy's plan; :func:`offload_all`: the ``saved_tensors_hooks`` hand policy.

Each returns a :class:`solvers.result.Solution` recording the copy channel (:func:`channel_of`).
docs/solvers.md states the class of plans, the exact model, the greedy and the hand policy.
"""

import math

from planner.chain import Chain
from planner.errors import MemschedError
from planner.simulate import simulate
from planner.transfer import Transfer
from planner.units import format_bytes
from solvers.limits import Deadline, TimeLimitReached, enough_time
from solvers.offload.exact import exact_windows
from solvers.offload.greedy import greedy_windows, hand_windows
from solvers.offload.problem import (
    OffloadProblem,
    build_problem,
    compute_schedule,
    least_offload_peak,
    schedule_with_windows,
)
from solvers.result import Solution

METHODS = ("auto", "exact", "greedy")
EXACT_UP_TO = 100  # stages: beyond, method "auto" uses the greedy
DEFAULT_TIME_LIMIT = 30.0  # seconds of CP-SAT


def channel_of(chain: Chain, transfer, solver: str = "offload") -> Transfer:
    """``transfer``, else the chain's copy channel; a one-line error naming ``solver`` when there is none."""
    channel = transfer if transfer is not None else chain.transfer
    if channel is None:
        raise MemschedError(f"{solver}: chain '{chain.name}' has no copy channel; give one (transfer=, --bandwidth "
                            "16GB/s) or profile on CUDA")
    if not isinstance(channel, Transfer):
        raise MemschedError(f"{solver}: transfer must be a planner.transfer.Transfer, got {type(channel).__name__}")
    return channel


def _budget(budget) -> int:
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise MemschedError(f"offload: budget must be a number of bytes >= 0, got {budget!r}")
    return budget


def _infeasible(problem: OffloadProblem, budget: int, schedule, least: int = None) -> MemschedError:
    least = least_offload_peak(problem) if least is None else least
    name = schedule if isinstance(schedule, str) else "given"
    how = ("the copy channel cannot move data both ways" if not problem.transfer.usable
           else f"offloading reaches {format_bytes(least)} ({least} bytes) at least")
    return MemschedError(f"offload: budget {format_bytes(budget)} ({budget} bytes) is infeasible on the {name} "
                         f"compute schedule of chain '{problem.chain.name}' (peak {format_bytes(problem.peak)}): "
                         f"{how}; "
                         "raise the budget or use a schedule that recomputes (schedule='rotor')")


def _prepare(chain, budget, transfer, schedule, schedule_budget, deadline=None):
    budget = _budget(budget)
    channel = channel_of(chain, transfer)
    ops = compute_schedule(chain, budget, schedule, schedule_budget, deadline)
    return budget, build_problem(chain, ops, channel)


def _params(schedule, schedule_budget, **more) -> dict:
    params = {"schedule": schedule if isinstance(schedule, str) else "given"}
    if schedule_budget is not None:
        params["schedule_budget"] = schedule_budget
    params.update({key: value for key, value in more.items() if value is not None})
    return params


def _simulated(problem: OffloadProblem, windows) -> tuple:
    """``(schedule, simulator result)`` of the plan of ``windows``."""
    schedule = schedule_with_windows(problem, windows)
    return schedule, simulate(problem.chain, schedule, problem.transfer)


def offload(chain: Chain, budget: int, transfer: Transfer = None, schedule="store_all", schedule_budget: int = None,
            time_limit: float = DEFAULT_TIME_LIMIT, method: str = "auto") -> Solution:
    """The fastest offload plan of the compute ``schedule`` within ``budget`` bytes over the copy channel
    ``transfer`` (the chain's when None): CP-SAT (``method="exact"``, and ``"auto"`` up to ``EXACT_UP_TO``
    stages) or the greedy. Infeasible budgets raise a one-line :class:`MemschedError` with the least peak."""
    if method not in METHODS:
        raise MemschedError(f"offload: unknown method {method!r}; choose one of {', '.join(METHODS)}")
    if time_limit is None:
        time_limit = DEFAULT_TIME_LIMIT
    if isinstance(time_limit, bool) or not isinstance(time_limit, (int, float)) or not 0 < time_limit < math.inf:
        raise MemschedError(f"offload: time_limit must be a positive number of seconds, got {time_limit!r}")
    return offload_within(chain, budget, transfer, schedule, schedule_budget, Deadline(time_limit), method,
                          time_limit)


def offload_within(chain: Chain, budget: int, transfer: Transfer, schedule, schedule_budget, deadline: Deadline,
                   method: str = "auto", time_limit=None) -> Solution:
    """:func:`offload` within ``deadline`` (a :class:`solvers.limits.Deadline`: the computation of the compute
    schedule, the least peak, the greedy and the exact model all within it; once it has passed the greedy's plan
    is returned); ``time_limit`` is what the plan's parameters record."""
    try:
        budget, problem = _prepare(chain, budget, transfer, schedule, schedule_budget, deadline)
    except TimeLimitReached as exc:
        raise MemschedError(f"offload: the time limit ({deadline.seconds:g} s) ran out while {exc.what} "
                            f"({100 * exc.done:.0f}% done); give --time-limit {enough_time(2 * exc.needed())} "
                            "or more") from None
    if problem.peak <= budget:  # nothing to move: offloading only adds stalls
        return Solution(problem.ops, _params(schedule, schedule_budget, method=method), optimal=True, gap=0.0,
                               transfer=problem.transfer, model_time=problem.compute_time, stats={"candidates": 0})
    least = least_offload_peak(problem, deadline)
    if least > budget:
        raise _infeasible(problem, budget, schedule, least)
    greedy = greedy_windows(problem, budget)
    use_exact = method == "exact" or (method == "auto" and chain.length <= EXACT_UP_TO)
    if use_exact and greedy is not None:  # no stall at all: nothing is faster
        plan, result = _simulated(problem, greedy)
        if result.stall_time == 0.0:
            return Solution(plan, _params(schedule, schedule_budget, method="exact", time_limit=time_limit),
                                   optimal=True, gap=0.0, transfer=problem.transfer, model_time=result.time,
                                   stats={"candidates": len(problem.candidates),
                                          "status": "OPTIMAL (greedy, no stall)"})
    if use_exact:
        windows, optimal, gap, model_time, stats = exact_windows(problem, budget, deadline, hint=greedy)
        if windows is not None:
            plan, result = _simulated(problem, windows)
            if result.peak_bytes > budget:  # the model's memory is exact in bytes: this is a bug, not rounding
                raise MemschedError(f"offload: internal error: the exact plan peaks at {result.peak_bytes} bytes, "
                                    f"above the budget {budget}")
            return Solution(plan, _params(schedule, schedule_budget, method="exact", time_limit=time_limit),
                                   optimal=optimal, gap=gap, transfer=problem.transfer, model_time=model_time,
                                   stats=stats)
    if greedy is None:
        raise _infeasible(problem, budget, schedule, least)
    plan, result = _simulated(problem, greedy)
    if result.peak_bytes > budget:
        raise MemschedError(f"offload: the greedy plan peaks at {format_bytes(result.peak_bytes)}, above the budget "
                            f"{format_bytes(budget)}; use method='exact'")
    label = "greedy" if not use_exact else "greedy (exact model found nothing within the time limit)"
    return Solution(plan, _params(schedule, schedule_budget, method=label), optimal=False, gap=None,
                           transfer=problem.transfer, stats={"candidates": len(problem.candidates)})


def offload_greedy(chain: Chain, budget: int, transfer: Transfer = None, schedule="store_all",
                   schedule_budget: int = None) -> Solution:
    """The greedy's plan (docs/solvers.md), never claimed optimal."""
    return offload(chain, budget, transfer, schedule, schedule_budget, method="greedy")


def offload_all_policy(chain: Chain, budget: int = None, transfer: Transfer = None, schedule="store_all",
                       schedule_budget: int = None) -> Solution:
    """The hand policy (docs/solvers.md): every saved activation offloaded, whatever the budget (used only to
    pick the rotor compute schedule); the caller judges its peak."""
    channel = channel_of(chain, transfer)
    ops = compute_schedule(chain, 0 if budget is None else _budget(budget), schedule, schedule_budget)
    problem = build_problem(chain, ops, channel)
    plan = schedule_with_windows(problem, hand_windows(problem))
    return Solution(plan, _params(schedule, schedule_budget), optimal=False, transfer=channel)


def offload_all(chain: Chain, budget: int, transfer: Transfer = None, schedule="store_all",
                schedule_budget: int = None) -> Solution:
    """:func:`offload_all_policy` as a registered solver (``solve`` refuses it when it does not fit)."""
    return offload_all_policy(chain, budget, transfer, schedule, schedule_budget)
