"""Graph solvers checked against exhaustive search, against each other and against the extreme schedules.

Schedule classes (tests/graph_brute.py): Checkmate is exact over frontier-advancing schedules (first
computations in index order, each stage's recomputations in index order); Moccasin is exact over any order
with at most C computations per node. So checkmate equals the frontier-restricted brute force, moccasin the
C-restricted one, and an unrestricted schedule can be faster than Checkmate's: the instances below where it
is come from the fixed order of first computations (restricting the brute force to first computations in
index order closes the difference).
"""

import dataclasses

import pytest

from checks import one_line
from oracles.graph_brute import fastest_time, least_peak
from planner.errors import MemschedError
from planner.graph import Graph, GraphNode
from planner.simulate.graph import GraphSimulator, schedule_with_frees, store_all_graph_schedule
from profiles.synthetic import random_graph
from solvers import graph_lower_bound, graph_minimum, solve_graph, store_all_graph_peak
from solvers.checkmate import checkmate, checkmate_lp, least_frontier_peak
from solvers.checkmate.model import CheckmateModel
from solvers.graph_heuristic import greedy_order
from solvers.moccasin import moccasin

SHAPES = ("random", "resnet", "transformer")


def tiny(seed):
    """A training graph of 5 to 9 nodes with sizes of a few dozen bytes."""
    return random_graph(seed, 5 + seed % 5, scale_bytes=20, shape=SHAPES[seed % 3])


