"""The solver registries and the entry points that run them: :func:`solve` (chains) and :func:`solve_graph`.

Each solver takes ``(problem, budget_bytes, **params)`` and returns a
:class:`solvers.result.Solution`; the entry point times it, replays its
schedule in the simulator (whose figures, not the solver's, go into the plan)
and refuses a schedule that does not fit the budget. Solvers never import torch.

The offload solvers (solvers/offload/: ``offload``, ``offload_greedy``,
``offload_all``, which keep a compute schedule, ``schedule="store_all"|"rotor"``;
solvers/pofo.py: ``pofo``, recomputation and offloading together) take the copy
channel (``transfer=``, else the chain's); their plans are replayed over that
channel, record it, and are not held to the least memory of recomputation alone
(offloading goes below it; an infeasible budget is refused by the solver with
the least peak it reaches).
"""

import dataclasses
import importlib
import time

from planner.accumulate import accumulating_chain, check_accumulate, held_gradient_bytes
from planner.chain import Chain
from planner.errors import MemschedError
from planner.graph import Graph
from planner.plan import Plan, Predicted
from planner.setup import Run, TrainingSetup, check, lower
from planner.simulate import simulate
from planner.simulate.chain import ChainSimulator
from planner.simulate.graph import GraphSimulator, store_all_graph_schedule
from planner.units import format_bytes
from planner.updates import check_channel, host_stages_of
from solvers.checkmate import checkmate as _checkmate
from solvers.checkmate import checkmate_lp as _checkmate_lp
from solvers.checkmate import least_frontier_peak
from solvers.extremes import graph_lower_bound, recompute_all, store_all, store_all_graph, store_all_schedule
from solvers.limits import Deadline, enough_time
from solvers.minimum import minimum_budget
from solvers.offload import offload as _offload
from solvers.offload import offload_all as _offload_all
from solvers.offload import offload_greedy as _offload_greedy
from solvers.pofo import pofo as _pofo
from solvers.result import NoSchedule, Solution, solver_params
from solvers.revolve import revolve
from solvers.rotor import check_length, hierarchical, rotor
from solvers.sqrt import sqrt
from solvers.weights import chosen_weight_stages, place_weight_transfers, weight_reserve

__all__ = ["solve", "solve_graph", "store_all_peak", "store_all_graph_peak", "choose_solver", "choose_graph_solver",
           "graph_minimum", "SOLVERS", "OFFLOAD_SOLVERS", "GRAPH_SOLVERS", "SOLVER_NAMES", "GRAPH_SOLVER_NAMES"]

SOLVERS = {
    "store_all": store_all,
    "recompute_all": recompute_all,
    "sqrt": sqrt,
    "revolve": revolve,
    "rotor": rotor,
    "hierarchical": hierarchical,
}
OFFLOAD_SOLVERS = {
    "offload": _offload,  # (aliased so that ``solvers.offload`` and ``solvers.pofo`` stay the modules)
    "offload_greedy": _offload_greedy,
    "offload_all": _offload_all,
    "pofo": _pofo,
}
SOLVER_NAMES = ("auto",) + tuple(SOLVERS) + tuple(OFFLOAD_SOLVERS)


def store_all_peak(chain: Chain, accumulate: int = 1) -> int:
    """Bytes: the peak of the no-recomputation schedule, the largest budget worth giving; with gradients
    accumulated over ``accumulate`` micro-batches, the peak of a micro-batch after the first (planner/accumulate.py)."""
    if check_accumulate(accumulate) > 1:
        return ChainSimulator(accumulating_chain(chain), held_gradient_bytes(chain)).run(
            store_all_schedule(chain.length)).peak_bytes
    return ChainSimulator(chain).run(store_all_schedule(chain.length)).peak_bytes


def choose_solver(chain: Chain, budget: int) -> str:
    """``auto``: store everything when it fits (no overhead), else Rotor, the exact solver for chains, or where
    the stages have options (planner.chain.StageOption) the hierarchical solver, which chooses among them."""
    if budget >= store_all_peak(chain):
        return "store_all"
    return "hierarchical" if chain.has_options else "rotor"


