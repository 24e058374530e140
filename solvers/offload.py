"""Offload plans: which items to copy to the host, and when, for a fixed compute schedule.

The compute schedule (store-all by default, or a Rotor plan's, or any chain
schedule without transfers) is kept as it is; ``Offload``, ``Release`` and
``Prefetch`` operations (planner/plan.py) are inserted so that the offload
simulator (planner/simulate/offload.py, whose rules this module follows)
predicts a peak within the budget and the least step time: compute plus
stalls.

**Candidates.** Every *production* of an item in the compute schedule: each
``F_all i`` makes ``saved i``; each ``F_ck`` / ``F_none i-1`` makes ``input i``
(a standalone ``a_i``). Replaying the schedule in the chain simulator gives
its live range (to the operation that frees it), the operations that read it
(the simulator's own read rule) and its bytes after each operation
(``own_saved_bytes`` once ``δ_{i+1}`` exists). A *gap* is a run of at least
one operation between two consecutive touches of the item (its production or
a read) that ends with a read; a *window* of a gap releases the item before
operation ``r`` and prefetches it before operation ``p`` (``lo <= r < p <=
read``), so it is away from the device during the operations ``r..p-1``. Each
production gets at most one window. The copy to the host may start once the
last operation that changed the item's size before the gap has ended (its
*anchor*: the production, or the read that shrank it), so the bytes copied
are those released and prefetched.

**Class.** At each boundary (before a compute operation) the transfers are
issued in the order offloads, releases, prefetches; the copies run on the two
FIFO engines of planner/transfer.py. Within that class the CP-SAT model below
is exact (tests/test_solvers_offload.py checks it against an exhaustive search
on small chains, which also tries every offload boundary and order). Outside
it: a second window for the same production, a copy started before the read
that shrinks the item (it would copy the larger bytes), and a prefetch issued
before a release at the same boundary.

**The exact model** (OR-Tools CP-SAT, two workers). Per compute operation
``k``: the clock ``C_k`` at its boundary once the releases there are done
(``C_k >= T_{k-1} + d_{k-1}``) and its start ``T_k >= C_k``; per boundary the
h2d engine's clock ``F_k`` (end of the prefetches issued at or before it).
Per window candidate (a production's gap) an offload literal ``x``, order
literals ``R_k = [r <= k]`` and ``P_k = [p <= k]`` over the gap (monotone,
``P_k <= R_{k-1}``, ``R_hi = P_read = x``), a d2h interval (start after the
anchor ends, one NoOverlap for all), ``C_r >= d2h end``, an h2d interval
(start after the d2h end, after ``C_p`` and after ``F_{p-1}``, ``F_p >= its end``:
the engine's FIFO across boundaries; NoOverlap within), and the read after
the gap starts after the h2d end. At most one window per production. Memory
is linear in the order literals: for each compute operation ``k`` whose peak
in the plain simulator is above the budget, ``Σ bytes · (R_k − P_k) >= peak_k −
budget``; the levels between operations (where transfers are issued) never
exceed their neighbours' peaks, so they need no constraint. Releases are only
placed before an operation above the budget (releasing later, still before
it, only weakens the release's wait), and gaps with no such operation are
dropped. The objective is the end of the last compute operation.

Implied constraints give the relaxation the copy engines' load (see
:func:`_engine_bounds`); CP-SAT (presolve off: on 100-stage models it costs
tens of seconds and gains nothing measured) starts from a complete hint, the
greedy's plan replayed in the model's time units. When the greedy's plan has
no stall at all it is optimal (no plan is faster than the compute alone) and
CP-SAT is not run.

Times are integers: the unit is the coarsest power of ten that represents
every compute time exactly (``10^-12`` s at most), made finer if needed so
that the compute time is at least ``10^7`` units, and coarser if needed so
that it is at most ``10^10`` units; compute times that are not whole units and
every copy time are rounded *up* (a copy to at least one unit). The model is
therefore pessimistic: the plan built from its solution (offloads issued in
d2h start order at the last boundary before their planned start, releases at
``r``, prefetches at ``p`` in h2d start order) never runs later in the
simulator than the model's objective (``OffloadSolution.model_time``; the
tests check it). ``OPTIMAL`` is reported as optimal (exact up to that
rounding: within one unit per operation and copy); ``FEASIBLE`` at the time
limit with the gap to CP-SAT's bound; without any solution at the time limit
the greedy's plan is returned (not optimal, gap unknown).

**The greedy** (``method="greedy"``; ``auto`` uses it beyond
``EXACT_UP_TO`` stages): while some operation is above the budget, take the
one furthest above and offload a candidate covering it over the operations of
its gap still above the budget, preferring those whose copies fit in the
compute time before the first and after the last of those operations (else
the one with the most room); among them the rule picks the earliest anchor
(the longest lead), the largest, or the smallest that covers the excess
alone. Then windows no longer needed are dropped (smallest first) and the
others shrunk (release as late and prefetch as early as memory allows).
Offloads are issued right after their anchor in anchor order, or in release
order (earliest deadline first). The fastest of the six variants in the
simulator is kept.

**The hand policy** (:func:`offload_all_policy`, solver ``offload_all``), what
users write with ``torch.autograd.graph.saved_tensors_hooks``: offload every
saved activation right after its forward, release it as soon as its copy can
have ended (estimated on the compute timeline without stalls), prefetch it
one operation (one stage, in a store-all backward) before its reader. It
ignores the budget; the simulator judges it.
"""