def budgets(graph, low):
    high = store_all_graph_peak(graph)
    return sorted({low, (low + high) // 2, high})


def same_time(a, b):
    return abs(a - b) <= 1e-9 * max(abs(a), abs(b))


def simulated(graph, solution, budget):
    result = GraphSimulator(graph).run(solution.schedule)
    assert result.peak_bytes <= budget
    return result


@pytest.mark.parametrize("seed", range(24))
def test_checkmate_equals_brute_force_over_its_class(seed):
    graph = tiny(seed)
    low = least_peak(graph, frontier=True)
    assert least_frontier_peak(graph) == (low, True)
    for budget in budgets(graph, low):
        solution = checkmate(graph, budget)
        assert solution.optimal and solution.gap == 0.0
        assert same_time(simulated(graph, solution, budget).time, fastest_time(graph, budget, frontier=True))
    with pytest.raises(MemschedError, match="infeasible"):
        checkmate(graph, low - 1)


@pytest.mark.parametrize("seed", range(0, 24, 3))
def test_moccasin_equals_brute_force_with_two_computations(seed):
    graph = tiny(seed)
    low = least_peak(graph)
    for budget in budgets(graph, low)[:2]:
        fastest = fastest_time(graph, budget, max_computations=2)
        if fastest == float("inf"):  # the least memory needs a third computation of some node
            with pytest.raises(MemschedError, match="at most 2 computations per node.*proven infeasible"):
                moccasin(graph, budget, max_computations=2, time_limit=30)
            continue
        solution = moccasin(graph, budget, max_computations=2, time_limit=30)
        assert solution.optimal
        assert same_time(simulated(graph, solution, budget).time, fastest)


@pytest.mark.parametrize("seed", range(1, 24, 4))
def test_index_order_moccasin_equals_brute_force_over_its_class(seed):
    graph = tiny(seed)
    # every node 'random': the brute force keeps all first computations in index order
    ordered = dataclasses.replace(graph, nodes=tuple(dataclasses.replace(v, random=True) for v in graph.nodes))
    low = least_peak(ordered)
    for budget in budgets(graph, low)[:2]:
        fastest = fastest_time(ordered, budget, max_computations=2)
        if fastest == float("inf"):
            with pytest.raises(MemschedError, match="proven infeasible"):
                moccasin(graph, budget, max_computations=2, time_limit=30, first_order="index")
            continue
        solution = moccasin(graph, budget, max_computations=2, time_limit=30, first_order="index")
        assert solution.optimal and first_computations(solution.schedule) == list(range(graph.size))
        assert same_time(simulated(graph, solution, budget).time, fastest)


@pytest.mark.parametrize("seed, budget", [(18, 209), (34, 122)])
def test_unrestricted_order_beats_checkmate_only_through_the_order_of_first_computations(seed, budget):
    graph = tiny(seed)
    unrestricted = fastest_time(graph, budget)
    frontier = fastest_time(graph, budget, frontier=True)
    assert unrestricted < frontier
    assert same_time(simulated(graph, checkmate(graph, budget), budget).time, frontier)
    # Moccasin is not bound to the index order: it finds the faster schedule
    assert same_time(simulated(graph, moccasin(graph, budget, max_computations=3), budget).time, unrestricted)
    # first computations forced into index order (every node 'random'): the difference is gone
    ordered = dataclasses.replace(graph, nodes=tuple(dataclasses.replace(v, random=True) for v in graph.nodes))
    assert same_time(fastest_time(ordered, budget), frontier)
    index = moccasin(graph, budget, max_computations=3, first_order="index")
    assert index.optimal and same_time(simulated(graph, index, budget).time, frontier)


def first_computations(schedule):
    """The nodes in the order of their first computation."""
    order = []
    for op in schedule:
        if op.kind == "compute" and op.node not in order:
            order.append(op.node)
    return order


@pytest.mark.slow
@pytest.mark.parametrize("seed, size", [(0, 12), (1, 16), (2, 20), (7, 24), (3, 27), (5, 29), (6, 30)])
def test_medium_graphs_solvers_agree(seed, size):
    graph = random_graph(100 + seed, size, scale_bytes=1000, shape=SHAPES[seed % 3])
    minimum, exact = graph_minimum(graph, 60)  # proven in a second or two, unless the machine is loaded
    assert exact
    budget = (minimum + store_all_graph_peak(graph)) // 2
    highs = checkmate(graph, budget, time_limit=30)
    cbc = checkmate(graph, budget, backend="cbc", time_limit=30)
    assert highs.optimal and cbc.optimal
    fastest = simulated(graph, highs, budget).time
    assert same_time(simulated(graph, cbc, budget).time, fastest)
    # Checkmate's schedule is one of Moccasin's when C covers its recomputations, so Moccasin's optimum is at
    # least as fast, and its proven bound never above Checkmate's time
    counts = [sum(op == ("compute", v) for op in highs.schedule) for v in range(graph.size)]
    computations = max(2, *counts)
    order = [op.node for op in highs.schedule if op.kind == "compute"]
    if size >= 24:
        # first computations in index order, as Checkmate's: both proven optimal, the same time
        index = moccasin(graph, budget, max_computations=computations, time_limit=60, first_order="index")
        assert index.optimal and index.gap == 0.0 and index.params["first_order"] == "index"
        assert first_computations(index.schedule) == list(range(graph.size))
        assert same_time(simulated(graph, index, budget).time, fastest)
        # free order, started from Checkmate's schedule: CP-SAT does not prove its optimum in test time, but
        # never returns a slower schedule, and its bound is never above Checkmate's time
        mocc = moccasin(graph, budget, max_computations=computations, time_limit=2, hint=order)
    else:
        mocc = moccasin(graph, budget, max_computations=computations, time_limit=20)
    assert "first_order" not in mocc.params
    mocc_time = simulated(graph, mocc, budget).time
    assert (1 - mocc.gap) * mocc_time <= fastest * (1 + 1e-9)
    assert mocc_time <= fastest * (1 + 1e-9)
    if size <= 20:
        assert mocc.optimal
    rounded = checkmate_lp(graph, budget)
    assert not rounded.optimal
    rounded_time = simulated(graph, rounded, budget).time
    assert rounded_time >= fastest * (1 - 1e-9)
    # its gap is to a safe lower bound from the LP: never above the MILP's optimum
    assert rounded.gap is not None and (1 - rounded.gap) * rounded_time <= fastest * (1 + 1e-9)


@pytest.mark.parametrize("seed, size", [(0, 12), (1, 16), (3, 30), (4, 20)])
def test_heuristic_start_fits_and_is_a_point_of_the_model(seed, size):
    graph = random_graph(100 + seed, size, scale_bytes=1000, shape=SHAPES[seed % 3])
    high = store_all_graph_peak(graph)
    assert greedy_order(graph, high) == tuple(range(graph.size))  # store-all when it fits
    found = 0
    for fraction in (0.6, 0.75, 0.9):
        budget = int(fraction * high)
        order = greedy_order(graph, budget)
        if order is None:
            continue
        found += 1
        result = GraphSimulator(graph).run(schedule_with_frees(graph, order))
        assert result.peak_bytes <= budget
        model = CheckmateModel(graph, budget)
        assert model.start_vector(order) is not None  # a feasible point of the MILP: the incumbent HiGHS starts from
        optimum = checkmate(graph, budget, time_limit=30)
        if optimum.optimal:
            assert result.time >= simulated(graph, optimum, budget).time * (1 - 1e-9)
    assert found


def test_warm_starts_change_no_optimum():
    graph = random_graph(106, 16, scale_bytes=1000, shape="transformer")
    budget = int(0.85 * store_all_graph_peak(graph))
    order = greedy_order(graph, budget)
    assert order is not None
    cold = CheckmateModel(graph, budget).solve("highs", 30)
    warm = CheckmateModel(graph, budget).solve("highs", 30, start_order=order)
    warm_cbc = CheckmateModel(graph, budget).solve("cbc", 30, start_order=order)
    assert cold.optimal and warm.optimal and warm_cbc.optimal
    times = [GraphSimulator(graph).run(schedule_with_frees(graph, r.order)).time for r in (cold, warm, warm_cbc)]
    assert same_time(times[0], times[1]) and same_time(times[0], times[2])
    hinted = moccasin(graph, budget, max_computations=2, time_limit=20)
    plain = moccasin(graph, budget, max_computations=2, time_limit=20, hint=False)
    assert hinted.optimal and plain.optimal
    assert same_time(simulated(graph, hinted, budget).time, simulated(graph, plain, budget).time)


def test_gap_asked_for_is_honoured_against_a_valid_bound():
    graph = random_graph(101, 16, scale_bytes=1000, shape="resnet")
    budget = (graph_minimum(graph)[0] + store_all_graph_peak(graph)) // 2
    fastest = simulated(graph, checkmate(graph, budget), budget).time
    for gap in (0.5, 0.01):
        solution = checkmate(graph, budget, time_limit=30, gap=gap)
        seconds = simulated(graph, solution, budget).time
        assert solution.gap <= gap and (1 - solution.gap) * seconds <= fastest * (1 + 1e-9) <= seconds * (1 + 2e-9)
        # a solver that stops within the gap asked for reports "optimal": the plan is optimal only at gap 0
        assert solution.optimal == (solution.gap <= 1e-9)
        assert not solution.optimal or same_time(seconds, fastest)


def chain_graph(length, seed):
    """A chain-shaped training graph: forward nodes in a line, the loss, and the mirrored backward."""
    return random_graph(seed, 2 * length + 1, skip=0.0, dropout=0.0, scale_bytes=1000, shape="random")


def recompute_all_order(graph):
    """Forward once; then before each backward node, recompute the forward line from the start up to what it reads."""
    forward = [i for i, node in enumerate(graph.nodes) if not node.backward]
    order = list(forward)
    for j, node in enumerate(graph.nodes):
        if node.backward:
            reads = [d for d in node.deps if not graph.nodes[d].backward]
            if reads:
                order += [i for i in forward if i <= max(reads) and not graph.nodes[i].keep]
            order.append(j)
    return order


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3))
def test_chain_shaped_graph_between_the_extremes(seed):
    graph = chain_graph(6, seed)
    baseline = graph.compute_time
    high = store_all_graph_peak(graph)
    extreme = GraphSimulator(graph).run(schedule_with_frees(graph, recompute_all_order(graph)))
    assert extreme.peak_bytes < high
    for name in ("checkmate", "moccasin", "checkmate-lp"):
        plan = solve_graph(graph, high, name, time_limit=30)
        assert same_time(plan.predicted.time, baseline) and plan.predicted.peak_bytes <= high
        params = {"max_computations": 3} if name == "moccasin" else {}
        plan = solve_graph(graph, extreme.peak_bytes, name, time_limit=10, **params)
        assert baseline * (1 - 1e-9) <= plan.predicted.time <= extreme.time * (1 + 1e-9)


