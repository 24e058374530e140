"""Exhaustive searches over graph schedules (graphs of about 10 nodes at most).

They share nothing with the solvers but the graph simulator's step function,
so they are an independent judge of optimality. Three schedule classes:

* unrestricted: any order the simulator accepts, the first computations of
  ``random`` nodes in index order (the problem's own rule);
* ``max_computations=C``: the same, each node computed at most C times (Moccasin's class);
* ``frontier=True``: Checkmate's frontier-advancing class: node t is computed
  for the first time in stage t, which may first recompute earlier nodes,
  each at most once and in increasing index order.
"""

import heapq
import itertools

from planner.ops import GraphOp
from planner.simulate.graph import GraphSimulator


def _search(graph, start_cost, extend, frontier=False, max_computations=None, heuristic=True):
    """Best-first search over (simulator state, class state): the least cost of a complete schedule, or None.

    ``extend(cost, peak, seconds)`` is the cost after one more operation (None
    forbids it) and never decreases the cost. With ``heuristic`` the seconds
    of the nodes never computed yet are added to the queue's key (A*; only
    for time costs).
    """
    simulator = GraphSimulator(graph)
    n = graph.size
    random_nodes = [i for i, node in enumerate(graph.nodes) if node.random]
    times = [node.time for node in graph.nodes]

    def remaining(computed):
        return sum(times[i] for i in range(n) if not computed >> i & 1) if heuristic else 0.0

    # class state: frontier -> (last index computed in the stage, -1 at its start); max_computations -> counts
    start = (simulator.initial_state(), -1 if frontier else (0,) * n if max_computations else None)
    best = {start: start_cost}
    counter = itertools.count()
    queue = [(start_cost + remaining(0), start_cost, next(counter), start)]
    while queue:
        _, cost, _, key = heapq.heappop(queue)
        if cost > best[key]:
            continue
        state, extra = key
        if simulator.is_complete(state):
            return cost
        for v in range(n):
            bit = 1 << v
            for kind in ("compute", "free"):
                new_extra = extra
                if kind == "compute":
                    first = not state.computed & bit
                    if first and graph.nodes[v].random and any(
                            u < v and not state.computed >> u & 1 for u in random_nodes):
                        continue
                    if frontier:
                        frontier_node = state.computed.bit_length()  # first computations are in index order
                        if v > frontier_node or v <= extra:
                            continue
                        new_extra = -1 if v == frontier_node else v
                    elif max_computations:
                        if extra[v] >= max_computations:
                            continue
                        new_extra = extra[:v] + (extra[v] + 1,) + extra[v + 1:]
                try:
                    new, peak, seconds = simulator.step(state, GraphOp(kind, v))
                except ValueError:
                    continue
                total = extend(cost, peak, seconds)
                new_key = (new, new_extra)
                if total is not None and total < best.get(new_key, float("inf")):
                    best[new_key] = total
                    heapq.heappush(queue, (total + remaining(new.computed), total, next(counter), new_key))
    return None


def fastest_time(graph, budget: int, frontier: bool = False, max_computations: int = None) -> float:
    """Least total seconds over the schedules of the class whose every operation peaks within ``budget``
    (inf if none)."""
    if graph.fixed_bytes > budget:
        return float("inf")
    found = _search(graph, 0.0, lambda elapsed, peak, seconds: elapsed + seconds if peak <= budget else None,
                    frontier=frontier, max_computations=max_computations)
    return float("inf") if found is None else found


def least_peak(graph, frontier: bool = False) -> int:
    """Smallest peak over the complete schedules of the class (a minimax path search)."""
    found = _search(graph, graph.fixed_bytes, lambda so_far, peak, _: max(so_far, peak), frontier=frontier,
                    heuristic=False)
    assert found is not None, "no complete schedule"
    return found