def solve(chain: Chain, budget: int, solver: str = "auto", setup: TrainingSetup = None, **params) -> Plan:
    """The plan ``solver`` finds for ``chain`` within ``budget`` bytes under ``setup``, its figures from the
    simulator.

    Args:
        chain: the chain as profiled.
        budget: bytes for the whole step, the gradients that accumulation holds included.
        solver: a name of :data:`SOLVER_NAMES` (``auto``: :func:`choose_solver`).
        setup: the :class:`planner.setup.TrainingSetup` to plan for (default: the update after the backward, no
            weights on the host, no accumulation). Its combinations are checked first
            (:func:`planner.setup.check`); the chain is lowered through it (:func:`planner.setup.lower`), solved
            within the budget less what the setup holds beside the step (accumulated gradients, the reserve of
            weights on the host), and the plan records the setup against the chain's own fingerprint.
        params: the solver's parameters (:func:`solvers.result.solver_params`); ``transfer``, the copy channel of
            the offload solvers, of weights on the host and of the update ``on-host`` (else the chain's).

    Returns:
        The :class:`planner.plan.Plan`.

    Raises:
        MemschedError: an unknown solver or parameter, a setup whose parts do not mix, a budget below the least
            memory any schedule needs (the message states it), or a solver whose schedule does not fit.
    """
    if solver not in SOLVER_NAMES:
        raise MemschedError(f"unknown solver {solver!r}; choose one of {', '.join(SOLVER_NAMES)}")
    setup = TrainingSetup() if setup is None else setup
    offloading = solver in OFFLOAD_SOLVERS
    check(setup, Run(transfers=offloading))
    transfer = (params.get("transfer") if offloading else params.pop("transfer", None)) or chain.transfer
    check_channel(setup.update, transfer)
    weights = None if setup.host_weights is None else chosen_weight_stages(chain, setup.host_weights)
    if weights is not None and (transfer is None or not transfer.usable):
        raise MemschedError("weights on the host need a copy channel both ways: give --bandwidth (e.g. 16GB/s), "
                            "or profile the chain on CUDA, which measures it")
    lowered = lower(chain, setup, transfer)
    reserve = 0 if weights is None else weight_reserve(chain, weights)
    what, why = _beside_the_step(setup, lowered.held_bytes, weights, reserve)
    rest = budget - lowered.held_bytes - reserve
    if why and rest <= 0:
        raise MemschedError(f"budget {format_bytes(budget)} does not hold {what}: {why}; raise the budget")
    if weights is not None and solver == "auto" and chain.has_options:  # options run without transfers only
        solver = "store_all" if rest >= store_all_peak(chain) else "rotor"
    try:
        plan = _solve_step(lowered.chain, rest, solver, params)
    except MemschedError as exc:
        if not why:
            raise
        raise MemschedError(f"{why}, leaving {format_bytes(rest)} of the budget {format_bytes(budget)} for the "
                            f"rest of the step: {exc}") from None
    if weights is not None:
        plan = _with_host_weights(plan, chain, weights, transfer, budget)
    return dataclasses.replace(
        plan, fingerprint=chain.fingerprint(), budget_bytes=budget, update=setup.update,
        host_stages=None if setup.host_stages is None else tuple(sorted(host_stages_of(chain, setup.update,
                                                                                       setup.host_stages))),
        transfer=plan.transfer or (transfer if setup.update == "on-host" else None),
        accumulate=setup.accumulate, sizing=None if setup.sizing() == TrainingSetup().sizing() else setup.sizing(),
        predicted=dataclasses.replace(plan.predicted, peak_bytes=plan.predicted.peak_bytes + lowered.held_bytes,
                                      baseline_time=chain.compute_time))


def _beside_the_step(setup: TrainingSetup, held: int, weights, reserve: int) -> tuple:
    """``(what, why)``: what the setup holds beside the lowered step and why, in words for a refused budget
    (empty when nothing)."""
    if setup.accumulate > 1:
        return "the gradients", (f"accumulating gradients over {setup.accumulate} micro-batches holds every gradient "
                                 f"({format_bytes(held)}) from the second micro-batch's start")
    if setup.sharded and held:
        return "ZeRO 2's whole parameters", (f"ZeRO 2 holds every stage's whole parameters ({format_bytes(held)}) "
                                             "through the step")
    if weights is not None:
        return (f"the parameters of two host-weight stages ({format_bytes(reserve)})",
                f"with the parameters of {len(weights)} stages on the host, {format_bytes(reserve)} is kept for the "
                "stages' parameters on the device")
    return "", ""


