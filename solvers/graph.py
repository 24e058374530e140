"""Graph solvers and the one entry point that runs them: :func:`solve_graph`, the graph twin of :func:`solvers.solve`.

Each solver takes ``(graph, budget_bytes, **params)`` and returns a
:class:`GraphSolution`; :func:`solve_graph` times it, replays its schedule in
the graph simulator (whose figures, not the solver's, go into the plan) and
refuses a schedule that does not fit. The solver modules (highspy, pulp for CBC, OR-Tools) are
imported when first used. Solvers never import torch.
"""

import importlib
import time
from dataclasses import dataclass, field

from planner.errors import MemschedError
from planner.graph import Graph, store_all_graph_schedule
from planner.graph_simulator import GraphSimulator
from planner.plan import Plan, Predicted
from planner.units import format_bytes
from solvers.limits import Deadline
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
    """``auto``: store everything when it fits (no overhead), else Checkmate's exact MILP."""
    return "store_all" if budget >= store_all_graph_peak(graph) else "checkmate"


def _infeasible(graph: Graph, budget: int, what: str, minimum_time_limit: float, deadline=None) -> MemschedError:
    """The error of a budget proven infeasible, with the least memory searched for within ``minimum_time_limit``
    seconds and what is left of the solve's ``deadline`` (:class:`solvers.limits.Deadline`)."""
    left = None if deadline is None else deadline.left()
    if left is not None:
        left -= 0.1  # for the message
        minimum_time_limit = left if minimum_time_limit is None else min(minimum_time_limit, left)
    minimum, exact = graph_minimum(graph, minimum_time_limit)
    if exact:
        least = (f"the least memory of any frontier-advancing schedule is {format_bytes(minimum)} ({minimum} bytes)")
    else:
        least = f"no schedule needs less than {format_bytes(minimum)} ({minimum} bytes) (a lower bound)"
    return MemschedError(f"budget {format_bytes(budget)} ({budget} bytes) is infeasible for graph '{graph.name}' "
                         f"({what}); {least}; raise the budget")


def solve_graph(graph: Graph, budget: int, solver: str = "auto", time_limit: float = None,
                minimum_time_limit: float = 10.0, **params) -> Plan:
    """The plan ``solver`` finds for ``graph`` within ``budget`` bytes, its figures from the graph simulator.

    ``time_limit`` (seconds) is a deadline for the whole solve of the solvers
    that take one (building their model, their warm start and the search all
    within it, give or take :data:`TIME_LIMIT_TOLERANCE`); the plan then says
    whether the schedule is proven optimal. Raises :class:`MemschedError` for
    an unknown solver or parameter, a budget no schedule fits (the message
    states the least memory found, searched for at most ``minimum_time_limit``
    seconds and no longer than the time limit leaves), a time limit reached
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
        if exc.proven:
            raise _infeasible(graph, budget, f"{name}: {exc}", minimum_time_limit, deadline) from None
        more = "give it more time (--time-limit)" if exc.enough is None else f"give --time-limit {exc.enough} or more"
        raise MemschedError(f"{name}: {exc}, for graph '{graph.name}' at {format_bytes(budget)}; {more}, "
                            "or a larger budget") from None
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
