"""Exhaustive searches over every schedule the simulator accepts (small chains only).

They share nothing with the solvers but the simulator's step function, so they
are an independent judge of optimality.
"""

import heapq
import itertools

from planner.plan import Op
from planner.simulator import ChainSimulator


def _moves(length: int):
    for i in range(length):
        for kind in ("F_all", "F_ck", "F_none", "B"):
            yield Op(kind, i)
    yield Op("Loss")


def fastest_time(chain, budget: int) -> float:
    """Least total seconds over all schedules whose every operation peaks within ``budget`` (inf if none)."""
    simulator = ChainSimulator(chain)
    start = simulator.initial_state()
    if start.memory > budget:
        return float("inf")
    moves = list(_moves(chain.length))
    best = {start: 0.0}
    counter = itertools.count()
    queue = [(0.0, next(counter), start)]
    while queue:
        elapsed, _, state = heapq.heappop(queue)
        if elapsed > best[state]:
            continue
        if simulator.is_complete(state):
            return elapsed
        for op in moves:
            try:
                new, peak, seconds = simulator.step(state, op)
            except ValueError:
                continue
            if peak > budget:
                continue
            total = elapsed + seconds
            if total < best.get(new, float("inf")):
                best[new] = total
                heapq.heappush(queue, (total, next(counter), new))
    return float("inf")


def least_peak(chain) -> int:
    """Smallest peak over all complete schedules (a minimax path search)."""
    simulator = ChainSimulator(chain)
    start = simulator.initial_state()
    moves = list(_moves(chain.length))
    best = {start: start.memory}
    counter = itertools.count()
    queue = [(start.memory, next(counter), start)]
    while queue:
        peak_so_far, _, state = heapq.heappop(queue)
        if peak_so_far > best[state]:
            continue
        if simulator.is_complete(state):
            return peak_so_far
        for op in moves:
            try:
                new, peak, _ = simulator.step(state, op)
            except ValueError:
                continue
            candidate = max(peak_so_far, peak)
            if candidate < best.get(new, float("inf")):
                best[new] = candidate
                heapq.heappush(queue, (candidate, next(counter), new))
    raise AssertionError("no complete schedule")