import math
import time
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

from planner.chain import Chain
from planner.errors import MemschedError
from planner.simulate.offload import OffloadSimulator
from planner.ops import TRANSFER_OPS, Op
from planner.simulate.chain import ChainSimulator, simulate
from planner.transfer import Transfer
from planner.units import format_bytes
from solvers.limits import Deadline, TimeLimitReached, enough_time, run_interruptibly
from solvers.minimum import minimum_budget

SCHEDULES = ("store_all", "rotor")
METHODS = ("auto", "exact", "greedy")
EXACT_UP_TO = 100  # stages: beyond, method "auto" uses the greedy
DEFAULT_TIME_LIMIT = 30.0  # seconds of CP-SAT
_WORKERS = 2
_MIN_UNITS, _MAX_UNITS = 10**7, 10**10  # the compute time in time units, at least / at most


class Gap(NamedTuple):
    """Operations ``lo..hi`` that may run without the item; operation ``hi + 1`` reads it; the copy to the host
    may start when operation ``anchor`` ends; ``nbytes`` are the item's bytes during the gap."""

    lo: int
    hi: int
    anchor: int
    nbytes: int

    @property
    def read(self) -> int:
        return self.hi + 1


class Candidate(NamedTuple):
    """One production of an item (``(what, stage)``): made by operation ``produced``, freed by ``freed`` (the
    schedule's length if never), read by ``reads``, with its ``gaps``."""

    item: tuple
    produced: int
    freed: int
    reads: tuple
    gaps: tuple


class Window(NamedTuple):
    """An offload of candidate ``cand`` in its gap ``gap``: issued before operation ``offload_at``, released before
    ``release``, prefetched before ``prefetch``; ``d2h_key`` / ``h2d_key`` order the transfers of one boundary."""

    cand: int
    gap: int
    offload_at: int
    release: int
    prefetch: int
    d2h_key: float = 0.0
    h2d_key: float = 0.0


@dataclass(frozen=True)
class OffloadProblem:
    """A compute schedule on a chain with its per-operation seconds and peaks (plain simulator) and candidates."""

    chain: Chain
    transfer: Transfer
    ops: tuple
    durations: tuple
    peaks: tuple
    candidates: tuple

    @property
    def compute_time(self) -> float:
        total = 0.0
        for seconds in self.durations:
            total += seconds
        return total

    @property
    def peak(self) -> int:
        return max(self.peaks, default=0)

    def copy_seconds(self, nbytes: int, direction: str) -> float:
        return self.transfer.seconds(nbytes, direction)


