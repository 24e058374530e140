"""Revolve: Griewank & Walther binomial checkpointing for homogeneous chains.

:func:`revolve_schedule` reverses ``l`` stages with ``s`` snapshot slots (the input's included) by the
recursion that minimises the number of advances, time-optimal on a homogeneous chain among schedules that keep
``s`` snapshots and tape one stage at a time; :func:`revolve` takes the most snapshots whose simulated peak fits
the budget. docs/solvers.md gives the recursion.
"""

import numpy as np

from planner.chain import Chain
from planner.errors import MemschedError
from planner.ops import Op
from planner.simulate.chain import ChainSimulator
from solvers.result import Solution

_table_cache = {}


def advance_table(max_length: int, max_snapshots: int):
    """``(cost, split)`` covering at least the given sizes: ``cost[s, l]`` = minimal advances T(l, s),
    ``split[s, l]`` = the best first advance m. Entries never depend on larger sizes, so one table,
    grown when a larger one is asked for, serves every call."""
    cached = _table_cache.get("table")
    if cached is not None and cached[0].shape[0] > max_snapshots and cached[0].shape[1] > max_length:
        return cached
    if cached is not None:
        max_snapshots = max(max_snapshots, cached[0].shape[0] - 1)
        max_length = max(max_length, cached[0].shape[1] - 1)
    cost = np.full((max_snapshots + 1, max_length + 1), np.inf)
    split = np.zeros((max_snapshots + 1, max_length + 1), dtype=np.int64)
    cost[:, 1] = 0
    for s in range(1, max_snapshots + 1):
        for length in range(2, max_length + 1):
            m = np.arange(1, length)
            totals = m + cost[s - 1, length - m] + cost[s, m]
            best = int(np.argmin(totals))
            cost[s, length], split[s, length] = totals[best], best + 1
    _table_cache["table"] = (cost, split)
    return cost, split


def revolve_schedule(length: int, snapshots: int) -> tuple:
    """The binomial schedule reversing ``length`` stages with ``snapshots`` slots (>= 1, the input's included)."""
    snapshots = min(snapshots, length)  # more slots than stages are never used
    _, split = advance_table(length, snapshots)
    ops = []
    tasks = [(0, length, snapshots)]  # reverse stages start..start+count-1 holding `slots` snapshots
    while tasks:
        start, count, slots = tasks.pop()
        if count == 1:
            ops.append(Op("F_all", start))
            if start == length - 1:
                ops.append(Op("Loss"))
            ops.append(Op("B", start))
            continue
        m = int(split[slots, count])
        ops.append(Op("F_ck", start))
        ops.extend(Op("F_none", k) for k in range(start + 1, start + m))
        # Last in, first out: the far part is reversed first, then the near part.
        tasks.append((start, m, slots))
        tasks.append((start + m, count - m, slots - 1))
    return tuple(ops)


def revolve(chain: Chain, budget: int, snapshots: int = None) -> Solution:
    """Binomial checkpointing with ``snapshots`` slots, or with the most slots whose simulated peak fits ``budget``."""
    length = chain.length
    if snapshots is not None:
        if snapshots < 1:
            raise MemschedError(f"revolve: snapshots must be at least 1 (the input), got {snapshots}")
        return Solution(revolve_schedule(length, snapshots), params={"snapshots": snapshots})
    simulator = ChainSimulator(chain)
    low, high = 1, length  # the peak grows with the snapshot count: find the largest that fits
    if simulator.run(revolve_schedule(length, low)).peak_bytes > budget:
        return Solution(revolve_schedule(length, low), params={"snapshots": low})
    while low < high:
        middle = (low + high + 1) // 2
        if simulator.run(revolve_schedule(length, middle)).peak_bytes <= budget:
            low = middle
        else:
            high = middle - 1
    return Solution(revolve_schedule(length, low), params={"snapshots": low})
