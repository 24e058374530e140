"""A fast heuristic for graph schedules: the warm start of the exact graph solvers.

:func:`greedy_order` searches *retention-level* schedules (a subset of Checkmate's frontier-advancing class:
each read value is kept, dropped after its forward readers and recomputed once, or flushed and recomputed by
every later reader) from store-all, raising the level that frees the most bytes per second of recomputation
until the peak fits, then lowering what still fits without slowing the schedule. It proves nothing: it gives
the exact solvers a feasible incumbent. docs/solvers.md gives the levels and the search.
"""

import time

import numpy as np

from planner.graph import Graph

KEEP, DROP, FLUSH = 0, 1, 2


class LevelSchedules:
    """Builds and measures retention-level schedules of one graph (docs/solvers.md)."""

    def __init__(self, graph: Graph):
        self.graph = graph
        nodes = graph.nodes
        self.n = graph.size
        self.deps = [node.deps for node in nodes]
        self.keep = [node.keep for node in nodes]
        self.out = np.array([node.out_bytes for node in nodes], dtype=np.int64)
        self.tmp = np.array([node.tmp_bytes for node in nodes], dtype=np.int64)
        self.times = np.array([node.time for node in nodes], dtype=float)
        consumers = graph.consumers
        self.last_read = [max(c, default=v) for v, c in enumerate(consumers)]
        # a DROP value's first life ends after its last forward reader (its own stage if none)
        self.first_life = [max((c for c in consumers[v] if not nodes[c].backward), default=v)
                           for v in range(self.n)]
        self.end_bytes = int(sum(node.out_bytes for node in nodes if node.keep)) + graph.fixed_bytes

    def order(self, level) -> list:
        """The compute order of the schedule with ``level`` (a list of levels by node)."""
        deps, keep = self.deps, self.keep
        resident = {}  # value -> last stage it stays resident through
        order = []
        for t in range(self.n):
            stage = set()
            stack = [d for d in deps[t] if d not in resident]
            while stack:
                d = stack.pop()
                if d in stage:
                    continue
                stage.add(d)
                stack.extend(x for x in deps[d] if x not in resident and x not in stage)
            for d in sorted(stage):
                order.append(d)
                # a recomputed value: DROP keeps it to its last read, FLUSH only through this stage
                resident[d] = self.last_read[d] if level[d] != FLUSH else t
            order.append(t)
            if keep[t]:
                resident[t] = self.n
            elif level[t] == KEEP:
                resident[t] = self.last_read[t]
            elif level[t] == DROP:
                resident[t] = self.first_life[t]
            else:
                resident[t] = t
            for v in [v for v, last in resident.items() if last <= t]:
                del resident[v]
        return order

    def measure(self, order):
        """``(peak bytes, position of the peak computation, last-read positions)`` of ``order`` with eager frees,
        ``fixed_bytes`` included (the memory model of planner/simulate/graph.py)."""
        length = len(order)
        last_read = list(range(length))
        made_at = {}
        deps, keep = self.deps, self.keep
        for position, v in enumerate(order):
            for d in deps[v]:
                last_read[made_at[d]] = position
            made_at[v] = position
        for position, v in enumerate(order):
            if keep[v]:
                last_read[position] = length  # never freed
        index = np.asarray(order, dtype=np.int64)
        sizes = self.out[index]
        delta = np.zeros(length + 2, dtype=np.int64)
        delta[1:length + 1] += sizes  # resident from the next position on
        np.add.at(delta, np.asarray(last_read, dtype=np.int64) + 1, -sizes)
        before = np.cumsum(delta)[:length]  # bytes resident before each computation
        running = before + sizes + self.tmp[index]
        peak_position = int(np.argmax(running))
        peak = int(running[peak_position]) + self.graph.fixed_bytes
        self.running = running  # bytes while each computation runs, fixed bytes excluded (read by the greedy)
        return max(peak, self.end_bytes), peak_position, last_read

    def excess(self, budget: int) -> int:
        """Bytes above ``budget``, summed over the computations of the order measured last."""
        return int(np.maximum(self.running + self.graph.fixed_bytes - budget, 0).sum())

    def seconds(self, order) -> float:
        """Total compute time of ``order``."""
        return float(self.times[np.asarray(order, dtype=np.int64)].sum())


def greedy_order(graph: Graph, budget: int, time_limit: float = 5.0):
    """A frontier-advancing compute order whose eager-free schedule peaks within ``budget`` bytes, or None when the
    greedy search finds none within ``time_limit`` seconds (docs/solvers.md): the faster of two greedy
    passes, one raising the best-scored value at each step, one trying the 8 best-scored and raising the one
    that removes the most bytes above the budget (summed over the computations) per second added."""
    started = time.perf_counter()
    schedules = LevelSchedules(graph)
    best = None
    for candidates in (1, 8):
        remaining = time_limit - (time.perf_counter() - started)
        order = _greedy(graph, schedules, budget, started + remaining, candidates)
        if order is not None and (best is None or schedules.seconds(order) < schedules.seconds(best)):
            best = order
    return best


def _greedy(graph: Graph, schedules: "LevelSchedules", budget: int, deadline: float, candidates: int):
    """One greedy pass (see :func:`greedy_order`) until ``deadline`` (a ``time.perf_counter`` value)."""
    if schedules.end_bytes > budget:
        return None
    nodes = graph.nodes
    uses = [len(c) for c in graph.consumers]
    level = [KEEP] * graph.size
    raised = []
    while True:
        order = schedules.order(level)
        peak, position, last_read = schedules.measure(order)
        if peak <= budget:
            break
        if time.perf_counter() > deadline:
            return None
        running = order[position]
        reads = set(nodes[running].deps)
        excess, seconds = schedules.excess(budget), schedules.seconds(order)
        scored = []
        for p in range(position):
            v = order[p]
            if last_read[p] < position or level[v] == FLUSH or nodes[v].keep or v in reads or not uses[v]:
                continue
            score = nodes[v].out_bytes / (nodes[v].time * (uses[v] if level[v] == DROP else 1) + 1e-9)
            scored.append((-score, v))
        if not scored:
            return None
        scored.sort()
        best, best_rate = scored[0][1], 0.0
        for _, v in scored[:candidates]:  # the most promising ones, tried: least-time removal of excess bytes
            level[v] += 1
            trial = schedules.order(level)
            schedules.measure(trial)
            level[v] -= 1
            removed = excess - schedules.excess(budget)
            rate = removed / (schedules.seconds(trial) - seconds + 1e-9 * seconds + 1e-12)
            if removed > 0 and rate > best_rate:
                best, best_rate = v, rate
        level[best] += 1
        raised.append(best)
    seconds = schedules.seconds(order)
    for v in reversed(raised):  # lower again what still fits without slowing the schedule
        if time.perf_counter() > deadline or level[v] == KEEP:
            continue
        level[v] -= 1
        trial = schedules.order(level)
        trial_seconds = schedules.seconds(trial)
        if schedules.measure(trial)[0] <= budget and trial_seconds <= seconds:
            order, seconds = trial, trial_seconds
        else:
            level[v] += 1
    return tuple(order)
