"""The offload problem of one compute schedule: every production of an item, its gaps and bytes, and the plans
built from windows (:func:`schedule_with_windows`).

A *candidate* is a production of an item (``saved i`` by ``F_all i``, ``input i`` by ``F_ck``/``F_none i-1``);
a *gap* a run of operations between two touches of it that ends with a read; a *window* of a gap releases the
item before operation ``r`` and prefetches it before ``p``. :func:`least_offload_peak` is the least peak any
window choice reaches. The rules (reads, bytes) are the offload simulator's (planner/simulate/offload.py);
docs/solvers.md states the class of plans and why.
"""

from dataclasses import dataclass
from typing import NamedTuple

from planner.chain import Chain
from planner.errors import MemschedError
from planner.ops import TRANSFER_OPS, Op
from planner.simulate.chain import ChainSimulator
from planner.simulate.offload import device_bytes, reads
from planner.transfer import Transfer
from planner.units import sum_seconds
from solvers.extremes import store_all_schedule
from solvers.limits import Deadline, run_interruptibly
from solvers.minimum import minimum_budget
from solvers.rotor import rotor

SCHEDULES = ("store_all", "rotor")
WORKERS = 2  # CP-SAT's


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
        return sum_seconds(self.durations)

    @property
    def peak(self) -> int:
        return max(self.peaks, default=0)

    def copy_seconds(self, nbytes: int, direction: str) -> float:
        return self.transfer.seconds(nbytes, direction)



def compute_schedule(chain: Chain, budget: int, schedule="store_all", schedule_budget: int = None,
                     deadline: Deadline = None) -> tuple:
    """The compute schedule to offload from: ``"store_all"``, ``"rotor"`` (Rotor's plan at ``schedule_budget``,
    by default at the budget, and never below the least memory any schedule needs: its computation stops at
    ``deadline``), or a schedule given as operations (without transfers)."""
    if isinstance(schedule, str):
        if schedule not in SCHEDULES:
            raise MemschedError(f"offload: unknown compute schedule {schedule!r}; choose one of {', '.join(SCHEDULES)} "
                                "or give a schedule")
        if schedule == "store_all":
            if schedule_budget is not None:
                raise MemschedError("offload: schedule_budget is for the rotor compute schedule, not store_all")
            return store_all_schedule(chain.length)
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
    """Replay ``ops`` and list every production of an item with its reads, bytes and gaps (docs/solvers.md). With
    a channel that cannot move data both ways there are no candidates."""
    compute = ChainSimulator(chain)  # the offload simulator's read rule and item sizes, so that both agree
    state = compute.initial_state()
    durations, peaks, done = [], [], []
    live = {}  # item -> [produced, reads, sizes [(op, bytes)]]
    for k, op in enumerate(ops):
        read = reads(chain, state, op)
        new, peak, seconds = compute.step(state, op)
        durations.append(seconds)
        peaks.append(peak)
        for item in read:
            if item in live:
                live[item][1].append(k)
        for item in list(live):
            nbytes = _bytes(chain, new, item)
            if nbytes is None:
                done.append((item, *live.pop(item), k))
            elif nbytes != live[item][2][-1][1]:
                live[item][2].append((k, nbytes))
        for item in _items(new, chain.length):
            if item not in live:
                live[item] = [k, [], [(k, _bytes(chain, new, item))]]
        state = new
    n = len(ops)
    done.extend((item, *record, n) for item, record in live.items())
    candidates = []
    if transfer.usable:
        for item, produced, readers, sizes, freed in sorted(done, key=lambda d: (d[1], d[0])):
            touches = sorted({produced, *readers})
            gaps = []
            for a, b in zip(touches, touches[1:]):
                if b - a >= 2 and b in readers:
                    anchor, nbytes = max((s for s in sizes if s[0] <= a), key=lambda s: s[0])
                    if nbytes > 0:
                        gaps.append(Gap(a + 1, b - 1, anchor, nbytes))
            if gaps:
                candidates.append(Candidate(item, produced, freed, tuple(readers), tuple(gaps)))
    return OffloadProblem(chain, transfer, tuple(ops), tuple(durations), tuple(peaks), tuple(candidates))


def _items(state, length: int):
    for i in range(length):
        if state.abar >> (i + 1) & 1:
            yield ("saved", i)
    for i in range(1, length + 1):
        if state.standalone >> i & 1:
            yield ("input", i)


def _bytes(chain: Chain, state, item):
    try:
        return device_bytes(chain, state, item)
    except ValueError:
        return None



def schedule_with_windows(problem: OffloadProblem, windows) -> tuple:
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


def least_offload_peak(problem: OffloadProblem, deadline: Deadline = None) -> int:
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
    from ortools.sat.python import cp_model  # (0.7 s: kept out of ``import solvers``)

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
    solver.parameters.num_workers = WORKERS
    solver.parameters.max_time_in_seconds = seconds
    status = solve_cp(solver, model)
    if status == cp_model.OPTIMAL:
        return int(solver.Value(top))
    return max(relaxed, int(solver.BestObjectiveBound())) if status == cp_model.FEASIBLE else relaxed


def solve_cp(solver, model):
    """``solver.Solve(model)``, stopped at once by Ctrl-C (CP-SAT's own SIGINT handler would swallow it)."""
    solver.parameters.catch_sigint_signal = False
    return run_interruptibly(lambda: solver.Solve(model), solver.StopSearch)