@dataclass(frozen=True)
class OffloadSolution:
    """What an offload solver hands back (a :class:`solvers.result.Solution` with a gap and the channel), and
    for the exact model its objective in seconds (the plan's simulated time is at most that) and its size."""

    schedule: tuple
    params: dict = field(default_factory=dict)
    optimal: bool = False
    gap: Optional[float] = None
    transfer: Optional[Transfer] = None
    model_time: Optional[float] = None
    stats: dict = field(default_factory=dict)


# --- the problem -------------------------------------------------------------------------------------------

def compute_schedule(chain: Chain, budget: int, schedule="store_all", schedule_budget: int = None,
                     deadline: Deadline = None) -> tuple:
    """The compute schedule to offload from: ``"store_all"``, ``"rotor"`` (Rotor's plan at ``schedule_budget``,
    by default at the budget, and never below the least memory any schedule needs: its computation stops at
    ``deadline``), or a schedule given as operations (without transfers)."""
    from solvers.extremes import store_all_schedule

    if isinstance(schedule, str):
        if schedule not in SCHEDULES:
            raise MemschedError(f"offload: unknown compute schedule {schedule!r}; choose one of {', '.join(SCHEDULES)} "
                                "or give a schedule")
        if schedule == "store_all":
            if schedule_budget is not None:
                raise MemschedError("offload: schedule_budget is for the rotor compute schedule, not store_all")
            return store_all_schedule(chain.length)
        from solvers.rotor import rotor

        target = budget if schedule_budget is None else schedule_budget
        if isinstance(target, bool) or not isinstance(target, int) or target < 0:
            raise MemschedError(f"offload: schedule_budget must be a number of bytes >= 0, got {target!r}")
        return rotor(chain, max(target, minimum_budget(chain, deadline))).schedule
    ops = tuple(schedule)
    if not ops or any(not isinstance(op, Op) for op in ops):
        raise MemschedError("offload: the compute schedule must be a non-empty sequence of operations")
    if any(op.kind in TRANSFER_OPS for op in ops):
        raise MemschedError("offload: the compute schedule already has transfers; give it without them")
    ChainSimulator(chain).run(ops)  # a ScheduleError (one line) if it cannot run
    return ops


def build_problem(chain: Chain, ops, transfer: Transfer) -> OffloadProblem:
    """Replay ``ops`` and list every production of an item with its reads, bytes and gaps (see the module
    docstring). With a channel that cannot move data both ways there are no candidates."""
    compute = ChainSimulator(chain)
    rules = OffloadSimulator(chain, transfer)  # its read rule and its item sizes, so that both agree
    state = compute.initial_state()
    durations, peaks, done = [], [], []
    live = {}  # item -> [produced, reads, sizes [(op, bytes)]]
    for k, op in enumerate(ops):
        reads = rules.reads(state, op)
        new, peak, seconds = compute.step(state, op)
        durations.append(seconds)
        peaks.append(peak)
        for item in reads:
            if item in live:
                live[item][1].append(k)
        for item in list(live):
            nbytes = _bytes(rules, new, item)
            if nbytes is None:
                done.append((item, *live.pop(item), k))
            elif nbytes != live[item][2][-1][1]:
                live[item][2].append((k, nbytes))
        for item in _items(new, chain.length):
            if item not in live:
                live[item] = [k, [], [(k, _bytes(rules, new, item))]]
        state = new
    n = len(ops)
    done.extend((item, *record, n) for item, record in live.items())
    candidates = []
    if transfer.usable:
        for item, produced, reads, sizes, freed in sorted(done, key=lambda d: (d[1], d[0])):
            touches = sorted({produced, *reads})
            gaps = []
            for a, b in zip(touches, touches[1:]):
                if b - a >= 2 and b in reads:
                    anchor, nbytes = max((s for s in sizes if s[0] <= a), key=lambda s: s[0])
                    if nbytes > 0:
                        gaps.append(Gap(a + 1, b - 1, anchor, nbytes))
            if gaps:
                candidates.append(Candidate(item, produced, freed, tuple(reads), tuple(gaps)))
    return OffloadProblem(chain, transfer, tuple(ops), tuple(durations), tuple(peaks), tuple(candidates))


