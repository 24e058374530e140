"""Graph solvers and the one entry point that runs them: :func:`solve_graph`, the graph twin of :func:`solvers.solve`.

Each solver takes ``(graph, budget_bytes, **params)`` and returns a
:class:`GraphSolution`; :func:`solve_graph` times it, replays its schedule in
the graph simulator (whose figures, not the solver's, go into the plan) and
refuses a schedule that does not fit. The solver modules (highspy, pulp for CBC, OR-Tools) are
imported when first used. Solvers never import torch.
"""

import dataclasses
import importlib
import time
from dataclasses import dataclass, field

from planner.errors import MemschedError
from planner.graph import Graph, store_all_graph_schedule
from planner.simulate.graph import GraphSimulator
from planner.plan import Plan, Predicted
from planner.units import format_bytes
from solvers.limits import Deadline, enough_time
from solvers.result import solver_params


@dataclass(frozen=True)
class GraphSolution:
    """A graph schedule (tuple of :class:`planner.plan.GraphOp`), the parameters that produced it, whether it is
    proven optimal, and the relative gap to the solver's bound on the time (0 when optimal; None when unknown)."""

    schedule: tuple
    params: dict = field(default_factory=dict)
    optimal: bool = False
    gap: float = None


def store_all(graph: Graph, budget: int) -> GraphSolution:
    """Every node once, in index order, each value freed after its last consumer: optimal whenever it fits."""
    return GraphSolution(store_all_graph_schedule(graph), optimal=True, gap=0.0)


# a time limit is kept to within this (seconds, or this fraction of it when larger): the solvers check their
# deadline between the pieces of their work, and a piece that has started runs to its end
TIME_LIMIT_TOLERANCE = (1.0, 0.1)

# solver name -> (module, function); imported on first use
GRAPH_SOLVERS = {
    "store_all": ("solvers.graph", "store_all"),
    "checkmate": ("solvers.checkmate", "checkmate"),
    "checkmate-lp": ("solvers.checkmate", "checkmate_lp"),
    "moccasin": ("solvers.moccasin", "moccasin"),
}
GRAPH_SOLVER_NAMES = ("auto",) + tuple(GRAPH_SOLVERS)


def _function(name: str):
    module, function = GRAPH_SOLVERS[name]
    return getattr(importlib.import_module(module), function)


def store_all_graph_peak(graph: Graph) -> int:
    """Bytes: the peak of the no-recomputation schedule, the largest budget worth giving."""
    return GraphSimulator(graph).run(store_all_graph_schedule(graph)).peak_bytes


def graph_lower_bound(graph: Graph) -> int:
    """Bytes no schedule can go below: ``fixed_bytes`` plus the largest of every ``keep`` value together (they are
    all resident at the end) and, for each node, its dependencies, its output and its temporary (resident while
    it runs). A bound, not always attained."""
    keep = sum(node.out_bytes for node in graph.nodes if node.keep)
    running = max(node.out_bytes + node.tmp_bytes + sum(graph.nodes[d].out_bytes for d in node.deps)
                  for node in graph.nodes)
    return graph.fixed_bytes + max(keep, running)


def graph_minimum(graph: Graph, time_limit: float = 10.0):
    """``(bytes, exact)``: the least peak of any frontier-advancing schedule (Checkmate's MILP with the peak as
    objective, ``exact`` True), or when it is not proven within ``time_limit`` seconds (building the model
    included; None: no limit), :func:`graph_lower_bound` (``exact`` False)."""
    from solvers.checkmate import least_peak

    if time_limit is not None and time_limit <= 0:
        return graph_lower_bound(graph), False
    peak, proven = least_peak(graph, time_limit=time_limit)
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
    from solvers.checkmate import NoSchedule
    from solvers.moccasin import moccasin

    left = deadline.left()
    try:
        solution = moccasin(graph, budget, time_limit=None if left is None else max(0.001, left))
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

    ``time_limit`` (seconds) is a deadline for the whole solve of the solvers
    that take one (building their model, their warm start and the search all
    within it, give or take :data:`TIME_LIMIT_TOLERANCE`); the plan then says
    whether the schedule is proven optimal. ``auto`` stores everything when
    that fits, else runs Checkmate, and when Checkmate proves that no
    frontier-advancing schedule fits, Moccasin over any order (with what is
    left of the time limit): a schedule that reorders the first computations
    may need less memory. Raises :class:`MemschedError` for an unknown solver
    or parameter, a budget below :func:`graph_lower_bound`, a budget no
    schedule of the solver's class fits (the message names the class, states
    the least memory of a frontier-advancing schedule, searched for at most
    ``minimum_time_limit`` seconds and no longer than the time limit leaves,
    and names the solver whose class may still fit), a time limit reached
    before any schedule was found (the message says what limit to give), or a
    schedule that does not fit.
    """
    if solver not in GRAPH_SOLVER_NAMES:
        raise MemschedError(f"unknown graph solver {solver!r}; choose one of {', '.join(GRAPH_SOLVER_NAMES)}")
    name = choose_graph_solver(graph, budget) if solver == "auto" else solver
    function = _function(name)
    given = solver_params(name, function, dict(params, time_limit=time_limit), ("graph", "budget"))
    if name == "moccasin":  # its options checked before the budget, so that a bad one is named as such
        from solvers.moccasin import check_options

        check_options(**{key: given[key] for key in ("max_computations", "first_order") if key in given})
    lower = graph_lower_bound(graph)
    if budget < lower:
        raise MemschedError(f"budget {format_bytes(budget)} ({budget} bytes) is below {format_bytes(lower)} "
                            f"({lower} bytes), the least memory any schedule of graph '{graph.name}' needs "
                            "(fixed bytes and the largest computation or set of kept values); raise the budget")
    from solvers.checkmate import NoSchedule

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
    result = GraphSimulator(graph).run(solution.schedule)
    if result.peak_bytes > budget:
        if name == "store_all":
            raise MemschedError(f"store_all: its schedule peaks at {format_bytes(result.peak_bytes)}, above the budget "
                                f"{format_bytes(budget)}; raise the budget or use --solver checkmate")
        raise MemschedError(f"{name}: its schedule peaks at {result.peak_bytes} bytes, above the budget {budget} "
                            "bytes (a numerical error of the solver); raise the budget slightly")
    return Plan(
        problem_name=graph.name,
        fingerprint=graph.fingerprint(),
        solver=name,
        params=solution.params,
        solve_seconds=elapsed,
        optimal=solution.optimal,
        gap=solution.gap,
        budget_bytes=budget,
        predicted=Predicted(peak_bytes=result.peak_bytes, time=result.time, baseline_time=graph.compute_time),
        schedule=solution.schedule,
        kind="graph",
    )
