"""Checkmate (Jain et al., "Checkmate: Breaking the Memory Wall with Optimal Tensor Rematerialization", MLSys 2020)
on a :class:`planner.graph.Graph`: the fastest *frontier-advancing* schedule within a budget.

* :func:`checkmate`: the exact MILP (solvers/checkmate/model.py), started from the greedy schedule of
  :mod:`solvers.graph_heuristic`, with a time limit after the LP relaxation's safe bound and roundings; optimal
  from the solver's own status, else with its gap to the bound.
* :func:`checkmate_lp`: the paper's LP relaxation with randomised rounding, never claimed optimal.
* :func:`least_frontier_peak`: the least peak of any frontier-advancing schedule (the MILP with the peak as
  objective).

Each returns a :class:`solvers.result.Solution` or raises :class:`solvers.result.NoSchedule`. docs/solvers.md
states the model, its reductions, the backends and the rounding.
"""

import numpy as np

from planner.graph import Graph
from planner.simulate.graph import GraphSimulator, schedule_with_frees
from solvers.checkmate.model import CheckmateModel
from solvers.graph_heuristic import greedy_order
from solvers.limits import Deadline, TimeLimitReached, enough_time
from solvers.result import NoSchedule, Solution, out_of_time

_LP_FIRST = True  # with a time limit, solve the LP relaxation first (bound and roundings)
_LP_SHARE = 0.85  # of the time left after the heuristic (if the LP does not finish, neither would the MILP)
_LP_FIRST_COST = 2.0  # the LP first only with at least this many times the model's building time left
_MARGIN = 0.05  # seconds (and 1% of the limit) kept for reading and replaying the schedule


def checkmate(graph: Graph, budget: int, backend: str = "highs", time_limit=None, gap: float = 0.0):
    """The fastest frontier-advancing schedule within ``budget`` bytes (proven optimal unless a time limit stopped
    the search, or ``gap`` > 0 allowed one relatively that far from the bound).

    ``time_limit`` (seconds) is a deadline for the whole solve: the greedy start, building the model, the LP
    first, its roundings and the MILP each get only what is left of it. When it runs out before the MILP
    could run, the best schedule so far (the greedy start, or a rounding of the LP) is returned, not proven
    optimal; when there is none, :class:`NoSchedule` says what time limit to give instead.
    """
    margin = 0.0 if time_limit is None else _MARGIN + 0.01 * time_limit  # for reading and replaying the schedule
    solve_by = Deadline(None if time_limit is None else max(0.0, time_limit - margin))
    params = {"backend": backend} if time_limit is None else {"backend": backend, "time_limit": time_limit}
    if gap:
        params["gap"] = gap
    heuristic_limit = 5.0 if time_limit is None else max(0.0, min(5.0, 0.1 * time_limit))
    start_order = greedy_order(graph, budget, heuristic_limit)
    simulator = GraphSimulator(graph)
    lower = None  # a lower bound on the step time (model units, offset included), from the LP

    def best_so_far():  # when the time runs out before the MILP: the start, with its gap to the bound
        if start_order is None:
            return None
        seconds = simulator.run(schedule_with_frees(graph, start_order)).time
        bound = graph.compute_time if lower is None else lower * model.unit_time
        return Solution(schedule_with_frees(graph, start_order), params=params, optimal=False,
                             gap=max(0.0, (seconds - bound) / seconds) if seconds > 0 else 0.0)

    model = None
    try:
        model = CheckmateModel(graph, budget, deadline=solve_by)
    except TimeLimitReached as exc:
        if start_order is not None:
            return best_so_far()
        raise out_of_time(time_limit, exc, f"{graph.size} nodes") from None
    left = solve_by.left()
    if left is not None and _LP_FIRST and backend == "highs" and left > _LP_FIRST_COST * model.build_seconds:
        # a time limit may stop the MILP before its root LP: first the LP by the interior point method, for a
        # bound that holds whatever happens next, and its roundings, for a better start
        lower, values = model.relaxation(_LP_SHARE * left)
        if values is not None:
            found = _best_rounding(graph, {key: values[col] for key, col in model.S.items()}, budget, 8,
                                   np.random.default_rng(0), simulator, solve_by)
            if found is not None and (start_order is None or found[0] < simulator.run(
                    schedule_with_frees(graph, start_order)).time):
                start_order = found[1]
    if solve_by.passed() and start_order is not None:
        return best_so_far()
    start = None if start_order is None else model.start_vector(start_order)
    if lower is not None and start is not None:  # the start may already be within the gap asked for of the LP's bound
        upper = float(np.dot(model.col_cost, start)) + model.objective_offset
        if upper - lower <= max(gap, 1e-9) * upper:
            return Solution(schedule_with_frees(graph, start_order), params=params,
                                 optimal=upper - lower <= 1e-9 * upper, gap=max(0.0, (upper - lower) / upper))
    if solve_by.passed() and start_order is not None:
        return best_so_far()
    try:
        result = model.solve(backend, solve_by, gap, start=start)
    except NoSchedule as exc:
        if exc.proven or time_limit is None:
            raise
        if start_order is None:
            raise NoSchedule(f"the time limit ({time_limit:g} s) ran out before any schedule was found (the greedy "
                             f"start found none within the budget; the model took {model.build_seconds:.1f} s to "
                             "build)", proven=False, enough=enough_time(4 * time_limit)) from None
        return best_so_far()  # a start the model cannot take (outside its class) is still a schedule
    optimal, gap_value = result.optimal, result.gap
    if not optimal and lower is not None and result.objective:
        gap_value = min(gap_value, max(0.0, (result.objective - lower) / result.objective))
    return Solution(schedule_with_frees(graph, result.order), params=params, optimal=optimal, gap=gap_value)