def _items(state, length: int):
    for i in range(length):
        if state.abar >> (i + 1) & 1:
            yield ("saved", i)
    for i in range(1, length + 1):
        if state.standalone >> i & 1:
            yield ("input", i)


def _bytes(rules: OffloadSimulator, state, item):
    try:
        return rules.device_bytes(state, item)
    except ValueError:
        return None


# --- plans from windows ------------------------------------------------------------------------------------

def build_schedule(problem: OffloadProblem, windows) -> tuple:
    """The compute operations with each window's transfers: at each boundary offloads (by ``d2h_key``), releases,
    prefetches (by ``h2d_key``)."""
    at = {}
    for w in windows:
        what, stage = problem.candidates[w.cand].item
        at.setdefault(w.offload_at, []).append((0, w.d2h_key, w.cand, Op("Offload", stage, what)))
        at.setdefault(w.release, []).append((1, 0.0, w.cand, Op("Release", stage, what)))
        at.setdefault(w.prefetch, []).append((2, w.h2d_key, w.cand, Op("Prefetch", stage, what)))
    out = []
    for k, op in enumerate(problem.ops):
        out.extend(entry[3] for entry in sorted(at.get(k, ())))
        out.append(op)
    return tuple(out)


def least_peak(problem: OffloadProblem, deadline: Deadline = None) -> int:
    """Bytes: the least peak any window choice reaches (every chosen window covering its whole gap); when CP-SAT
    does not prove it within 10 s (or what is left of ``deadline``), its bound, or without one, the bound of
    every candidate away at once by its largest gap (each operation then loses at most that)."""
    choices = [[g for g in c.gaps] for c in problem.candidates]
    if not choices:
        return problem.peak
    away = [0] * len(problem.ops)  # per operation: every candidate away by its largest gap covering it
    for gaps in choices:
        largest = {}
        for gap in gaps:
            for k in range(gap.lo, gap.hi + 1):
                largest[k] = max(largest.get(k, 0), gap.nbytes)
        for k, nbytes in largest.items():
            away[k] += nbytes
    relaxed = max(p - a for p, a in zip(problem.peaks, away))
    if all(len(gaps) == 1 for gaps in choices):  # one gap each: offload everything
        return relaxed
    seconds = 10.0 if deadline is None or deadline.left() is None else min(10.0, deadline.left())
    if seconds <= 0.0:
        return relaxed
    from ortools.sat.python import cp_model

    model = cp_model.CpModel()
    top = model.NewIntVar(0, problem.peak, "peak")
    covers = [[] for _ in problem.ops]
    for ci, gaps in enumerate(choices):
        picks = [model.NewBoolVar(f"y_{ci}_{gi}") for gi in range(len(gaps))]
        model.AddAtMostOne(picks)
        for gap, pick in zip(gaps, picks):
            for k in range(gap.lo, gap.hi + 1):
                covers[k].append((gap.nbytes, pick))
    for k, peak in enumerate(problem.peaks):
        model.Add(top >= peak - sum(b * y for b, y in covers[k]))
    model.Minimize(top)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = _WORKERS
    solver.parameters.max_time_in_seconds = seconds
    status = _solve_cp(solver, model)
    if status == cp_model.OPTIMAL:
        return int(solver.Value(top))
    return max(relaxed, int(solver.BestObjectiveBound())) if status == cp_model.FEASIBLE else relaxed


def _solve_cp(solver, model):
    """``solver.Solve(model)``, stopped at once by Ctrl-C (CP-SAT's own SIGINT handler would swallow it)."""
    solver.parameters.catch_sigint_signal = False
    return run_interruptibly(lambda: solver.Solve(model), solver.StopSearch)


