"""The exact offload model: OR-Tools CP-SAT over the windows of an :class:`solvers.offload.problem.OffloadProblem`.

Per compute operation a clock and a start, per window candidate an offload literal, monotone release/prefetch
order literals and a d2h and an h2d interval on the two FIFO engines; memory is linear in the order literals.
Times are integers at the coarsest power of ten that represents the compute times (rounded up, so the plan never
runs later in the simulator than the model's objective). :func:`exact_windows` solves it from the greedy's plan
as a complete hint; OR-Tools is imported when a model is built. docs/solvers.md states the model in full.
"""

import math
import time
from typing import NamedTuple

from solvers.limits import Deadline
from solvers.offload.problem import WORKERS, Gap, OffloadProblem, Window, solve_cp

_MIN_UNITS, _MAX_UNITS = 10**7, 10**10  # the compute time in time units, at least / at most


class Sub(NamedTuple):
    """A window candidate of the model: gap ``gap`` (number ``gap_index`` of candidate ``cand``) and its copy
    times in model units, ``d2h`` out and ``h2d`` back."""

    cand: int
    gap_index: int
    gap: Gap
    d2h: int
    h2d: int


class Record(NamedTuple):
    """The model variables of a :class:`Sub`: offload literal ``x``, order literals ``R[k] = [r <= k]`` and
    ``P[k] = [p <= k]``, and the starts of the copy out (``start``) and back (``back``)."""

    cand: int
    gap_index: int
    gap: Gap
    x: object
    R: dict
    P: dict
    start: object
    back: object


def _time_scale(durations) -> int:
    """Time units per second (docs/solvers.md)."""
    total = sum(durations)
    exact = 10**12
    for k in range(13):
        scale = 10**k
        if all(abs(t * scale - round(t * scale)) <= 1e-6 * max(1.0, t * scale) for t in durations):
            exact = scale
            break
    if total <= 0:
        return exact
    finest = 10 ** max(0, math.ceil(math.log10(_MIN_UNITS / total)))
    coarsest = 10 ** max(0, math.floor(math.log10(_MAX_UNITS / total)))
    return min(max(exact, finest), max(coarsest, finest))


def _units_up(seconds: float, scale: int, at_least: int = 0) -> int:
    value = seconds * scale
    whole = round(value)
    units = whole if abs(value - whole) <= 1e-12 * max(1.0, value) else math.ceil(value)  # float noise only
    return max(at_least, int(units))


def _spread(values, count: int) -> list:
    """At most ``count`` of the sorted distinct ``values``, evenly spaced, the first and last included."""
    values = sorted(set(values))
    if len(values) <= count:
        return values
    return sorted({values[round(i * (len(values) - 1) / (count - 1))] for i in range(count)})


def _engine_bounds(model, records, subs, over, d, T, C, thresholds: int = 8) -> None:
    """Implied constraints (true of every solution) that give CP-SAT's relaxation the copy engines' load: for
    each operation ``k`` above the budget,

    * the copies released before ``k`` whose anchor is ``a`` or later run one at a time after the compute up
      to ``a`` and end by ``C_k``: ``C_k >= Σ_{i<=a} d_i + Σ du_j [r_j <= k]``;
    * the copies prefetched after ``k`` that are read by ``m`` or earlier run one at a time after ``C_{k+1}``
      and end by ``T_m``: ``T_m >= C_{k+1} + Σ hu_j [p_j > k]``;

    for a few thresholds ``a`` and ``m``."""
    n = len(d)
    prefix, total = [], 0
    for units in d:
        total += units
        prefix.append(total)
    anchors = _spread([record.gap.anchor for record in records], thresholds)
    reads = _spread([record.gap.read for record in records], thresholds)
    for k in range(n):
        if over[k] <= 0:
            continue
        released = []  # (anchor, d2h units, literal [r <= k])
        pending = []  # (read, h2d units, [p > k] as (x, P_k or None))
        for record, sub in zip(records, subs):
            gap, x = record.gap, record.x
            if k >= gap.lo:
                released.append((gap.anchor, sub.d2h, record.R.get(k, x)))
            if k < gap.read:
                pending.append((gap.read, sub.h2d, x, record.P.get(k)))
        for a in anchors:
            terms = [du * lit for anchor, du, lit in released if anchor >= a]
            if len(terms) > 1:
                model.Add(C[k] >= prefix[a] + sum(terms))
        if k + 1 < n:
            for m in reads:
                if m <= k:
                    continue
                terms = [hu * x - (hu * p if p is not None else 0) for read, hu, x, p in pending if read <= m]
                if len(terms) > 1:
                    model.Add(T[m] >= C[k + 1] + sum(terms))


