"""Chain solvers and the one entry point that runs them: :func:`solve`.

Each solver takes ``(chain, budget_bytes, **params)`` and returns a
:class:`solvers.result.Solution`; :func:`solve` times it, replays its schedule
in the simulator (whose figures, not the solver's, go into the plan) and
refuses a schedule that does not fit the budget. Solvers never import torch.

The offload solvers (solvers/offload.py: ``offload``, ``offload_greedy``,
``offload_all``, which keep a compute schedule, ``schedule="store_all"|"rotor"``;
solvers/pofo.py: ``pofo``, recomputation and offloading together) take the copy
channel (``transfer=``, else the chain's); their plans are replayed by
:func:`planner.simulate.chain.simulate` over that channel, record it, and are not
held to the least memory of recomputation alone (offloading goes below it; an
infeasible budget is refused by the solver with the least peak it reaches).
"""

import dataclasses
import time

from planner.chain import Chain
from planner.errors import MemschedError
from planner.plan import Plan, Predicted
from planner.simulate.chain import ChainSimulator, simulate
from planner.units import format_bytes
from solvers.extremes import recompute_all, store_all, store_all_schedule
from solvers.minimum import minimum_budget
from solvers.offload import offload as _offload, offload_all as _offload_all, offload_greedy as _offload_greedy
from solvers.pofo import pofo as _pofo
from solvers.result import solver_params
from solvers.revolve import revolve
from solvers.rotor import check_length, rotor
from solvers.sqrt import sqrt
from solvers.weights import host_weight_stages, place_weight_transfers, weight_reserve

SOLVERS = {
    "store_all": store_all,
    "recompute_all": recompute_all,
    "sqrt": sqrt,
    "revolve": revolve,
    "rotor": rotor,
}
OFFLOAD_SOLVERS = {
    "offload": _offload,  # (aliased so that ``solvers.offload`` and ``solvers.pofo`` stay the modules)
    "offload_greedy": _offload_greedy,
    "offload_all": _offload_all,
    "pofo": _pofo,
}
SOLVER_NAMES = ("auto",) + tuple(SOLVERS) + tuple(OFFLOAD_SOLVERS)


def store_all_peak(chain: Chain) -> int:
    """Bytes: the peak of the no-recomputation schedule, the largest budget worth giving."""
    return ChainSimulator(chain).run(store_all_schedule(chain.length)).peak_bytes


def choose_solver(chain: Chain, budget: int) -> str:
    """``auto``: store everything when it fits (no overhead), else Rotor, the exact solver for chains."""
    return "store_all" if budget >= store_all_peak(chain) else "rotor"


def solve(chain: Chain, budget: int, solver: str = "auto", weights=None, **params) -> Plan:
    """The plan ``solver`` finds for ``chain`` within ``budget`` bytes, its figures from the simulator.

    ``weights`` (``"all"`` or stage indices) puts those stages' parameters on the host (solvers/weights.py).
    Raises :class:`MemschedError` for an unknown solver or parameter, a budget
    below the least memory any schedule needs (the message states it), or a
    solver whose schedule does not fit.
    """
    if solver not in SOLVER_NAMES:
        raise MemschedError(f"unknown solver {solver!r}; choose one of {', '.join(SOLVER_NAMES)}")
    if weights is not None:
        return _solve_with_host_weights(chain, budget, solver, weights, params)
    offloading = solver in OFFLOAD_SOLVERS
    if solver in ("auto", "rotor"):  # before the least memory, which is what takes minutes on such a chain
        check_length(chain)
    if not offloading:  # offloading can go below it, and its solvers state the least peak they reach
        minimum = minimum_budget(chain)
        if budget < minimum:
            raise MemschedError(
                f"budget {format_bytes(budget)} ({budget} bytes) is below the minimum feasible "
                f"{format_bytes(minimum)} ({minimum} bytes) for chain '{chain.name}'; raise the budget to at least that"
            )
    name = choose_solver(chain, budget) if solver == "auto" else solver
    function = (OFFLOAD_SOLVERS if offloading else SOLVERS)[name]
    given = solver_params(name, function, params, ("chain", "budget"))
    started = time.perf_counter()
    solution = function(chain, budget, **given)
    elapsed = time.perf_counter() - started
    transfer = getattr(solution, "transfer", None)
    result = simulate(chain, solution.schedule, transfer)
    if result.peak_bytes > budget:
        hint = "--solver offload" if offloading else f"--solver rotor (feasible down to {format_bytes(minimum)})"
        raise MemschedError(f"{name}: its schedule peaks at {format_bytes(result.peak_bytes)}, above the budget "
                            f"{format_bytes(budget)}; raise the budget or use {hint}")
    return Plan(
        problem_name=chain.name,
        fingerprint=chain.fingerprint(),
        solver=name,
        params=solution.params,
        solve_seconds=elapsed,
        optimal=solution.optimal,
        gap=getattr(solution, "gap", None),
        budget_bytes=budget,
        predicted=Predicted(peak_bytes=result.peak_bytes, time=result.time, baseline_time=chain.compute_time),
        schedule=solution.schedule,
        transfer=transfer,
        measured_on=chain.measured_on,
    )


def _solve_with_host_weights(chain: Chain, budget: int, solver: str, weights, params: dict) -> Plan:
    """:func:`solve` with the parameters of the ``weights`` stages on the host (solvers/weights.py): the rest is
    solved within the budget less what those parameters can hold at once, then the weight and gradient
    transfers are placed and the whole plan is simulated over the copy channel."""
    stages = host_weight_stages(chain, weights)
    transfer = params.get("transfer") if solver in OFFLOAD_SOLVERS else params.pop("transfer", None)
    transfer = transfer or chain.transfer
    if transfer is None or not transfer.usable:
        raise MemschedError("weights on the host need a copy channel both ways: give --bandwidth (e.g. 16GB/s), "
                            "or profile the chain on CUDA, which measures it")
    reserve = weight_reserve(chain, stages)
    rest = budget - reserve
    if rest <= 0:
        raise MemschedError(f"budget {format_bytes(budget)} does not hold the parameters of two host-weight stages "
                            f"({format_bytes(reserve)}); raise the budget")
    try:
        inner = solve(chain, rest, solver, **params)
    except MemschedError as exc:
        raise MemschedError(f"with the parameters of {len(stages)} stages on the host, {format_bytes(rest)} of "
                            f"the budget is left for the rest of the step ({format_bytes(reserve)} is kept for "
                            f"the stages' parameters on the device): {exc}") from None
    started = time.perf_counter()
    schedule = place_weight_transfers(inner.schedule, stages)
    result = simulate(chain, schedule, transfer)
    if result.peak_bytes > budget:  # the reserve bounds the weights; gradients leave before they pile up
        raise MemschedError(f"{inner.solver} with weights on the host peaks at {format_bytes(result.peak_bytes)}, "
                            f"above the budget {format_bytes(budget)}; raise the budget")
    return dataclasses.replace(
        inner, params={**inner.params, "weights": list(stages)},
        solve_seconds=inner.solve_seconds + time.perf_counter() - started, optimal=False, gap=None,
        budget_bytes=budget, predicted=dataclasses.replace(inner.predicted, peak_bytes=result.peak_bytes,
                                                           time=result.time),
        schedule=schedule, transfer=transfer)