def _solve_step(chain: Chain, budget: int, solver: str, params: dict) -> Plan:
    """The plan ``solver`` finds for the (lowered) ``chain`` within ``budget`` bytes, checked by the simulator."""
    offloading = solver in OFFLOAD_SOLVERS
    if solver in ("auto", "rotor", "hierarchical"):  # before the least memory, which takes minutes on such a chain
        check_length(chain)
    if not offloading:  # offloading can go below it, and its solvers state the least peak they reach
        minimum = minimum_budget(chain, options=solver in ("auto", "hierarchical"))
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
    transfer = solution.transfer
    result = simulate(chain, solution.schedule, transfer)
    if result.peak_bytes > budget:
        hint = "--solver offload" if offloading else (f"--solver {'hierarchical' if chain.has_options else 'rotor'} "
                                                      f"(feasible down to {format_bytes(minimum)})")
        raise MemschedError(f"{name}: its schedule peaks at {format_bytes(result.peak_bytes)}, above the budget "
                            f"{format_bytes(budget)}; raise the budget or use {hint}")
    return _plan(chain, name, solution, elapsed, budget, result, transfer=transfer, measured_on=chain.measured_on)


def _with_host_weights(inner: Plan, chain: Chain, weights: tuple, transfer, budget: int) -> Plan:
    """``inner`` (solved within the budget less the weights' reserve) with the weight and gradient transfers of the
    ``weights`` stages placed (solvers/weights.py), the whole plan simulated over the copy channel."""
    started = time.perf_counter()
    schedule = place_weight_transfers(inner.schedule, weights)
    result = simulate(chain, schedule, transfer)
    if result.peak_bytes > budget:  # the reserve bounds the weights; gradients leave before they pile up
        raise MemschedError(f"{inner.solver} with weights on the host peaks at {format_bytes(result.peak_bytes)}, "
                            f"above the budget {format_bytes(budget)}; raise the budget")
    return dataclasses.replace(
        inner, params={**inner.params, "weights": list(weights)},
        solve_seconds=inner.solve_seconds + time.perf_counter() - started, optimal=False, gap=None,
        predicted=dataclasses.replace(inner.predicted, peak_bytes=result.peak_bytes, time=result.time),
        schedule=schedule, transfer=transfer)


# a time limit is kept to within this (seconds, or this fraction of it when larger): the solvers check their
# deadline between the pieces of their work, and a piece that has started runs to its end
TIME_LIMIT_TOLERANCE = (1.0, 0.1)

GRAPH_SOLVERS = {
    "store_all": store_all_graph,
    "checkmate": _checkmate,  # (aliased so that ``solvers.checkmate`` stays the package)
    "checkmate-lp": _checkmate_lp,
}
GRAPH_SOLVER_NAMES = ("auto",) + tuple(GRAPH_SOLVERS) + ("moccasin",)


def _moccasin():
    """The module solvers.moccasin, imported on first use: OR-Tools's import is half of ``import solvers``
    (0.7 of 1.4 s measured), which the chain solvers and every other graph solver do without."""
    return importlib.import_module("solvers.moccasin")


def _graph_solver(name: str):
    return _moccasin().moccasin if name == "moccasin" else GRAPH_SOLVERS[name]


def store_all_graph_peak(graph: Graph) -> int:
    """Bytes: the peak of the no-recomputation schedule, the largest budget worth giving."""
    return GraphSimulator(graph).run(store_all_graph_schedule(graph)).peak_bytes


def graph_minimum(graph: Graph, time_limit: float = 10.0):
    """``(bytes, exact)``: the least peak of any frontier-advancing schedule (Checkmate's MILP with the peak as
    objective, ``exact`` True), or when it is not proven within ``time_limit`` seconds (building the model
    included; None: no limit), :func:`graph_lower_bound` (``exact`` False)."""
    if time_limit is not None and time_limit <= 0:
        return graph_lower_bound(graph), False
    peak, proven = least_frontier_peak(graph, time_limit=time_limit)
    return (peak, True) if proven else (graph_lower_bound(graph), False)


def choose_graph_solver(graph: Graph, budget: int) -> str:
    """``auto``: store everything when it fits (no overhead), else Checkmate's exact MILP (and, when no
    frontier-advancing schedule fits, Moccasin over any order: see :func:`solve_graph`)."""
    return "store_all" if budget >= store_all_graph_peak(graph) else "checkmate"