# --- the greedy and the hand policy ------------------------------------------------------------------------

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
    """The fastest in the simulator of the greedy's variants (:data:`GREEDY_RULES` x :data:`GREEDY_ORDERS`; see
    the module docstring) that fit ``budget``, or None when the greedy finds none."""
    best = None
    for rule in GREEDY_RULES:
        chosen = _greedy_choice(problem, budget, rule)
        if chosen is None:
            return None
        for order in GREEDY_ORDERS:
            windows = _issue(problem, chosen, order)
            result = simulate(problem.chain, build_schedule(problem, windows), problem.transfer)
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
    """The ``saved_tensors_hooks`` policy's windows (see the module docstring)."""
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


# --- the exact model ---------------------------------------------------------------------------------------

def _time_scale(durations) -> int:
    """Time units per second (see the module docstring)."""
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
    anchors = _spread([gap.anchor for _, _, gap, *_ in records], thresholds)
    reads = _spread([gap.read for _, _, gap, *_ in records], thresholds)
    for k in range(n):
        if over[k] <= 0:
            continue
        released = []  # (anchor, d2h units, literal [r <= k])
        pending = []  # (read, h2d units, [p > k] as (x, P_k or None))
        for (_, _, gap, x, R, P, _, _), (*_, du, hu) in zip(records, subs):
            if k >= gap.lo:
                released.append((gap.anchor, du, R.get(k, x)))
            if k < gap.read:
                pending.append((gap.read, hu, x, P.get(k)))
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
    index = {(ci, gi): s for s, (ci, gi, *_) in enumerate(subs)}
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
        reads.setdefault(records[index[w.cand, w.gap]][2].read, []).append(w)
    clock = d2h_free = h2d_free = 0
    out_end, back_start, values = {}, {}, {"T": [], "C": [], "F": []}
    for k in range(n):
        offloads, releases, prefetches = issued.get(k, ([], [], []))
        for _, _, w in sorted(offloads, key=lambda e: e[:2]):
            s = index[w.cand, w.gap]
            start = max(clock, d2h_free)
            d2h_free = out_end[s] = start + subs[s][3]
            back_start[s] = (start, None)
        for _, _, w in releases:
            clock = max(clock, out_end[index[w.cand, w.gap]])
        values["C"].append(clock)
        for _, _, w in sorted(prefetches, key=lambda e: e[:2]):
            s = index[w.cand, w.gap]
            start = max(clock, h2d_free, out_end[s])
            h2d_free = start + subs[s][4]
            back_start[s] = (back_start[s][0], start)
        values["F"].append(h2d_free)
        for w in reads.get(k, ()):
            s = index[w.cand, w.gap]
            clock = max(clock, back_start[s][1] + subs[s][4])
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
    from ortools.sat.python import cp_model

    deadline = Deadline.of(time_limit)
    started = time.perf_counter()
    scale = _time_scale(problem.durations)
    n = len(problem.ops)
    d = [_units_up(t, scale) for t in problem.durations]
    over = [peak - budget for peak in problem.peaks]
    subs = []  # (cand, gap index, gap, d2h units, h2d units)
    for ci, cand in enumerate(problem.candidates):
        for gi, gap in enumerate(cand.gaps):
            if any(over[k] > 0 for k in range(gap.lo, gap.hi + 1)):
                subs.append((ci, gi, gap, _units_up(problem.copy_seconds(gap.nbytes, "d2h"), scale, 1),
                             _units_up(problem.copy_seconds(gap.nbytes, "h2d"), scale, 1)))
    horizon = 2 * (sum(d) + sum(du + hu for *_, du, hu in subs)) + 1
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
        records.append((ci, gi, gap, x, R, P, start, back))
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
    solver.parameters.num_workers = _WORKERS
    if left is not None:
        solver.parameters.max_time_in_seconds = left
    # presolve spends tens of seconds on the order literals of 100-stage chains and gains nothing measurable:
    # without it CP-SAT starts from the complete hint at once and proves 10-20-stage optima as fast
    solver.parameters.cp_model_presolve = False
    status = _solve_cp(solver, model)
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