def test_solve_graph_plan_and_auto():
    graph = random_graph(7, 20, scale_bytes=1000)
    peak = store_all_graph_peak(graph)
    plan = solve_graph(graph, peak)
    assert plan.solver == "store_all" and plan.kind == "graph" and plan.optimal
    assert plan.schedule == store_all_graph_schedule(graph)
    budget = int(0.85 * peak)
    plan = solve_graph(graph, budget)
    assert plan.solver == "checkmate" and plan.optimal and plan.gap == 0.0
    result = GraphSimulator(graph).run(plan.schedule)
    assert (plan.predicted.peak_bytes, plan.predicted.time) == (result.peak_bytes, result.time)
    assert plan.fingerprint == graph.fingerprint()


def test_solve_graph_errors():
    graph = random_graph(7, 20, scale_bytes=1000)
    peak = store_all_graph_peak(graph)
    with pytest.raises(MemschedError, match="unknown graph solver 'rotor'"):
        solve_graph(graph, peak, "rotor")
    with pytest.raises(MemschedError, match="takes no parameter 'slots'"):
        solve_graph(graph, peak, "checkmate", slots=3)
    with pytest.raises(MemschedError, match="store_all: its schedule peaks"):
        solve_graph(graph, peak - 1, "store_all")
    low = graph_lower_bound(graph)
    with pytest.raises(MemschedError, match=f"below .*{low} bytes"):
        solve_graph(graph, low - 1, "checkmate")
    minimum, exact = graph_minimum(graph)
    assert exact and low <= minimum < peak
    assert solve_graph(graph, minimum, "checkmate").predicted.peak_bytes <= minimum
    if minimum > low:
        with pytest.raises(MemschedError, match=f"no frontier-advancing schedule .*least memory of any "
                                                f"frontier-advancing schedule is .*{minimum} bytes.*--solver moccasin"):
            solve_graph(graph, minimum - 1, "checkmate")


