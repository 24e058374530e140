"""Moccasin: the constraint-programming model of Bartan et al., "Moccasin: Efficient Tensor Rematerialization for
Neural Networks" (ICML 2023), on a :class:`planner.graph.Graph`, with OR-Tools CP-SAT.

:func:`moccasin` finds the fastest schedule computing each node at most ``max_computations`` times within the
budget (integer time slots, one computation each; retention intervals under one cumulative memory constraint),
its first computations in any order (``first_order="free"``) or in index order (``"index"``, a class that
contains Checkmate's). CP-SAT is hinted with the greedy schedule of :mod:`solvers.graph_heuristic` or a given
compute order; ``OPTIMAL`` is reported as optimal, ``FEASIBLE`` (a time limit) with the gap to CP-SAT's bound.
It returns a :class:`solvers.result.Solution` or raises :class:`solvers.result.NoSchedule`. docs/solvers.md
states the model and its implied constraints.
"""

from ortools.sat.python import cp_model

from planner.errors import MemschedError
from planner.graph import Graph
from planner.simulate.graph import schedule_with_frees
from solvers.graph_heuristic import greedy_order
from solvers.limits import Deadline, Progress, TimeLimitReached, enough_time, run_interruptibly
from solvers.result import NoSchedule, Solution, out_of_time

_WORKERS = 2
FIRST_ORDERS = ("free", "index")  # first_order: the order of the first computations of the nodes


def _time_units(times) -> int:
    """The smallest power of ten ``10^k`` (k <= 12) such that every time times it is whole (to 1e-6 of a unit)."""
    for k in range(13):
        scale = 10**k
        if all(abs(t * scale - round(t * scale)) <= 1e-6 * max(1.0, t * scale) for t in times):
            return scale
    return 10**12


def _add_hints(model, graph, order, counts, horizon, active, start, end, uses) -> bool:
    """Hint CP-SAT with the schedule of the compute ``order`` (eager frees): its computations in slot order, each
    value retained to its last read. Returns False (no hint) when the order computes a node more often than allowed."""
    seen = [0] * graph.size
    for v in order:
        seen[v] += 1
        if seen[v] > counts[v]:
            return False
    made_at, copy_of, last_read, reader = {}, [], list(range(len(order))), {}
    seen = [0] * graph.size
    for position, v in enumerate(order):
        for u in graph.nodes[v].deps:
            last_read[made_at[u]] = position
            reader[position, u] = made_at[u]
        made_at[v] = position
        copy_of.append(seen[v])
        seen[v] += 1
    slot = {(v, copy_of[p]): p for p, v in enumerate(order)}
    for (v, c), on in active.items():
        p = slot.get((v, c))
        model.AddHint(on, p is not None)
        model.AddHint(start[v, c], p if p is not None else 0)
        model.AddHint(end[v, c], (horizon if graph.nodes[v].keep else last_read[p] + 1) if p is not None else 1)
    for (u, c2, v, c), use in uses.items():
        p = slot.get((v, c))
        model.AddHint(use, p is not None and slot.get((u, c2)) == reader[p, u])
    return True


def _index_order(model, graph, counts, horizon, active, start) -> None:
    """``first_order="index"``: the first computation of node ``v`` is in slot ``>= v`` and before that of ``v+1``,
    and the implied constraints of that mode (docs/solvers.md)."""
    n = graph.size
    for v in range(n):
        model.Add(start[v, 0] >= v)
        model.Add(start[v, 0] <= horizon - n + v)
    for v in range(n - 1):
        model.Add(start[v, 0] < start[v + 1, 0])
    # the largest index among v and its descendants: a useful recomputation of v precedes its first computation
    reach = list(range(n))
    for v in reversed(range(n)):
        for c in graph.consumers[v]:
            reach[v] = max(reach[v], reach[c])
    used = sum(active.values())
    for (v, c), on in active.items():
        model.Add(start[v, c] < used)  # no empty slot before the last computation
        if c:
            model.Add(start[v, c] < start[reach[v], 0]).OnlyEnforceIf(on)