# --- the solvers -------------------------------------------------------------------------------------------

def channel_of(chain: Chain, transfer, solver: str = "offload") -> Transfer:
    """``transfer``, else the chain's copy channel; a one-line error naming ``solver`` when there is none."""
    channel = transfer if transfer is not None else chain.transfer
    if channel is None:
        raise MemschedError(f"{solver}: chain '{chain.name}' has no copy channel; give one (transfer=, --bandwidth "
                            "16GB/s) or profile on CUDA")
    if not isinstance(channel, Transfer):
        raise MemschedError(f"{solver}: transfer must be a planner.transfer.Transfer, got {type(channel).__name__}")
    return channel


def _budget(budget) -> int:
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise MemschedError(f"offload: budget must be a number of bytes >= 0, got {budget!r}")
    return budget


def _infeasible(problem: OffloadProblem, budget: int, schedule, least: int = None) -> MemschedError:
    least = least_peak(problem) if least is None else least
    name = schedule if isinstance(schedule, str) else "given"
    how = ("the copy channel cannot move data both ways" if not problem.transfer.usable
           else f"offloading reaches {format_bytes(least)} ({least} bytes) at least")
    return MemschedError(f"offload: budget {format_bytes(budget)} ({budget} bytes) is infeasible on the {name} "
                         f"compute schedule of chain '{problem.chain.name}' (peak {format_bytes(problem.peak)}): "
                         f"{how}; "
                         "raise the budget or use a schedule that recomputes (schedule='rotor')")


def _prepare(chain, budget, transfer, schedule, schedule_budget, deadline=None):
    budget = _budget(budget)
    channel = channel_of(chain, transfer)
    ops = compute_schedule(chain, budget, schedule, schedule_budget, deadline)
    return budget, build_problem(chain, ops, channel)


def _params(schedule, schedule_budget, **more) -> dict:
    params = {"schedule": schedule if isinstance(schedule, str) else "given"}
    if schedule_budget is not None:
        params["schedule_budget"] = schedule_budget
    params.update({key: value for key, value in more.items() if value is not None})
    return params


def _fits(problem: OffloadProblem, budget: int, windows) -> tuple:
    schedule = build_schedule(problem, windows)
    result = simulate(problem.chain, schedule, problem.transfer)
    return schedule, result


def offload(chain: Chain, budget: int, transfer: Transfer = None, schedule="store_all", schedule_budget: int = None,
            time_limit: float = DEFAULT_TIME_LIMIT, method: str = "auto") -> OffloadSolution:
    """The fastest offload plan of the compute ``schedule`` within ``budget`` bytes over the copy channel
    ``transfer`` (the chain's when None): CP-SAT (``method="exact"``, and ``"auto"`` up to ``EXACT_UP_TO``
    stages) or the greedy. Infeasible budgets raise a one-line :class:`MemschedError` with the least peak."""
    if method not in METHODS:
        raise MemschedError(f"offload: unknown method {method!r}; choose one of {', '.join(METHODS)}")
    if time_limit is None:
        time_limit = DEFAULT_TIME_LIMIT
    if isinstance(time_limit, bool) or not isinstance(time_limit, (int, float)) or not 0 < time_limit < math.inf:
        raise MemschedError(f"offload: time_limit must be a positive number of seconds, got {time_limit!r}")
    return offload_within(chain, budget, transfer, schedule, schedule_budget, Deadline(time_limit), method,
                          time_limit)