FRONTIER = "frontier-advancing schedule (first computations in index order)"


def schedule_class(name: str, given: dict) -> str:
    """The schedules among which solver ``name`` (checkmate or moccasin), given the parameters ``given``, proves
    that none fits: what its error names, since a schedule of another class may still fit."""
    if name != "moccasin":
        return FRONTIER
    order = "first computations in index order" if given.get("first_order") == "index" else "any order"
    return f"schedule with at most {given.get('max_computations', 2)} computations per node ({order})"


def _least_frontier(graph: Graph, minimum_time_limit: float, deadline) -> tuple:
    """``(bytes or None, phrase)``: the least memory of any frontier-advancing schedule when proven within
    ``minimum_time_limit`` seconds and what is left of ``deadline``, and a phrase stating it (or, unproven,
    :func:`graph_lower_bound`)."""
    left = None if deadline is None else deadline.left()
    if left is not None:
        left -= 0.1  # for the message
        minimum_time_limit = left if minimum_time_limit is None else min(minimum_time_limit, left)
    minimum, exact = graph_minimum(graph, minimum_time_limit)
    if exact:
        return minimum, (f"the least memory of any frontier-advancing schedule is {format_bytes(minimum)} "
                         f"({minimum} bytes)")
    return None, f"no schedule needs less than {format_bytes(minimum)} ({minimum} bytes) (a lower bound)"


def _none_fits(graph: Graph, budget: int, name: str, given: dict, minimum_time_limit: float,
               deadline=None) -> MemschedError:
    """The error of solver ``name`` having proven that no schedule of its class fits ``budget``: it names the
    class and the solver whose class may still hold one, never calling the budget infeasible (only
    :func:`graph_lower_bound` proves that)."""
    minimum, least = _least_frontier(graph, minimum_time_limit, deadline)
    head = (f"{name}: no {schedule_class(name, given)} fits {format_bytes(budget)} ({budget} bytes) for graph "
            f"'{graph.name}'")
    if name != "moccasin":
        return MemschedError(f"{head}; {least}; moccasin (any order) may: --solver moccasin, or raise the budget")
    if minimum is not None and minimum <= budget:
        return MemschedError(f"{head}; a frontier-advancing one fits ({least}): --solver checkmate")
    more = f"--max-computations {given.get('max_computations', 2) + 1}"
    if given.get("first_order") == "index":
        more += " or --first-order free"
    return MemschedError(f"{head}; {least}; more computations per node may fit: {more}, or raise the budget")


def _moccasin_fallback(graph: Graph, budget: int, time_limit, minimum_time_limit: float, deadline):
    """``auto``'s second try once Checkmate proved that no frontier-advancing schedule fits ``budget``: Moccasin
    over any order (two computations per node), within what is left of ``deadline``. Its solution, with the
    time limit given to the whole solve in its parameters; raises an error naming both classes when neither
    fits, or saying what limit to give when the time ran out."""
    left = deadline.left()
    try:
        solution = _moccasin().moccasin(graph, budget, time_limit=None if left is None else max(0.001, left))
    except NoSchedule as exc:
        _, least = _least_frontier(graph, minimum_time_limit, deadline)
        head = (f"no {FRONTIER} fits {format_bytes(budget)} ({budget} bytes) for graph '{graph.name}' (checkmate; "
                f"{least})")
        if exc.proven:
            raise MemschedError(f"{head}, nor one with at most 2 computations per node in any order (moccasin); "
                                "more computations may fit: --solver moccasin --max-computations 3, or raise the "
                                "budget") from None
        raise MemschedError(f"{head}; moccasin (any order) found none before the time limit: give --time-limit "
                            f"{enough_time(4 * time_limit)} or more, or a larger budget") from None
    params = {key: value for key, value in solution.params.items() if key != "time_limit"}
    if time_limit is not None:
        params["time_limit"] = time_limit
    return dataclasses.replace(solution, params=params)