def check_options(max_computations: int = 2, first_order: str = "free") -> None:
    """Raise a one-line :class:`MemschedError` for a bad ``max_computations`` or ``first_order``."""
    if isinstance(max_computations, bool) or not isinstance(max_computations, int) or max_computations < 1:
        raise MemschedError(f"moccasin: max_computations must be a whole number >= 1, got {max_computations!r}")
    if first_order not in FIRST_ORDERS:
        raise MemschedError(f"moccasin: first_order must be one of {', '.join(map(repr, FIRST_ORDERS))}, "
                            f"got {first_order!r}")


def _hint_order(graph: Graph, hint) -> tuple:
    """A compute order given as ``hint``, checked: every node computed, each after its dependencies."""
    try:
        order = tuple(int(v) for v in hint)
    except (TypeError, ValueError):
        order = None
    seen = set()
    for v in order or ():
        if not 0 <= v < graph.size or not seen.issuperset(graph.nodes[v].deps):
            order = None
            break
        seen.add(v)
    if order is None or len(seen) != graph.size:
        raise MemschedError("moccasin: hint must be True, False, None or a compute order of the graph (node indices, "
                            "each node at least once and after its dependencies)")
    return order


def moccasin(graph: Graph, budget: int, max_computations: int = 2, time_limit=None, hint=True,
             first_order: str = "free"):
    """The fastest schedule computing each node at most ``max_computations`` times within ``budget`` bytes, its
    first computations in any order (``first_order="free"``) or in index order (``"index"``, Checkmate's order);
    CP-SAT starts from the heuristic schedule of :mod:`solvers.graph_heuristic` when ``hint`` is True and one is
    found, or from ``hint`` when it is a compute order. ``time_limit`` (seconds) is a deadline for the whole
    solve: the heuristic, building the model (which stops at it: :class:`NoSchedule` then says what limit to
    give) and CP-SAT, which gets what is left."""
    check_options(max_computations, first_order)
    deadline = Deadline(time_limit)
    try:
        return _moccasin(graph, budget, max_computations, time_limit, hint, first_order, deadline)
    except TimeLimitReached as exc:
        raise out_of_time(time_limit, exc, f"{graph.size} nodes, {max_computations} computations each") from None


