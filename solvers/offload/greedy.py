"""The greedy offload windows and the hand policy, on an :class:`solvers.offload.problem.OffloadProblem`.

:func:`greedy_windows`: while some operation is above the budget, offload a candidate covering the one furthest
above, by one of :data:`GREEDY_RULES`; drop the windows no longer needed and shrink the others; issue the
offloads in one of :data:`GREEDY_ORDERS`; keep the fastest variant in the simulator. :func:`hand_windows`: what
users write with ``saved_tensors_hooks`` (every saved activation offloaded after its forward, prefetched one
operation before its reader), whatever the budget. docs/solvers.md gives the rules in full.
"""

from planner.simulate import simulate
from solvers.offload.problem import OffloadProblem, Window, schedule_with_windows


def _compute_ends(problem: OffloadProblem) -> list:
    """Seconds at which each compute operation ends when nothing stalls."""
    ends, clock = [], 0.0
    for seconds in problem.durations:
        clock += seconds
        ends.append(clock)
    return ends


GREEDY_RULES = ("earliest", "largest", "tightest")  # which candidate covers the operation furthest above the budget
GREEDY_ORDERS = ("anchor", "release")  # the d2h engine's order: by anchor (FIFO), or by release (earliest deadline)


def greedy_windows(problem: OffloadProblem, budget: int):
    """The fastest in the simulator of the greedy's variants (:data:`GREEDY_RULES` x :data:`GREEDY_ORDERS`;
    docs/solvers.md) that fit ``budget``, or None when the greedy finds none."""
    best = None
    for rule in GREEDY_RULES:
        chosen = _greedy_choice(problem, budget, rule)
        if chosen is None:
            return None
        for order in GREEDY_ORDERS:
            windows = _issue(problem, chosen, order)
            result = simulate(problem.chain, schedule_with_windows(problem, windows), problem.transfer)
            if result.peak_bytes <= budget and (best is None or result.time < best[0]):
                best = (result.time, windows)
    return None if best is None else best[1]


def _greedy_choice(problem: OffloadProblem, budget: int, rule: str):
    """``{candidate: [gap, r, p]}`` covering every operation above ``budget``, or None."""
    over = [peak - budget for peak in problem.peaks]
    ends = _compute_ends(problem)
    chosen = {}

    def room(gap):
        """How many times over its copies fit: out between its anchor and the first operation above the budget
        in its gap, back between the last one and its read (compute time, no stall)."""
        above = [k for k in range(gap.lo, gap.hi + 1) if over[k] > 0] or [gap.lo]
        out = (ends[above[0] - 1] - ends[gap.anchor]) / max(problem.copy_seconds(gap.nbytes, "d2h"), 1e-300)
        back = (ends[gap.hi] - ends[above[-1]]) / max(problem.copy_seconds(gap.nbytes, "h2d"), 1e-300)
        return min(out, back)

    while True:
        worst = max(range(len(over)), key=lambda k: over[k])
        if over[worst] <= 0:
            break
        options = [(ci, gi, gap) for ci, cand in enumerate(problem.candidates) if ci not in chosen
                   for gi, gap in enumerate(cand.gaps) if gap.lo <= worst <= gap.hi]
        if not options:
            return None
        timely = [o for o in options if room(o[2]) >= 1.0]
        if timely:
            enough = [o for o in timely if o[2].nbytes >= over[worst]]
            if rule == "tightest" and enough:
                ci, gi, gap = min(enough, key=lambda o: (o[2].nbytes, o[0]))
            elif rule == "earliest":
                ci, gi, gap = min(timely, key=lambda o: (o[2].anchor, -o[2].nbytes, o[0]))
            else:
                ci, gi, gap = max(timely, key=lambda o: (o[2].nbytes, -o[0]))
        else:
            ci, gi, gap = max(options, key=lambda o: (room(o[2]), -o[0]))
        above = [k for k in range(gap.lo, gap.hi + 1) if over[k] > 0]
        r, p = min(above), max(above) + 1
        for k in range(r, p):
            over[k] -= gap.nbytes
        chosen[ci] = [gi, r, p]
    for ci in sorted(chosen, key=lambda c: (problem.candidates[c].gaps[chosen[c][0]].nbytes, c)):
        gi, r, p = chosen[ci]
        nbytes = problem.candidates[ci].gaps[gi].nbytes
        if all(over[k] + nbytes <= 0 for k in range(r, p)):
            for k in range(r, p):
                over[k] += nbytes
            del chosen[ci]
    for ci, (gi, r, p) in chosen.items():
        nbytes = problem.candidates[ci].gaps[gi].nbytes
        while p - r > 1 and over[r] + nbytes <= 0:
            over[r] += nbytes
            r += 1
        while p - r > 1 and over[p - 1] + nbytes <= 0:
            over[p - 1] += nbytes
            p -= 1
        chosen[ci] = [gi, r, p]
    return chosen


def _issue(problem: OffloadProblem, chosen: dict, order: str) -> list:
    """Windows for ``chosen``: offloads right after their anchor in anchor order, or in release order, each
    issued once its anchor and the previous offload are issued."""
    if order == "anchor":
        return [_eager_window(problem, ci, gi, r, p) for ci, (gi, r, p) in sorted(chosen.items())]
    windows, issued = [], 0
    entries = sorted(chosen.items(), key=lambda e: (e[1][1], problem.candidates[e[0]].gaps[e[1][0]].anchor, e[0]))
    for rank, (ci, (gi, r, p)) in enumerate(entries):
        gap = problem.candidates[ci].gaps[gi]
        issued = max(issued, gap.anchor + 1)
        windows.append(Window(ci, gi, issued, r, p, d2h_key=rank, h2d_key=gap.read))
    return windows


def _eager_window(problem, ci, gi, r, p) -> Window:
    """Offload right after the anchor; offloads ordered by anchor, prefetches by their reader."""
    gap = problem.candidates[ci].gaps[gi]
    return Window(ci, gi, gap.anchor + 1, r, p, d2h_key=gap.anchor, h2d_key=gap.read)


def hand_windows(problem: OffloadProblem) -> list:
    """The ``saved_tensors_hooks`` policy's windows (docs/solvers.md)."""
    ends = _compute_ends(problem)
    chosen = []
    for ci, cand in enumerate(problem.candidates):
        if cand.item[0] != "saved":
            continue
        gi = max(range(len(cand.gaps)), key=lambda g: (cand.gaps[g].hi - cand.gaps[g].lo, g))
        chosen.append((cand.gaps[gi].anchor, ci, gi))
    windows, engine = [], 0.0
    for anchor, ci, gi in sorted(chosen):
        gap = problem.candidates[ci].gaps[gi]
        start = max(ends[anchor], engine)
        engine = start + problem.copy_seconds(gap.nbytes, "d2h")
        r = next((k for k in range(gap.lo, gap.hi + 1) if ends[k - 1] >= engine), gap.hi)
        p = max(r + 1, gap.read - 1)
        windows.append(_eager_window(problem, ci, gi, r, p))
    return windows