def _add_hint(model, windows, records, subs, d, T, C, F) -> None:
    """Hint every variable with the plan of ``windows`` replayed by the simulator's rules in the model's integer
    durations: a complete solution, so CP-SAT starts from it (nothing when a window is not in the model)."""
    index = {(sub.cand, sub.gap_index): s for s, sub in enumerate(subs)}
    if any((w.cand, w.gap) not in index for w in windows):
        return
    n = len(d)
    issued = {}
    for w in windows:
        issued.setdefault(w.offload_at, [[], [], []])[0].append((w.d2h_key, w.cand, w))
        issued.setdefault(w.release, [[], [], []])[1].append((0, w.cand, w))
        issued.setdefault(w.prefetch, [[], [], []])[2].append((w.h2d_key, w.cand, w))
    reads = {}
    for w in windows:
        reads.setdefault(records[index[w.cand, w.gap]].gap.read, []).append(w)
    clock = d2h_free = h2d_free = 0
    out_end, back_start, values = {}, {}, {"T": [], "C": [], "F": []}
    for k in range(n):
        offloads, releases, prefetches = issued.get(k, ([], [], []))
        for _, _, w in sorted(offloads, key=lambda e: e[:2]):
            s = index[w.cand, w.gap]
            start = max(clock, d2h_free)
            d2h_free = out_end[s] = start + subs[s].d2h
            back_start[s] = (start, None)
        for _, _, w in releases:
            clock = max(clock, out_end[index[w.cand, w.gap]])
        values["C"].append(clock)
        for _, _, w in sorted(prefetches, key=lambda e: e[:2]):
            s = index[w.cand, w.gap]
            start = max(clock, h2d_free, out_end[s])
            h2d_free = start + subs[s].h2d
            back_start[s] = (back_start[s][0], start)
        values["F"].append(h2d_free)
        for w in reads.get(k, ()):
            s = index[w.cand, w.gap]
            clock = max(clock, back_start[s][1] + subs[s].h2d)
        values["T"].append(clock)
        clock += d[k]
    for k in range(n):
        model.AddHint(T[k], values["T"][k])
        model.AddHint(C[k], values["C"][k])
        model.AddHint(F[k], values["F"][k])
    chosen = {(w.cand, w.gap): w for w in windows}
    for s, (ci, gi, gap, x, R, P, start, back) in enumerate(records):
        w = chosen.get((ci, gi))
        model.AddHint(x, w is not None)
        for k, lit in R.items():
            model.AddHint(lit, w is not None and k >= w.release)
        for k, lit in P.items():
            model.AddHint(lit, w is not None and k >= w.prefetch)
        model.AddHint(start, back_start[s][0] if w is not None else values["T"][gap.anchor] + d[gap.anchor])
        model.AddHint(back, back_start[s][1] if w is not None else 0)


