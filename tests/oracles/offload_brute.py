"""Exhaustive search over offload plans of a fixed compute schedule (chains of 3-4 stages).

It shares nothing with solvers/offload/ but the simulators: the productions
of items are read off the chain simulator's state bits, every window is tried
and the offload simulator says which plans are valid, how long they take and
what they peak at. The class searched is the solver's: each production of an
item (``saved i`` made by ``F_all i``, ``input i`` made by ``F_ck`` / ``F_none
i-1``) is offloaded at most once, issued before compute operation ``b``,
released before ``r`` and prefetched before ``p`` (``produced < b <= r < p <=
freed``); at each boundary the offloads come first (in every order), then the
releases, then the prefetches (in every order).
"""

import itertools

from planner.ops import Op
from planner.simulate import simulate
from planner.simulate.chain import ChainSimulator
from planner.simulate.replay import ScheduleError


def productions(chain, ops) -> list:
    """``(item, produced, freed)`` for every item made by ``ops`` (freed: the operation that frees it, or the
    schedule's length)."""
    simulator = ChainSimulator(chain)
    state = simulator.initial_state()
    live, out = {}, []
    for k, op in enumerate(ops):
        state, _, _ = simulator.step(state, op)
        present = {("saved", i) for i in range(chain.length) if state.abar >> (i + 1) & 1}
        present |= {("input", i) for i in range(1, chain.length + 1) if state.standalone >> i & 1}
        for item in list(live):
            if item not in present:
                out.append((item, live.pop(item), k))
        for item in present - set(live):
            live[item] = k
    out.extend((item, produced, len(ops)) for item, produced in live.items())
    return sorted(out, key=lambda entry: (entry[1], entry[0]))


def build(ops, windows) -> list:
    """The schedule with ``windows`` ``(item, b, r, p, d2h_rank, h2d_rank)`` inserted."""
    at = {}
    for (what, stage), b, r, p, d2h_rank, h2d_rank in windows:
        at.setdefault(b, []).append((0, d2h_rank, Op("Offload", stage, what)))
        at.setdefault(r, []).append((1, 0, Op("Release", stage, what)))
        at.setdefault(p, []).append((2, h2d_rank, Op("Prefetch", stage, what)))
    out = []
    for k, op in enumerate(ops):
        out.extend(entry[2] for entry in sorted(at.get(k, ()), key=lambda e: (e[0], e[1])))
        out.append(op)
    return out


def _valid(chain, ops, transfer, window) -> bool:
    try:
        simulate(chain, build(ops, [window]), transfer)
        return True
    except ScheduleError:
        return False


def all_results(chain, ops, transfer) -> list:
    """``(peak_bytes, time, schedule)`` of every plan of the class (the plain schedule first)."""
    per_item = []
    for item, produced, freed in productions(chain, ops):
        options = [None]
        for b in range(produced + 1, freed + 1):
            for r in range(b, freed + 1):
                for p in range(r + 1, freed + 1):
                    window = (item, b, r, p, 0, 0)
                    if _valid(chain, ops, transfer, window):
                        options.append(window)
        if len(options) > 1:
            per_item.append(options)
    results = []
    for combo in itertools.product(*per_item):
        chosen = [w for w in combo if w is not None]
        for windows in _orders(chosen):
            schedule = build(ops, windows)
            try:
                result = simulate(chain, schedule, transfer) if windows else ChainSimulator(chain).run(ops)
            except ScheduleError:
                continue
            results.append((result.peak_bytes, result.time, schedule))
    return results


def _orders(windows):
    """Every ranking of the offloads sharing a boundary and of the prefetches sharing one."""
    offload_groups, prefetch_groups = {}, {}
    for index, window in enumerate(windows):
        offload_groups.setdefault(window[1], []).append(index)
        prefetch_groups.setdefault(window[3], []).append(index)
    groups = [g for g in offload_groups.values() if len(g) > 1]
    pgroups = [g for g in prefetch_groups.values() if len(g) > 1]
    d2h_perms = [list(itertools.permutations(g)) for g in groups]
    h2d_perms = [list(itertools.permutations(g)) for g in pgroups]
    for d2h_choice in itertools.product(*d2h_perms):
        for h2d_choice in itertools.product(*h2d_perms):
            ranked = [list(w) for w in windows]
            for perm in d2h_choice:
                for rank, index in enumerate(perm):
                    ranked[index][4] = rank
            for perm in h2d_choice:
                for rank, index in enumerate(perm):
                    ranked[index][5] = rank
            yield [tuple(w) for w in ranked]


def best_time(results, budget):
    """The least simulated time of a plan within ``budget`` bytes, or None."""
    times = [time for peak, time, _ in results if peak <= budget]
    return min(times) if times else None