def test_moccasin_options_are_validated():
    graph = random_graph(7, 20, scale_bytes=1000)
    budget = int(0.85 * store_all_graph_peak(graph))
    for bad in ("stages", "INDEX", None, 1):
        with pytest.raises(MemschedError, match="first_order must be one of 'free', 'index', got") as caught:
            moccasin(graph, budget, first_order=bad)
        one_line(caught)
    with pytest.raises(MemschedError, match="first_order must be one of 'free', 'index', got 'stages'"):
        solve_graph(graph, budget, "moccasin", first_order="stages")
    with pytest.raises(MemschedError, match="solver 'checkmate' takes no parameter 'first_order'"):
        solve_graph(graph, budget, "checkmate", first_order="index")
    reader = max(v for v, node in enumerate(graph.nodes) if node.deps)
    early = [reader] + [v for v in range(graph.size) if v != reader]  # a node before its dependencies
    for bad in (early, list(range(graph.size - 1)), [-1] + list(range(graph.size)), "abc", 3):
        with pytest.raises(MemschedError, match="hint must be True, False, None or a compute order"):
            moccasin(graph, budget, hint=bad)
    plan = solve_graph(graph, budget, "moccasin", time_limit=30, first_order="index")
    assert plan.params == {"max_computations": 2, "time_limit": 30, "first_order": "index"} and plan.optimal
    assert first_computations(plan.schedule) == list(range(graph.size))
    assert same_time(plan.predicted.time, solve_graph(graph, budget, "checkmate").predicted.time)


def test_time_limit_without_schedule_is_a_clear_error():
    graph = random_graph(3, 120, scale_bytes=1000, shape="transformer")
    budget = int(0.5 * store_all_graph_peak(graph))
    with pytest.raises(MemschedError, match="time limit .* ran out before any schedule was found"):
        solve_graph(graph, budget, "moccasin", time_limit=0.01)


def test_time_limit_reports_true_status_and_gap():
    graph = random_graph(0, 60, shape="transformer")
    budget = int(0.6 * store_all_graph_peak(graph))
    try:
        plan = solve_graph(graph, budget, "checkmate", time_limit=3)
    except MemschedError as exc:  # no schedule yet when the limit struck: said so, not reported as a plan
        assert "ran out before any schedule was found" in str(exc)
        return
    assert plan.params["time_limit"] == 3 and plan.predicted.peak_bytes <= budget
    # optimal only with a zero gap from HiGHS's own status and bound, never pulp's "Optimal" label
    assert plan.optimal == (plan.gap == 0.0) and plan.gap is not None


def test_keep_node_never_recomputed_and_random_order_kept():
    nodes = (GraphNode("a", 1.0, 10, ()), GraphNode("r1", 1.0, 10, (0,), random=True),
             GraphNode("r2", 1.0, 10, (0,), random=True), GraphNode("k", 1.0, 5, (1,), keep=True),
             GraphNode("g", 2.0, 10, (1, 3)), GraphNode("h", 2.0, 10, (0, 2)))
    graph = Graph("tiny", nodes).check()
    minimum = graph_minimum(graph)[0]
    assert minimum < store_all_graph_peak(graph)
    for solver, params in (("checkmate", {}), ("moccasin", {"max_computations": 3})):
        plan = solve_graph(graph, minimum, solver, **params)
        computes = [op.node for op in plan.schedule if op.kind == "compute"]
        assert computes.count(3) == 1
        assert computes.index(1) < computes.index(2)