def solve_graph(graph: Graph, budget: int, solver: str = "auto", time_limit: float = None,
                minimum_time_limit: float = 10.0, **params) -> Plan:
    """The plan ``solver`` finds for ``graph`` within ``budget`` bytes, its figures from the graph simulator.

    ``auto`` stores everything when that fits, else runs Checkmate, and when Checkmate proves that no
    frontier-advancing schedule fits, Moccasin over any order (with what is left of the time limit): a schedule
    that reorders the first computations may need less memory.

    Args:
        graph: the joint forward+backward graph as profiled (:class:`planner.graph.Graph`).
        budget: bytes for the whole step (the graph's fixed bytes included).
        solver: a name of :data:`GRAPH_SOLVER_NAMES` (``auto``: as above).
        time_limit: seconds: a deadline for the whole solve of the solvers that take one (building their model,
            their warm start and the search all within it, give or take :data:`TIME_LIMIT_TOLERANCE`); the plan
            then says whether the schedule is proven optimal. None: no limit.
        minimum_time_limit: seconds spent at most (and no longer than the time limit leaves) looking for the
            least memory of a frontier-advancing schedule, which the error of a budget no schedule fits states.
        params: the solver's parameters (:func:`solvers.result.solver_params`), e.g. Checkmate's ``backend`` and
            ``gap``, checkmate-lp's ``samples`` and ``seed``, Moccasin's ``max_computations`` and ``first_order``.

    Returns:
        The :class:`planner.plan.Plan` of kind ``graph``.

    Raises:
        MemschedError: an unknown solver or parameter; a budget below :func:`graph_lower_bound` (bytes, the least
            any schedule needs); a budget no schedule of the solver's class fits (the message names the class,
            states the least memory of a frontier-advancing schedule or a lower bound, and names the solver whose
            class may still fit); a time limit reached before any schedule was found (the message says what limit
            to give); or a schedule that does not fit.
    """
    if solver not in GRAPH_SOLVER_NAMES:
        raise MemschedError(f"unknown graph solver {solver!r}; choose one of {', '.join(GRAPH_SOLVER_NAMES)}")
    name = choose_graph_solver(graph, budget) if solver == "auto" else solver
    function = _graph_solver(name)
    given = solver_params(name, function, dict(params, time_limit=time_limit), ("graph", "budget"))
    if name == "moccasin":  # its options checked before the budget, so that a bad one is named as such
        _moccasin().check_options(**{key: given[key] for key in ("max_computations", "first_order") if key in given})
    lower = graph_lower_bound(graph)
    if budget < lower:
        raise MemschedError(f"budget {format_bytes(budget)} ({budget} bytes) is below {format_bytes(lower)} "
                            f"({lower} bytes), the least memory any schedule of graph '{graph.name}' needs "
                            "(fixed bytes and the largest computation or set of kept values); raise the budget")
    deadline = Deadline(time_limit)
    started = time.perf_counter()
    try:
        solution = function(graph, budget, **given)
    except NoSchedule as exc:
        if not exc.proven:
            more = (f"give --time-limit {exc.enough} or more" if exc.enough is not None
                    else "give it more time (--time-limit)")
            raise MemschedError(f"{name}: {exc}, for graph '{graph.name}' at {format_bytes(budget)}; {more}, "
                                "or a larger budget") from None
        if solver != "auto":
            raise _none_fits(graph, budget, name, given, minimum_time_limit, deadline) from None
        name = "moccasin"
        solution = _moccasin_fallback(graph, budget, time_limit, minimum_time_limit, deadline)
    elapsed = time.perf_counter() - started
    result = simulate(graph, solution.schedule)
    if result.peak_bytes > budget:
        if name == "store_all":
            raise MemschedError(f"store_all: its schedule peaks at {format_bytes(result.peak_bytes)}, above the budget "
                                f"{format_bytes(budget)}; raise the budget or use --solver checkmate")
        raise MemschedError(f"{name}: its schedule peaks at {result.peak_bytes} bytes, above the budget {budget} "
                            "bytes (a numerical error of the solver); raise the budget slightly")
    return _plan(graph, name, solution, elapsed, budget, result, kind="graph")


def _plan(problem, name: str, solution: Solution, elapsed: float, budget: int, result, **fields) -> Plan:
    """The plan of ``solution`` to ``problem`` (a chain or a graph), its figures the simulator's ``result``."""
    return Plan(problem_name=problem.name, fingerprint=problem.fingerprint(), solver=name, params=solution.params,
                solve_seconds=elapsed, optimal=solution.optimal, gap=solution.gap, budget_bytes=budget,
                predicted=Predicted(peak_bytes=result.peak_bytes, time=result.time,
                                    baseline_time=problem.compute_time),
                schedule=solution.schedule, **fields)