def _rebuild(graph: Graph, checkpoints) -> tuple:
    """The compute order that makes the rounded checkpoint sets valid with the least recomputation.

    ``checkpoints[t]`` is the set of values resident when stage ``t`` starts;
    stage ``t`` recomputes, in index order, what node ``t`` and the values
    checkpointed into stage ``t+1`` need and is not resident (recursively).
    """
    order = []
    n = graph.size
    for t in range(n):
        have = set(checkpoints[t])
        wanted = {t} | {i for i in (checkpoints[t + 1] if t + 1 < n else ()) if i not in have}
        stack = list(wanted)
        while stack:
            v = stack.pop()
            for dep in graph.nodes[v].deps:
                if dep not in have and dep not in wanted:
                    wanted.add(dep)
                    stack.append(dep)
        order += sorted(wanted)
    return tuple(order)


def checkmate_lp(graph: Graph, budget: int, backend: str = "highs", samples: int = 16, seed: int = 0,
                 time_limit=None):
    """Checkmate's LP relaxation with rounding: the fastest feasible schedule among the roundings tried (never
    marked optimal; its gap to the LP's safe bound at the true budget, when HiGHS solved it). ``samples``
    randomised roundings per LP; ``time_limit`` bounds the whole search (seconds)."""
    rng = np.random.default_rng(seed)
    simulator = GraphSimulator(graph)
    deadline = Deadline(None if time_limit is None else max(0.0, time_limit - _MARGIN - 0.01 * time_limit))
    best = None
    bound = None  # a lower bound on the step time: from the LP at the true budget
    stopped = None  # the phase the deadline stopped, if any
    for fraction in (1.0, 0.9, 0.8, 0.65, 0.5):
        if fraction < 1.0 and deadline.passed():  # the first model is built in any case: it says how far it got
            break
        target = graph.fixed_bytes + int((budget - graph.fixed_bytes) * fraction)
        try:
            model = CheckmateModel(graph, target, relaxed=True, deadline=deadline)
        except TimeLimitReached as exc:
            stopped = exc
            break
        try:
            model.solve(backend, deadline)
        except NoSchedule:
            continue
        if fraction == 1.0 and model.row_dual is not None:
            bound = model.safe_bound(model.row_dual) * model.unit_time
        found = _best_rounding(graph, model.values(model.S), budget, samples, rng, simulator, deadline)
        if found is not None and (best is None or found[0] < best[0]):
            best = (found[0], schedule_with_frees(graph, found[1]))
        if best is not None:
            break
    if best is None and stopped is not None:
        raise out_of_time(time_limit, stopped, f"{graph.size} nodes")
    if best is None and deadline.passed():
        raise NoSchedule(f"the time limit ({time_limit:g} s) ran out before any schedule was found (no rounding "
                         "of the LP relaxation fitted the budget by then)",
                         proven=False, enough=enough_time(4 * time_limit))
    if best is None:
        raise NoSchedule("no rounding of the LP relaxation fits the budget (the budget may still be feasible: "
                         "try --solver checkmate)", proven=False)
    params = {"backend": backend, "samples": samples, "seed": seed}
    if time_limit is not None:
        params["time_limit"] = time_limit
    gap = None if bound is None else max(0.0, (best[0] - bound) / best[0]) if best[0] > 0 else 0.0
    return Solution(best[1], params=params, optimal=False, gap=gap)


def _best_rounding(graph: Graph, values: dict, budget: int, samples: int, rng, simulator=None,
                   deadline: Deadline = None):
    """``(seconds, compute order)`` of the fastest rounding of the LP values ``S[t,i]`` (``values``) that fits the
    budget (deterministic at 1/2, then ``samples`` randomised, as far as ``deadline`` allows), or None."""
    simulator = simulator or GraphSimulator(graph)
    keys = list(values)
    kept = [{i for i in range(t) if graph.nodes[i].keep} for t in range(graph.size)]
    best = None
    for number, draw in enumerate([np.full(len(keys), 0.5)] + [rng.random(len(keys)) for _ in range(samples)]):
        if number and deadline is not None and deadline.passed():
            break
        checkpoints = [set(k) for k in kept]
        for (t, i), u in zip(keys, draw):
            if values[t, i] > u:
                checkpoints[t].add(i)
        order = _rebuild(graph, checkpoints)
        result = simulator.run(schedule_with_frees(graph, order))
        if result.peak_bytes <= budget and (best is None or result.time < best[0]):
            best = (result.time, order)
    return best


def least_frontier_peak(graph: Graph, backend: str = "highs", time_limit=None):
    """(bytes, proven): the least peak of any frontier-advancing schedule, or ``(None, False)`` when the time
    limit (building the model included) stops the search first. ``fixed_bytes`` included."""
    deadline = Deadline(time_limit)
    try:
        model = CheckmateModel(graph, None, deadline=deadline)
        result = model.solve(backend, deadline)
    except (NoSchedule, TimeLimitReached):
        return None, False
    if result.optimal:
        peak = GraphSimulator(graph).run(schedule_with_frees(graph, result.order)).peak_bytes
        return peak, True
    return None, False