def exact_windows(problem: OffloadProblem, budget: int, time_limit, hint=None, bounds: bool = True):
    """``(windows, optimal, gap, model_seconds, stats)`` from the CP-SAT model, or ``(None, ...)`` when the time
    limit (seconds from this call, or a :class:`solvers.limits.Deadline`: building the model included) ran out
    before any solution (or none exists)."""
    from ortools.sat.python import cp_model  # (0.7 s: kept out of ``import solvers``)

    deadline = Deadline.of(time_limit)
    started = time.perf_counter()
    scale = _time_scale(problem.durations)
    n = len(problem.ops)
    d = [_units_up(t, scale) for t in problem.durations]
    over = [peak - budget for peak in problem.peaks]
    subs = []
    for ci, cand in enumerate(problem.candidates):
        for gi, gap in enumerate(cand.gaps):
            if any(over[k] > 0 for k in range(gap.lo, gap.hi + 1)):
                subs.append(Sub(ci, gi, gap, _units_up(problem.copy_seconds(gap.nbytes, "d2h"), scale, 1),
                                _units_up(problem.copy_seconds(gap.nbytes, "h2d"), scale, 1)))
    horizon = 2 * (sum(d) + sum(sub.d2h + sub.h2d for sub in subs)) + 1
    model = cp_model.CpModel()
    T = [model.NewIntVar(0, horizon, f"T{k}") for k in range(n)]
    C = [model.NewIntVar(0, horizon, f"C{k}") for k in range(n)]
    F = [model.NewIntVar(0, horizon, f"F{k}") for k in range(n)]
    for k in range(n):
        model.Add(T[k] >= C[k])
        if k:
            model.Add(C[k] >= T[k - 1] + d[k - 1])
            model.Add(F[k] >= F[k - 1])
    away = [[] for _ in range(n)]
    d2h, h2d, per_cand, records = [], [], {}, []
    for s, (ci, gi, gap, du, hu) in enumerate(subs):
        if deadline.passed():  # no time left to solve it: the caller falls back on the greedy
            return None, False, None, None, {"candidates": len(subs), "status": "time limit while building"}
        lo, hi, read = gap.lo, gap.hi, gap.read
        x = model.NewBoolVar(f"x{s}")
        R = {k: model.NewBoolVar(f"R{s}_{k}") for k in range(lo, hi + 1)}
        P = {k: model.NewBoolVar(f"P{s}_{k}") for k in range(lo + 1, read + 1)}
        for k in range(lo + 1, hi + 1):
            model.AddImplication(R[k - 1], R[k])
        for k in range(lo + 2, read + 1):
            model.AddImplication(P[k - 1], P[k])
        for k in range(lo + 1, read + 1):
            model.AddImplication(P[k], R[k - 1])
        model.Add(R[hi] == x)
        model.Add(P[read] == x)
        for k in range(lo, hi + 1):  # release only before an operation above the budget
            if over[k] <= 0:
                model.Add(R[k] == (R[k - 1] if k > lo else 0))
        start = model.NewIntVar(0, horizon, f"s{s}")
        model.Add(start >= T[gap.anchor] + d[gap.anchor])
        d2h.append(model.NewOptionalFixedSizeIntervalVar(start, du, x, f"d2h{s}"))
        for k in range(lo, hi + 1):
            if over[k] > 0:
                exact = [R[k]] + ([R[k - 1].Not()] if k > lo else [])
                model.Add(C[k] >= start + du).OnlyEnforceIf(exact)
        back = model.NewIntVar(0, horizon, f"h{s}")
        h2d.append(model.NewOptionalFixedSizeIntervalVar(back, hu, x, f"h2d{s}"))
        model.Add(back >= start + du).OnlyEnforceIf(x)
        for k in range(lo + 1, read + 1):
            exact = [P[k]] + ([P[k - 1].Not()] if k > lo + 1 else [])
            model.Add(back >= C[k]).OnlyEnforceIf(exact)
            model.Add(back >= F[k - 1]).OnlyEnforceIf(exact)
            model.Add(F[k] >= back + hu).OnlyEnforceIf(exact)
        model.Add(T[read] >= back + hu).OnlyEnforceIf(x)
        for k in range(lo, hi + 1):
            away[k].append((gap.nbytes, R[k], P.get(k)))
        per_cand.setdefault(ci, []).append(x)
        records.append(Record(ci, gi, gap, x, R, P, start, back))
    for xs in per_cand.values():
        if len(xs) > 1:
            model.AddAtMostOne(xs)
    model.AddNoOverlap(d2h)
    model.AddNoOverlap(h2d)
    for k in range(n):
        if over[k] > 0:
            model.Add(sum(b * r - (b * p if p is not None else 0) for b, r, p in away[k]) >= over[k])
    if bounds:
        _engine_bounds(model, records, subs, over, d, T, C)
    model.Minimize(T[n - 1] + d[n - 1])
    if hint:
        _add_hint(model, hint, records, subs, d, T, C, F)
    proto = model.Proto()
    stats = {"candidates": len(subs), "variables": len(proto.variables), "constraints": len(proto.constraints),
             "time_unit": 1.0 / scale, "build_seconds": time.perf_counter() - started}
    left = deadline.left()
    if left is not None and left <= 0.0:
        stats.update(status="time limit while building")
        return None, False, None, None, stats
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = WORKERS
    if left is not None:
        solver.parameters.max_time_in_seconds = left
    # presolve spends tens of seconds on the order literals of 100-stage chains and gains nothing measurable:
    # without it CP-SAT starts from the complete hint at once and proves 10-20-stage optima as fast
    solver.parameters.cp_model_presolve = False
    status = solve_cp(solver, model)
    stats.update(status=solver.StatusName(status), solve_seconds=solver.WallTime())
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None, False, None, None, stats
    ends = [solver.Value(T[k]) + d[k] for k in range(n)]
    windows = []
    for ci, gi, gap, x, R, P, start, back in records:
        if not solver.Value(x):
            continue
        r = min(k for k, lit in R.items() if solver.Value(lit))
        p = min(k for k, lit in P.items() if solver.Value(lit))
        s = solver.Value(start)
        # the last boundary b (after the anchor, at most r) whose clock (end of operation b-1) is <= the start
        b = gap.anchor + 1
        while b < r and ends[b] <= s:
            b += 1
        windows.append(Window(ci, gi, b, r, p, d2h_key=s, h2d_key=solver.Value(back)))
    objective = solver.ObjectiveValue()
    optimal = status == cp_model.OPTIMAL
    gap = 0.0 if optimal else max(0.0, (objective - solver.BestObjectiveBound()) / objective) if objective else 0.0
    return windows, optimal, gap, objective / scale, stats