def offload_within(chain: Chain, budget: int, transfer: Transfer, schedule, schedule_budget, deadline: Deadline,
                   method: str = "auto", time_limit=None) -> OffloadSolution:
    """:func:`offload` within ``deadline`` (a :class:`solvers.limits.Deadline`: the computation of the compute
    schedule, the least peak, the greedy and the exact model all within it; once it has passed the greedy's plan
    is returned); ``time_limit`` is what the plan's parameters record."""
    try:
        budget, problem = _prepare(chain, budget, transfer, schedule, schedule_budget, deadline)
    except TimeLimitReached as exc:
        raise MemschedError(f"offload: the time limit ({deadline.seconds:g} s) ran out while {exc.what} "
                            f"({100 * exc.done:.0f}% done); give --time-limit {enough_time(2 * exc.needed())} "
                            "or more") from None
    if problem.peak <= budget:  # nothing to move: offloading only adds stalls
        return OffloadSolution(problem.ops, _params(schedule, schedule_budget, method=method), optimal=True, gap=0.0,
                               transfer=problem.transfer, model_time=problem.compute_time, stats={"candidates": 0})
    least = least_peak(problem, deadline)
    if least > budget:
        raise _infeasible(problem, budget, schedule, least)
    greedy = greedy_windows(problem, budget)
    use_exact = method == "exact" or (method == "auto" and chain.length <= EXACT_UP_TO)
    if use_exact and greedy is not None:  # no stall at all: nothing is faster
        plan, result = _fits(problem, budget, greedy)
        if result.stall_time == 0.0:
            return OffloadSolution(plan, _params(schedule, schedule_budget, method="exact", time_limit=time_limit),
                                   optimal=True, gap=0.0, transfer=problem.transfer, model_time=result.time,
                                   stats={"candidates": len(problem.candidates),
                                          "status": "OPTIMAL (greedy, no stall)"})
    if use_exact:
        windows, optimal, gap, model_time, stats = exact_windows(problem, budget, deadline, hint=greedy)
        if windows is not None:
            plan, result = _fits(problem, budget, windows)
            if result.peak_bytes > budget:  # the model's memory is exact in bytes: this is a bug, not rounding
                raise MemschedError(f"offload: internal error: the exact plan peaks at {result.peak_bytes} bytes, "
                                    f"above the budget {budget}")
            return OffloadSolution(plan, _params(schedule, schedule_budget, method="exact", time_limit=time_limit),
                                   optimal=optimal, gap=gap, transfer=problem.transfer, model_time=model_time,
                                   stats=stats)
    if greedy is None:
        raise _infeasible(problem, budget, schedule, least)
    plan, result = _fits(problem, budget, greedy)
    if result.peak_bytes > budget:
        raise MemschedError(f"offload: the greedy plan peaks at {format_bytes(result.peak_bytes)}, above the budget "
                            f"{format_bytes(budget)}; use method='exact'")
    label = "greedy" if not use_exact else "greedy (exact model found nothing within the time limit)"
    return OffloadSolution(plan, _params(schedule, schedule_budget, method=label), optimal=False, gap=None,
                           transfer=problem.transfer, stats={"candidates": len(problem.candidates)})


def offload_greedy(chain: Chain, budget: int, transfer: Transfer = None, schedule="store_all",
                   schedule_budget: int = None) -> OffloadSolution:
    """The greedy's plan (module docstring), never claimed optimal."""
    return offload(chain, budget, transfer, schedule, schedule_budget, method="greedy")


def offload_all_policy(chain: Chain, budget: int = None, transfer: Transfer = None, schedule="store_all",
                       schedule_budget: int = None) -> OffloadSolution:
    """The hand policy (module docstring): every saved activation offloaded, whatever the budget (used only to
    pick the rotor compute schedule); the caller judges its peak."""
    channel = channel_of(chain, transfer)
    ops = compute_schedule(chain, 0 if budget is None else _budget(budget), schedule, schedule_budget)
    problem = build_problem(chain, ops, channel)
    plan = build_schedule(problem, hand_windows(problem))
    return OffloadSolution(plan, _params(schedule, schedule_budget), optimal=False, transfer=channel)


def offload_all(chain: Chain, budget: int, transfer: Transfer = None, schedule="store_all",
                schedule_budget: int = None) -> OffloadSolution:
    """:func:`offload_all_policy` as a registered solver (``solve`` refuses it when it does not fit)."""
    return offload_all_policy(chain, budget, transfer, schedule, schedule_budget)
