"""Exhaustive searches over every schedule the simulator accepts (small chains only).

They share nothing with the solvers but the simulator's step function, so they
are an independent judge of optimality.
"""

import functools
import heapq
import itertools

from planner.ops import Op
from planner.simulate.chain import ChainSimulator


def _moves(chain):
    """Every operation on ``chain``: each F_all also with each of its stage's options."""
    for i, stage in enumerate(chain.stages):
        for kind in ("F_all", "F_ck", "F_none", "B"):
            yield Op(kind, i)
        for option in range(len(stage.options)):
            yield Op("F_all", i, option=option)
    yield Op("Loss")


def _cheapest_completion(chain, start_cost, extend):
    """Dijkstra over simulator states: the least cost of a complete schedule, or None if none exists.

    ``extend(cost, peak, seconds)`` is the cost after one more operation (None to forbid it); it must never
    decrease the cost.
    """
    simulator, start, successors = _state_graph(chain)
    best = {start: start_cost}
    counter = itertools.count()
    queue = [(start_cost, next(counter), start)]
    while queue:
        cost, _, state = heapq.heappop(queue)
        if cost > best[state]:
            continue
        if simulator.is_complete(state):
            return cost
        for new, peak, seconds in successors(state):
            total = extend(cost, peak, seconds)
            if total is not None and total < best.get(new, float("inf")):
                best[new] = total
                heapq.heappush(queue, (total, next(counter), new))
    return None


@functools.lru_cache(maxsize=2)
def _state_graph(chain):
    """``(simulator, initial state, successors)`` of ``chain``: ``successors(state)`` is every ``(next state, peak,
    seconds)`` the simulator's step accepts from ``state``, each state's worked out once and kept, so that the
    searches of one chain (its least peak, then its fastest time at several budgets) step each state once."""
    simulator = ChainSimulator(chain)
    moves = list(_moves(chain))
    known = {}

    def successors(state):
        found = known.get(state)
        if found is None:
            found = []
            for op in moves:
                try:
                    found.append(simulator.step(state, op))
                except ValueError:
                    continue
            known[state] = found
        return found

    return simulator, simulator.initial_state(), successors


def fastest_time(chain, budget: int) -> float:
    """Least total seconds over all schedules whose every operation peaks within ``budget`` (inf if none)."""
    if chain.input_bytes > budget:
        return float("inf")
    found = _cheapest_completion(chain, 0.0,
                                 lambda elapsed, peak, seconds: elapsed + seconds if peak <= budget else None)
    return float("inf") if found is None else found


def least_peak(chain) -> int:
    """Smallest peak over all complete schedules (a minimax path search)."""
    found = _cheapest_completion(chain, chain.input_bytes, lambda so_far, peak, _: max(so_far, peak))
    assert found is not None, "no complete schedule"
    return found