def _moccasin(graph: Graph, budget: int, max_computations: int, time_limit, hint, first_order: str,
              deadline: Deadline):
    if hint is None or hint is False:
        hint = None
    elif hint is not True:
        hint = _hint_order(graph, hint)
    else:
        hint = greedy_order(graph, budget, 5.0 if time_limit is None else max(0.0, min(5.0, 0.1 * time_limit)))
    n = graph.size
    nodes = graph.nodes
    consumers = graph.consumers
    counts = [1 if node.keep or not consumers[v] else max_computations for v, node in enumerate(nodes)]
    horizon = sum(counts)
    scale = _time_units([node.time for node in nodes])
    cost = [round(node.time * scale) for node in nodes]
    model = cp_model.CpModel()
    active, start, end, units, retained, uses = {}, {}, {}, [], [], {}
    # the deadline is checked as the model grows (a rough measure of the work: each node's variables, then its
    # dependency choices)
    progress = Progress(deadline, "building the model", n + sum(
        counts[v] * sum(counts[u] for u in node.deps) for v, node in enumerate(nodes)))
    done = 0
    for v in range(n):
        for c in range(counts[v]):
            on = model.NewBoolVar(f"a_{v}_{c}")
            s = model.NewIntVar(0, horizon - 1, f"s_{v}_{c}")
            e = model.NewIntVar(1, horizon, f"e_{v}_{c}")
            length = model.NewIntVar(1, horizon, f"l_{v}_{c}")
            units.append((model.NewOptionalIntervalVar(s, 1, s + 1, on, f"u_{v}_{c}"), nodes[v].tmp_bytes))
            retained.append((model.NewOptionalIntervalVar(s, length, e, on, f"r_{v}_{c}"), nodes[v].out_bytes))
            if nodes[v].keep:
                model.Add(e == horizon)
            if c == 0:
                model.Add(on == 1)
            else:
                model.AddImplication(on, active[v, c - 1])
                model.Add(s >= end[v, c - 1]).OnlyEnforceIf(on)
                model.Add(s == 0).OnlyEnforceIf(on.Not())
                model.Add(e == 1).OnlyEnforceIf(on.Not())
            active[v, c], start[v, c], end[v, c] = on, s, e
        progress.step(done := done + 1)
    model.AddNoOverlap([interval for interval, _ in units])
    capacity = budget - graph.fixed_bytes
    intervals = units + retained
    model.AddCumulative([i for i, _ in intervals], [d for _, d in intervals], capacity)
    for v, node in enumerate(nodes):
        for c in range(counts[v]):
            for u in node.deps:
                choices = []
                for c2 in range(counts[u]):
                    use = model.NewBoolVar(f"use_{u}_{c2}_{v}_{c}")
                    model.AddImplication(use, active[u, c2])
                    model.Add(start[u, c2] < start[v, c]).OnlyEnforceIf(use)
                    model.Add(end[u, c2] > start[v, c]).OnlyEnforceIf(use)
                    choices.append(use)
                    uses[u, c2, v, c] = use
                model.AddBoolOr(choices).OnlyEnforceIf(active[v, c])
        progress.step(done := done + counts[v] * sum(counts[u] for u in node.deps))
    if first_order == "index":
        _index_order(model, graph, counts, horizon, active, start)
    else:
        random_nodes = [v for v, node in enumerate(nodes) if node.random]
        for u, v in zip(random_nodes, random_nodes[1:]):
            model.Add(start[u, 0] < start[v, 0])
        for v, node in enumerate(nodes):  # implied: every computation of v follows the first computation of its deps
            for u in node.deps:
                model.Add(start[u, 0] < start[v, 0])
    if hint:
        _add_hints(model, graph, hint, counts, horizon, active, start, end, uses)
    model.Minimize(sum(cost[v] * active[v, c] for v in range(n) for c in range(1, counts[v])))
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = _WORKERS
    if time_limit is not None:  # what is left, less a margin for reading and replaying the schedule
        solver.parameters.max_time_in_seconds = max(0.001, deadline.left() - 0.05 - 0.01 * time_limit)
    solver.parameters.catch_sigint_signal = False  # Ctrl-C stops it through run_interruptibly instead
    status = run_interruptibly(lambda: solver.Solve(model), solver.StopSearch)
    if status == cp_model.INFEASIBLE:
        raise NoSchedule(f"no schedule with at most {max_computations} computations per node fits the budget "
                         "(proven infeasible)", proven=True)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        limit = "the time limit" if time_limit is None else f"the time limit ({time_limit:g} s)"
        raise NoSchedule(f"{limit} ran out before any schedule was found", proven=False,
                         enough=None if time_limit is None else enough_time(4 * time_limit))
    order = sorted(((solver.Value(start[v, c]), v) for (v, c), on in active.items() if solver.Value(on)))
    optimal = status == cp_model.OPTIMAL
    baseline = sum(cost)
    total = baseline + solver.ObjectiveValue()
    gap = 0.0 if optimal else max(0.0, (total - baseline - solver.BestObjectiveBound()) / total)
    params = {"max_computations": max_computations}
    if first_order != "free":
        params["first_order"] = first_order
    if time_limit is not None:
        params["time_limit"] = time_limit
    return Solution(schedule_with_frees(graph, [v for _, v in order]), params=params, optimal=optimal, gap=gap)
