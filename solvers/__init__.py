"""Chain solvers and the one entry point that runs them: :func:`solve`.

Each solver takes ``(chain, budget_bytes, **params)`` and returns a
:class:`solvers.result.Solution`; :func:`solve` times it, replays its schedule
in the simulator (whose figures, not the solver's, go into the plan) and
refuses a schedule that does not fit the budget. Solvers never import torch.
"""

import time

from planner.chain import Chain
from planner.errors import MemschedError
from planner.plan import Plan, Predicted
from planner.simulator import ChainSimulator
from planner.units import format_bytes
from solvers.extremes import recompute_all, store_all, store_all_schedule
from solvers.minimum import minimum_budget
from solvers.result import solver_params
from solvers.revolve import revolve
from solvers.rotor import rotor
from solvers.sqrt import sqrt

SOLVERS = {
    "store_all": store_all,
    "recompute_all": recompute_all,
    "sqrt": sqrt,
    "revolve": revolve,
    "rotor": rotor,
}
SOLVER_NAMES = ("auto",) + tuple(SOLVERS)


def store_all_peak(chain: Chain) -> int:
    """Bytes: the peak of the no-recomputation schedule, the largest budget worth giving."""
    return ChainSimulator(chain).run(store_all_schedule(chain.length)).peak_bytes


def choose_solver(chain: Chain, budget: int) -> str:
    """``auto``: store everything when it fits (no overhead), else Rotor, the exact solver for chains."""
    return "store_all" if budget >= store_all_peak(chain) else "rotor"


def solve(chain: Chain, budget: int, solver: str = "auto", **params) -> Plan:
    """The plan ``solver`` finds for ``chain`` within ``budget`` bytes, its figures from the simulator.

    Raises :class:`MemschedError` for an unknown solver or parameter, a budget
    below the least memory any schedule needs (the message states it), or a
    solver whose schedule does not fit.
    """
    if solver not in SOLVER_NAMES:
        raise MemschedError(f"unknown solver {solver!r}; choose one of {', '.join(SOLVER_NAMES)}")
    minimum = minimum_budget(chain)
    if budget < minimum:
        raise MemschedError(
            f"budget {format_bytes(budget)} ({budget} bytes) is below the minimum feasible "
            f"{format_bytes(minimum)} ({minimum} bytes) for chain '{chain.name}'; raise the budget to at least that"
        )
    name = choose_solver(chain, budget) if solver == "auto" else solver
    function = SOLVERS[name]
    given = solver_params(name, function, params, ("chain", "budget"))
    started = time.perf_counter()
    solution = function(chain, budget, **given)
    elapsed = time.perf_counter() - started
    result = ChainSimulator(chain).run(solution.schedule)
    if result.peak_bytes > budget:
        raise MemschedError(
            f"{name}: its schedule peaks at {format_bytes(result.peak_bytes)}, above the budget "
            f"{format_bytes(budget)}; raise the budget or use --solver rotor (feasible down to {format_bytes(minimum)})"
        )
    return Plan(
        problem_name=chain.name,
        fingerprint=chain.fingerprint(),
        solver=name,
        params=solution.params,
        solve_seconds=elapsed,
        optimal=solution.optimal,
        budget_bytes=budget,
        predicted=Predicted(peak_bytes=result.peak_bytes, time=result.time, baseline_time=chain.compute_time),
        schedule=solution.schedule,
    )
