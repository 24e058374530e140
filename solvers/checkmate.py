"""Checkmate: the rematerialisation MILP of Jain et al., "Checkmate: Breaking the Memory Wall with Optimal
Tensor Rematerialization" (MLSys 2020), on a :class:`planner.graph.Graph`.

The schedule is cut into ``n`` *frontier-advancing* stages, one per node: stage
``t`` computes node ``t`` for the first time, after recomputing any earlier
nodes it chooses, all in index order. Variables (``i <= t``):

* ``R[t,i]`` binary: node ``i`` is computed in stage ``t`` (``R[t,t] = 1``);
* ``S[t,i]`` binary (``i < t``): the value of ``i`` is resident when stage ``t`` starts;
* ``FREE[t,i,k]``: the value of ``i`` is freed right after node ``k`` (one of its
  consumers, or ``i`` itself) is computed in stage ``t``;
* ``U[t,k]`` continuous: the bytes resident right after node ``k`` is computed in stage ``t``.

Constraints: a node's dependencies are resident or computed earlier in the
stage (``R[t,k] <= R[t,i] + S[t,i]``); a value resident at the start of stage
``t+1`` was resident or computed in stage ``t`` (``S[t+1,i] <= R[t,i] + S[t,i]``);
``U[t,k] = U[t,k-1] - freed + out(k) R[t,k]``, and ``U[t,k] + tmp(k) R[t,k] <=
budget - fixed_bytes``. The objective is the total compute time ``Σ time(i)
R[t,i]``. ``keep`` values are resident from their computation to the end
(``S = 1``, never recomputed). First computations are in index order, so
``random`` nodes keep their order by construction.

``FREE`` is carried by a monotone *needed* indicator instead of Checkmate's
product linearisation: with ``c_1 < … < c_m`` the consumers of ``i`` that can
run in stage ``t``, ``N[t,i,a] >= N[t,i,a+1]``, ``N[t,i,a] >= R[t,c_{a+1}]``,
``N[t,i,m] >= S[t+1,i]``, and ``FREE[t,i,c_a] = N[t,i,a-1] - N[t,i,a]``
(``FREE[t,i,i] = R[t,i] - N[t,i,0]``). It is the same model with two
constraints per indicator instead of one per later consumer; the indicators
only lower memory when smaller, so they may be continuous. Further
reductions, each of which keeps the optimal time (an optimal schedule of the
class satisfies them all, or becomes one by dropping useless recomputations,
which never costs time or memory):

* ``R[t,i] + S[t,i] <= 1`` (recomputing a resident value only costs time);
* ``R[t,i] <= S[t+1,i] + Σ R[t,c]`` over the consumers ``c`` of ``i`` that can run
  in stage ``t`` (a recomputation nothing reads before the value is freed can
  be dropped: memory only falls, time does not rise);
* no ``R[t,i]``/``S[t,i]`` variable for ``i < t`` when no consumer of ``i``
  can run in stage ``t`` or later (a consumer is a later node, or a
  recomputable one: not ``keep`` and itself read); a ``keep`` value has ``S = 1``;
* ``N = 1`` constants where stage ``t``'s own node reads the value;
* ``U`` only where a node can run, the steps in between summed;
* no ``U``, ``N`` or budget row in a stage where every value it has a
  variable for, its own node's output, the ``keep`` values and its largest
  temporary fit the budget together (each ``U`` counts a value at most once,
  so those rows could never bind).

A schedule is read from ``R`` (stage by stage, in index order) and every
value freed eagerly (:func:`planner.graph.schedule_with_frees`), which holds
no more than the model's ``U``.

The model is built as a sparse matrix with numpy and handed to HiGHS
(highspy) in one ``passModel`` call; for CBC the same matrix is written as an
MPS file and given to the CBC binary bundled with pulp. Both backends start
from a feasible schedule when the fast heuristic of
:mod:`solvers.graph_heuristic` finds one within the budget (HiGHS
``setSolution``, CBC ``-mips``), so a time limit always has an incumbent to
return once the heuristic succeeded; the start changes no optimum, only the
search. With a time limit and HiGHS, :func:`checkmate` first solves the LP
relaxation by the interior point method (at most half the time left): a lower
bound that holds whatever the LP's accuracy (:meth:`CheckmateModel.safe_bound`),
so the reported gap is honest even when the time limit stops the MILP before
its own root LP, and roundings of its solution that may beat the greedy start.
When the start is already within the requested gap of that bound (within 1e-9
for gap 0: then proven optimal), the MILP is not run.

``checkmate_lp`` is the paper's approximation for large graphs: the LP
relaxation, then rounding of ``S`` (deterministic at 1/2, then randomised,
``S[t,i]`` kept with probability ``S*[t,i]``), ``R`` rebuilt from the rounded
``S`` as the least recomputation that makes it valid, and a repair: a
candidate above the budget is dropped, and while none fits the LP is solved
again at a smaller budget. The LP is solved by HiGHS's interior point method
without crossover (rounding needs values, not a vertex). It is never claimed
optimal; its gap is measured against a lower bound that holds whatever the LP
solution's accuracy: :meth:`CheckmateModel.safe_bound` of the LP's row
multipliers at the true budget.

Optimality is read from the solver's own status (HiGHS's model status, CBC's
result line), never from a label that a time limit can also produce. The gap
is relative to the step time (the objective including the time of every
first computation), between the schedule and the solver's bound.
"""

import functools
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np

from planner.errors import MemschedError
from planner.graph import Graph, schedule_with_frees
from planner.simulate.graph import GraphSimulator
from solvers.limits import Deadline, Progress, TimeLimitReached, enough_time, run_interruptibly

BACKENDS = ("highs", "cbc")
_THREADS = 2
_EXCLUSIVE = True  # R + S <= 1
_USED = True  # R[t,i] <= S[t+1,i] + Σ R[t,c]
_LP_FIRST = True  # with a time limit, solve the LP relaxation first (bound and roundings)
_LP_SHARE = 0.85  # of the time left after the heuristic (if the LP does not finish, neither would the MILP)
_LP_FIRST_COST = 2.0  # the LP first only with at least this many times the model's building time left
_CHILD_ABOVE = 4000  # columns: HiGHS runs in a child process above (see _solve_highs)
_KILL_GRACE = 0.3  # seconds past the deadline before a HiGHS child is killed
_MARGIN = 0.05  # seconds (and 1% of the limit) kept for reading and replaying the schedule
_ONE = (-1, 1.0)  # a term: (column, constant); column -1 is the constant
_ZERO = (-1, 0.0)


@functools.cache
def _highspy():
    """highspy, imported once; its banner (printed on the process's stdout when the first solver object is made)
    goes to /dev/null."""
    import highspy

    sys.stdout.flush()
    saved = os.dup(1)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 1)
        try:
            highspy.Highs()
        finally:
            os.dup2(saved, 1)
            os.close(saved)
    return highspy


def _silence_highs_banner() -> None:
    """Kept for callers of the pulp-era API: import highspy with its banner silenced."""
    _highspy()


class NoSchedule(MemschedError):
    """The solver found no schedule: the budget is infeasible (``proven``) or the time limit ran out first
    (``enough``: seconds of time limit to suggest instead, when known)."""

    def __init__(self, message: str, proven: bool, enough: float = None):
        super().__init__(message)
        self.proven = proven
        self.enough = enough


def _out_of_time(time_limit: float, exc: TimeLimitReached, size: str) -> NoSchedule:
    """The time limit ran out in a phase before any schedule existed: what to give instead."""
    return NoSchedule(f"the time limit ({time_limit:g} s) ran out before any schedule was found (while {exc.what}: "
                      f"{size}, {100 * exc.done:.0f}% done)", proven=False,
                      enough=enough_time(max(3 * exc.needed(), exc.needed() + 5)))


@dataclass(frozen=True)
class MilpResult:
    """A solved model: the stage-by-stage compute order, whether it is proven optimal, and the relative gap
    between its objective and the solver's bound (None when the backend does not report one)."""

    order: tuple
    optimal: bool
    gap: float
    objective: float = None  # the schedule's objective, offset included (model units)


class CheckmateModel:
    """The reduced Checkmate MILP for one graph and budget (bytes), or its LP relaxation (``relaxed``).

    With ``budget=None`` the budget is a variable and the objective is the
    peak memory instead of the time (the least memory of any schedule of the class).
    """

    def __init__(self, graph: Graph, budget, relaxed: bool = False, deadline: Deadline = None):
        started = time.perf_counter()
        self.graph = graph
        self.budget = budget
        self.relaxed = relaxed
        n = graph.size
        nodes = graph.nodes
        consumers = graph.consumers
        recomputable = [not node.keep and bool(consumers[i]) for i, node in enumerate(nodes)]
        # last stage in which some consumer of i can run (a recomputable consumer can run in any later stage)
        last_use = [max((n - 1 if recomputable[c] else c for c in consumers[i]), default=-1) for i in range(n)]
        self.unit_time = max(graph.compute_time / n, 1e-12)
        self.unit_mem = max(1.0, (budget - graph.fixed_bytes) / 1e4) if budget is not None else max(
            1.0, max(node.out_bytes for node in nodes) / 100)
        # columns
        self.col_lower, self.col_upper, self.col_cost, self.col_integer = [], [], [], []
        self.definition = []  # per column: None (R, S, peak), ("max", terms) for N, ("sum", pairs) for U
        # rows: (columns, coefficients), lower, upper
        self.row_cols, self.row_vals, self.row_lower, self.row_upper = [], [], [], []
        self.infeasible_constant = False
        self.solution = self.row_dual = None  # set by solve (row_dual: relaxed models on HiGHS)
        self.R, self.S = {}, {}
        # building is most of a time-limited solve on large graphs: the deadline is checked as it goes (a rough
        # measure of the work: the variable rows first, then each stage's rows, about 12 times its variables)
        progress, done = Progress(deadline, "building the model", 1), 0
        for t in range(n):
            for i in range(t):
                if recomputable[i] and last_use[i] >= t:
                    self.S[t, i] = self._column(0.0, 1.0, 0.0, not relaxed)
                    self.R[t, i] = self._column(0.0, 1.0, nodes[i].time / self.unit_time, not relaxed)

        def r(t, i):
            if i == t:
                return _ONE
            col = self.R.get((t, i))
            return _ZERO if col is None else (col, 0.0)

        def s(t, i):
            if t >= n or i >= t:
                return _ONE if nodes[i].keep and i < t else _ZERO
            if nodes[i].keep:
                return _ONE
            col = self.S.get((t, i))
            return _ZERO if col is None else (col, 0.0)

        self._r, self._s = r, s
        per_stage = [1] * n
        for t, _ in self.R:
            per_stage[t] += 1
        progress.total = 3 * len(self.R) + 12 * sum(per_stage)
        if budget is None:
            self.peak = self._column(0.0, math.inf, 1.0, False)
            available = None
            self.objective_offset = 0.0
        else:
            self.peak = None
            available = (budget - graph.fixed_bytes) / self.unit_mem
            if available < 0:
                self.infeasible_constant = True  # not even the fixed bytes fit
                available = 0.0
            self.objective_offset = graph.compute_time / self.unit_time
        size = [node.out_bytes / self.unit_mem for node in nodes]
        tmp = [node.tmp_bytes / self.unit_mem for node in nodes]
        if _EXCLUSIVE:
            for (t, i), col in self.R.items():
                self._row([(1.0, (col, 0.0)), (1.0, (self.S[t, i], 0.0))], -math.inf, 1.0)
        progress.step(done := done + len(self.R))
        for (t, i), col in self.S.items():
            if t + 1 < n and (t + 1, i) in self.S:
                self._row([(1.0, (self.S[t + 1, i], 0.0)), (-1.0, (col, 0.0)), (-1.0, r(t, i))], -math.inf, 0.0)
        progress.step(done := done + len(self.R))
        for (t, i), col in (self.R.items() if _USED else ()):  # a recomputation is read in its stage or carried on
            pairs = [(1.0, (col, 0.0)), (-1.0, s(t + 1, i))]
            pairs += [(-1.0, r(t, c)) for c in consumers[i] if c == t or (t, c) in self.R]
            self._row(pairs, -math.inf, 0.0)
        progress.step(done := done + len(self.R))
        live = [0] * n  # bytes of the values with a variable in each stage
        for t, i in self.S:
            live[t] += nodes[i].out_bytes
        keep_before = 0
        self.stages_without_memory = 0
        for t in range(n):
            # a node runnable in this stage needs its dependencies resident or computed before it
            runnable = [k for k in range(t + 1) if k == t or (t, k) in self.R]
            for k in runnable:
                for i in nodes[k].deps:
                    if not nodes[i].keep:
                        self._row([(1.0, r(t, i)), (1.0, s(t, i)), (-1.0, r(t, k))], 0.0, math.inf)
            # no memory rows where every value the stage can hold, at once, fits with its largest temporary
            most = graph.fixed_bytes + keep_before + live[t] + nodes[t].out_bytes + max(
                nodes[k].tmp_bytes for k in runnable)
            if budget is not None and most <= budget:
                self.stages_without_memory += 1
            else:
                self._stage_memory(t, r, s, size, tmp, available)
            if nodes[t].keep:
                keep_before += nodes[t].out_bytes
            progress.step(done := done + 12 * per_stage[t])
        self.build_seconds = time.perf_counter() - started

    # --- building blocks -------------------------------------------------------------------------

    def _column(self, lower, upper, cost, integer, definition=None) -> int:
        self.col_lower.append(lower)
        self.col_upper.append(upper)
        self.col_cost.append(cost)
        self.col_integer.append(integer)
        self.definition.append(definition)
        return len(self.col_lower) - 1

    def _row(self, pairs, lower, upper) -> None:
        """Add ``lower <= Σ coef * term <= upper`` (constants moved into the bounds, repeated columns summed)."""
        # (building is most of a time-limited solve at 200 nodes: lists, and a dict only for repeated columns)
        cols, vals, constant = [], [], 0.0
        for coef, (col, value) in pairs:
            if col < 0:
                constant += coef * value
            else:
                cols.append(col)
                vals.append(coef)
        if len(set(cols)) < len(cols):  # summed in their first position
            coefs = {}
            for col, coef in zip(cols, vals):
                coefs[col] = coefs.get(col, 0.0) + coef
            cols, vals = list(coefs), list(coefs.values())
        if 0.0 in vals:
            kept = [(col, coef) for col, coef in zip(cols, vals) if coef != 0.0]
            cols, vals = [col for col, _ in kept], [coef for _, coef in kept]
        lower, upper = lower - constant, upper - constant
        if not cols:
            if lower > 1e-9 or upper < -1e-9:
                self.infeasible_constant = True
            return
        self.row_cols.append(cols)
        self.row_vals.append(vals)
        self.row_lower.append(lower)
        self.row_upper.append(upper)

    def _needed(self, t, i, r, s):
        """The consumers of ``i`` that can run in stage ``t``, and per count ``a`` of them already run, the
        indicator 'the value of ``i`` is still needed' (``N[t,i,a]``; a constant 1 where forced)."""
        runnable = [c for c in self.graph.consumers[i] if c == t or (t, c) in self.R]
        needed = [None] * (len(runnable) + 1)
        needed[-1] = s(t + 1, i)
        for a in reversed(range(len(runnable))):
            later, uses = needed[a + 1], r(t, runnable[a])
            if later == _ONE or uses[0] < 0:
                needed[a] = _ONE  # a consumer that can run in stage t is a variable, or stage t's own node
                continue
            terms = [uses] if later[0] < 0 else [uses, later]
            col = self._column(0.0, 1.0, 0.0, False, ("max", terms))
            for term in terms:
                self._row([(1.0, (col, 0.0)), (-1.0, term)], 0.0, math.inf)
            needed[a] = (col, 0.0)
        return runnable, needed

    def _stage_memory(self, t, r, s, size, tmp, available):
        """``U[t,k]`` at every node ``k`` that can run in stage ``t``, and the budget on it.

        While ``k`` runs, value ``i`` counts ``S[t,i]`` if ``i > k``, ``R[t,k]`` if
        ``i = k``, and ``N[t,i,a]`` if ``i < k``, ``a`` its consumers before ``k``.
        Between two runnable nodes ``j < k`` only the terms of ``j``, of ``j``'s
        dependencies and of ``k`` change, so each ``U`` is the previous one plus those.
        """
        nodes = self.graph.nodes
        needs = {}

        def need(i, k):
            if i not in needs:
                needs[i] = self._needed(t, i, r, s)
            runnable, needed = needs[i]
            return needed[sum(c < k for c in runnable)]

        previous = None  # (j, U[t,j])
        for k in range(t + 1):
            if k != t and (t, k) not in self.R:
                continue
            if previous is None:
                keep = sum(node.out_bytes for node in nodes[:t] if node.keep) / self.unit_mem
                pairs = [(size[i], s(t, i)) for i in range(k + 1, t) if not nodes[i].keep] + [(keep, _ONE)]
            else:
                j, u_previous = previous
                pairs = [(1.0, (u_previous, 0.0)), (size[j], need(j, k)), (-size[j], r(t, j)), (-size[k], s(t, k))]
                for i in nodes[j].deps:
                    if not nodes[i].keep:
                        pairs += [(size[i], need(i, k)), (-size[i], need(i, j))]
            pairs.append((size[k], r(t, k)))
            # U is a sum of sizes times indicators in [0, 1], so >= 0; the budget row bounds it above
            u = self._column(0.0, math.inf if available is None else available, 0.0, False, ("sum", pairs))
            self._row([(1.0, (u, 0.0))] + [(-coef, term) for coef, term in pairs], 0.0, 0.0)
            if available is None:
                self._row([(1.0, (u, 0.0)), (tmp[k], r(t, k)), (-1.0, (self.peak, 0.0))], -math.inf, 0.0)
            else:
                self._row([(1.0, (u, 0.0)), (tmp[k], r(t, k))], -math.inf, available)
            previous = (k, u)

    # --- the matrix, a start, and the solvers ----------------------------------------------------------

    @functools.cached_property
    def matrix(self):
        """Row-wise CSR arrays ``(start, index, value)`` of the constraint matrix."""
        lengths = np.fromiter((len(cols) for cols in self.row_cols), dtype=np.int64, count=len(self.row_cols))
        start = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=start[1:])
        index = np.fromiter((c for cols in self.row_cols for c in cols), dtype=np.int32, count=int(start[-1]))
        value = np.fromiter((v for vals in self.row_vals for v in vals), dtype=float, count=int(start[-1]))
        return start, index, value

    def start_vector(self, order):
        """The column values of the frontier-advancing compute ``order`` with eager frees (``N`` at their least,
        ``U`` by their equations), or None when they violate the model (a schedule outside it, or above the
        budget)."""
        n = self.graph.size
        value = np.zeros(len(self.col_lower))
        stage_of = []  # stage of each position
        t = 0
        for v in order:
            stage_of.append(t)
            if v == t:
                t += 1
        if t != n:
            return None
        last_read = list(range(len(order)))
        made_at = {}
        for position, v in enumerate(order):
            for d in self.graph.nodes[v].deps:
                if d not in made_at:
                    return None
                last_read[made_at[d]] = position
            made_at[v] = position
        stage_start = [0] * (n + 1)
        for position in reversed(range(len(order))):
            stage_start[stage_of[position]] = position
        stage_start[n] = len(order)
        for position, v in enumerate(order):
            t = stage_of[position]
            if v != t:
                col = self.R.get((t, v))
                if col is None:
                    return None
                value[col] = 1.0
            if self.graph.nodes[v].keep:
                continue
            for later in range(t + 1, n):  # resident at the start of the later stages it survives into
                if last_read[position] < stage_start[later]:
                    break
                col = self.S.get((later, v))
                if col is None:
                    return None
                value[col] = 1.0
        for col, definition in enumerate(self.definition):
            if definition is None:
                continue
            kind, terms = definition
            if kind == "max":
                value[col] = max(term[1] if term[0] < 0 else value[term[0]] for term in terms)
            else:
                value[col] = sum(coef * (term[1] if term[0] < 0 else value[term[0]]) for coef, term in terms)
        start, index, coef = self.matrix
        activity = np.add.reduceat(coef * value[index], start[:-1]) if len(index) else np.zeros(0)
        empty = start[:-1] == start[1:]
        activity[empty] = 0.0
        lower, upper = np.asarray(self.row_lower), np.asarray(self.row_upper)
        tolerance = 1e-7 * np.maximum(1.0, np.abs(activity))
        if np.any(activity < lower - tolerance) or np.any(activity > upper + tolerance):
            return None
        return value

    def solve(self, backend: str = "highs", time_limit=None, gap: float = 0.0, start_order=None,
              start=None) -> MilpResult:
        """Solve with ``backend`` (from the compute order ``start_order``, or the column values ``start``, when
        given and valid) within ``time_limit`` (seconds from now, or a :class:`solvers.limits.Deadline`); raise
        :class:`NoSchedule` when there is no solution (infeasible or out of time)."""
        if backend not in BACKENDS:
            raise MemschedError(f"checkmate: unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        if self.infeasible_constant:
            raise NoSchedule("no schedule of this class fits the budget (proven infeasible)", proven=True)
        deadline = Deadline.of(time_limit)
        if start is None and start_order is not None and not self.relaxed:
            start = self.start_vector(start_order)
        if backend == "highs":
            found, proven, objective, bound, values = self._solve_highs(deadline, gap, start)
        else:
            found, proven, objective, bound, values = self._solve_cbc(deadline, gap, start)
        if not found and start is not None and not proven:
            # the solver stopped before it even took up the start (CBC on large models, or a time limit that ran
            # out before the solver started): the start is feasible
            found, objective, bound, values = True, float(np.dot(self.col_cost, start)), None, start
        if not found and proven:
            raise NoSchedule("no schedule of this class fits the budget (proven infeasible)", proven=True)
        if not found:
            raise NoSchedule("the time limit ran out before any schedule was found", proven=False)
        self.solution = values
        total = objective + self.objective_offset
        gap_value = None
        if proven and gap and bound is not None and total > 0:
            # a solver asked for a gap stops "optimal" once within it: the gap is the one to its bound
            gap_value = max(0.0, (total - (bound + self.objective_offset)) / total)
            proven = gap_value <= 1e-9
        elif proven:
            gap_value = 0.0
        elif total > 0 and not self.relaxed:
            # every cost is >= 0, so 0 bounds the recomputation time when the solver has no bound yet
            bound = 0.0 if bound is None else max(0.0, bound)
            gap_value = max(0.0, (total - (bound + self.objective_offset)) / total)
        return MilpResult(order=self._order(), optimal=proven, gap=gap_value, objective=total)

    def safe_bound(self, row_dual) -> float:
        """A lower bound on the objective (offset included) of every point of the model, integral or not, from any
        row multipliers ``row_dual`` (e.g. an interior-point LP solution's, not quite optimal or feasible): for
        rows ``lo <= a x <= hi`` and columns ``l <= x <= u``, ``c x = (c - Aᵀy) x + yᵀ A x >=
        Σ_j min((c - Aᵀy)_j l_j, (c - Aᵀy)_j u_j) + Σ_i min(y_i lo_i, y_i hi_i)``, valid for every ``y`` (a
        multiplier whose side is infinite is taken as 0)."""
        start, index, value = self.matrix
        lower, upper = np.asarray(self.row_lower), np.asarray(self.row_upper)
        best = -math.inf
        for sign in (1.0, -1.0):  # whichever sign convention the solver uses
            y = sign * np.asarray(row_dual, dtype=float)
            y = np.where((y > 0) & ~np.isfinite(lower), 0.0, y)
            y = np.where((y < 0) & ~np.isfinite(upper), 0.0, y)
            rows = np.repeat(np.arange(len(lower)), np.diff(start))
            reduced = np.asarray(self.col_cost, dtype=float) - np.bincount(
                index, weights=value * y[rows], minlength=len(self.col_cost))
            col_lower, col_upper = np.asarray(self.col_lower), np.asarray(self.col_upper)
            with np.errstate(invalid="ignore"):
                terms = np.minimum(reduced * col_lower, reduced * col_upper)
            terms[reduced == 0.0] = 0.0
            with np.errstate(invalid="ignore"):
                row_terms = np.where(y > 0, y * lower, np.where(y < 0, y * upper, 0.0))
            total = float(terms.sum() + row_terms.sum())
            if math.isfinite(total):
                best = max(best, total)
        return best + self.objective_offset

    def relaxation(self, time_limit=None):
        """``(bound, values)``: the LP relaxation of this model by CLP's dual simplex (the CBC binary bundled with
        pulp: on these models many times faster than HiGHS's simplex or interior point method), a lower bound on
        the objective (offset included) that holds whatever the solution's accuracy (:meth:`safe_bound` of its
        row multipliers), and its column values; ``(None, None)`` when it is not solved in time (``time_limit``:
        seconds from now, or a :class:`solvers.limits.Deadline`)."""
        found, finished, _, _, values = self._solve_cbc(Deadline.of(time_limit), 0.0, None, relax=True)
        if not (found and finished) or self.row_dual is None:
            return None, None
        return self.safe_bound(self.row_dual), values

    def _highs_model(self, offset: bool, integral: bool = True):
        """A HiGHS instance holding this model (integrality only with ``integral``, the offset with ``offset``)."""
        arrays = self._highs_arrays(None)
        if not integral:
            arrays["integral"] = None
        if not offset:
            arrays["offset"] = 0.0
        return _highs_instance(_highspy(), arrays, {"output_flag": False, "threads": _THREADS})

    def _highs_options(self, gap) -> dict:
        options = {"output_flag": False, "threads": _THREADS, "mip_rel_gap": float(gap), "mip_abs_gap": 0.0}
        if self.relaxed:  # rounding needs values, not a vertex: the interior point method without crossover
            options.update(solver="ipm", run_crossover="off")
        return options

    def _solve_highs(self, deadline: Deadline, gap, start):
        """(found, finished: optimal or proven infeasible, objective, bound, column values); objective and bound
        without the offset.

        HiGHS does not look at its clock (nor at an interrupt) in every phase: on models of 50,000 columns and
        more its setup after presolve runs for seconds past any time limit. Models above :data:`_CHILD_ABOVE`
        columns are therefore solved in a child process, killed :data:`_KILL_GRACE` seconds past the deadline
        (or at once on Ctrl-C); smaller ones here, in a thread that Ctrl-C interrupts (HiGHS's interrupt
        callback). A solve that the deadline leaves no time for is not started."""
        left = deadline.left()
        if left is not None and left <= 0.0:
            return False, False, math.nan, None, None
        options = self._highs_options(gap)
        if len(self.col_lower) > _CHILD_ABOVE:
            outcome = self._highs_child(options, start, deadline)
        else:
            outcome = self._highs_here(options, start, deadline)
        if outcome is None:  # killed at the deadline
            return False, False, math.nan, None, None
        status, primal_valid, objective, dual_bound, values, row_dual = outcome
        found = primal_valid and status != "infeasible"
        finished = status in ("optimal", "infeasible")
        objective -= self.objective_offset
        bound = None
        if not self.relaxed and math.isfinite(dual_bound):
            bound = dual_bound - self.objective_offset
        values = np.asarray(values) if found else None
        self.row_dual = np.asarray(row_dual) if found and self.relaxed else None
        if values is not None and start is not None:
            # HiGHS 1.16 can report the optimum yet hand back the start's values (seen when presolve solves the
            # whole model): trust the values only when their objective is the one reported, else solve again
            # without the start (when there is time for it; else the start is kept, not proven)
            recomputed = float(np.dot(self.col_cost, values))
            if abs(recomputed - objective) > 1e-6 * max(1.0, abs(objective)):
                if deadline.passed():
                    return False, False, math.nan, None, None
                return self._solve_highs(deadline, gap, None)
        return found, finished, objective, bound, values

    def _highs_arrays(self, start) -> dict:
        """The model as arrays for :func:`_highs_instance` (with the column values ``start`` as its start)."""
        start_row, index, value = self.matrix
        arrays = {name: np.asarray(getattr(self, name), dtype=float)
                  for name in ("col_cost", "col_lower", "col_upper", "row_lower", "row_upper")}
        arrays.update(start=start_row.astype(np.int32), index=index, value=value, offset=self.objective_offset,
                      integral=None if self.relaxed else np.asarray(self.col_integer, dtype=bool),
                      solution=None if start is None else np.asarray(start, dtype=float))
        return arrays

    def _highs_here(self, options, start, deadline):
        """Solve in this process (a thread Ctrl-C interrupts): the outcome tuple of :func:`_highs_outcome`."""
        highspy = _highspy()
        arrays = self._highs_arrays(start)
        left = deadline.left()
        if left is not None:
            options = dict(options, time_limit=max(0.01, left))
        highs = _highs_instance(highspy, arrays, options)
        highs.HandleUserInterrupt = True  # lets cancelSolve stop it
        run_interruptibly(highs.run, highs.cancelSolve)
        return _highs_outcome(highspy, highs, self.relaxed)

    def _highs_child(self, options, start, deadline):
        """Solve in a child process (see :meth:`_solve_highs`): the outcome tuple, or None when it was killed at
        the deadline."""
        import pickle

        left = deadline.left()
        job = pickle.dumps({"arrays": self._highs_arrays(start), "options": options, "relaxed": self.relaxed,
                            "deadline": None if left is None else time.monotonic() + left},
                           protocol=pickle.HIGHEST_PROTOCOL)
        try:
            child = subprocess.Popen([sys.executable, "-c", _HIGHS_CHILD], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        except OSError:  # no interpreter to start (an embedded Python): here, then
            return self._highs_here(options, start, deadline)
        try:
            left = deadline.left()
            try:
                out, err = child.communicate(job, timeout=None if left is None else max(0.1, left + _KILL_GRACE))
            except subprocess.TimeoutExpired:
                return None
        finally:  # killed at the deadline, on Ctrl-C, or on any error here
            if child.poll() is None:
                child.kill()
                child.wait()
        if child.returncode != 0 or not out:
            raise MemschedError(f"checkmate: HiGHS failed in its child process (exit status {child.returncode}): "
                                f"{err.decode(errors='replace').strip()[-300:]}")
        return pickle.loads(out)

    def _solve_cbc(self, deadline: Deadline, gap, start, relax=False):
        """As :meth:`_solve_highs`, with the CBC binary bundled with pulp on an MPS file of the same matrix (with
        ``relax`` or a relaxed model: its LP relaxation by CLP's dual simplex, row multipliers in ``row_dual``).
        CBC runs as a child process: killed past the deadline, or on Ctrl-C."""
        from pulp.apis import coin_api

        relax = relax or self.relaxed
        if deadline.passed():
            return False, False, math.nan, None, None
        began = time.perf_counter()
        time_limit = deadline.left()
        path = coin_api.PULP_CBC_CMD.pulp_cbc_path  # the CBC binary bundled with pulp
        highs = self._highs_model(offset=False, integral=not relax)
        with tempfile.TemporaryDirectory(prefix="memsched-cbc-") as folder:
            mps, solution, mipstart = (os.path.join(folder, name) for name in ("model.mps", "model.sol", "start.mst"))
            sys.stdout.flush()
            highs.writeModel(mps)
            args = [path, mps]
            if start is not None:
                with open(mipstart, "w") as out:
                    out.write("Stopped on time - objective value 0\n")
                    out.writelines(f"{col:>7} c{col} {value:>15} {0:>23}\n" for col, value in enumerate(start))
                args += ["-mips", mipstart]
            if time_limit is not None:  # CBC's clock starts after it read the file: leave it time for that
                writing = time.perf_counter() - began
                if time_limit - 2.0 * writing <= 0.0:  # no time left for CBC to read the file and solve
                    return False, False, math.nan, None, None
                args += ["-timeMode", "elapsed", "-sec", str(max(0.1, 0.9 * time_limit - 2.0 * writing))]
            args += ["-ratio", str(gap), "-allow", "0", "-threads", str(_THREADS)]
            args += ["-solve" if not relax else "-dualSimplex", "-printingOptions", "all", "-solution", solution]
            # CBC overruns "-sec" in phases it does not check the clock (seen: 99 s for 60 s at 300 nodes); past
            # the limit it is stopped, and the caller falls back on the start schedule, which is feasible
            hard_limit = None if time_limit is None else max(0.1, deadline.left() + _KILL_GRACE)
            try:
                run = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     text=True, check=False, timeout=hard_limit)
            except subprocess.TimeoutExpired:
                return False, False, math.nan, None, None
            log = run.stdout
            if not os.path.exists(solution):
                raise MemschedError(f"checkmate: CBC failed (exit status {run.returncode}): {log.strip()[-300:]}")
            with open(solution) as text:
                lines = text.read().splitlines()
        head = lines[0] if lines else ""
        values = np.zeros(len(self.col_lower))
        duals = np.zeros(len(self.row_lower))
        pattern = re.compile(r"^\**\s*(\d+)\s+([cr])(\d+)\s+(\S+)\s+(\S+)")
        for line in lines[1:]:
            match = pattern.match(line.strip())
            if match and match.group(2) == "c":
                values[int(match.group(3))] = float(match.group(4))
            elif match:
                duals[int(match.group(3))] = float(match.group(5))
        infeasible = head.startswith("Infeasible") or "Result - Problem proven infeasible" in log
        found = not infeasible and (head.startswith("Optimal") or (
            head.startswith("Stopped") and "objective value" in head and "no integer" not in head))
        finished = infeasible or "Result - Optimal solution found" in log or (relax and head.startswith("Optimal"))
        self.row_dual = duals if relax and found and finished else None
        objective = float(head.rsplit("objective value", 1)[1]) if found else math.nan
        bound = None
        for line in log.splitlines():
            if line.startswith("Lower bound:"):
                bound = float(line.split(":")[1])
        return found, finished, objective, bound, values if found else None

    def _order(self) -> tuple:
        """The compute order of the solution: stage by stage, nodes in index order."""
        order = []
        values = self.solution
        for t in range(self.graph.size):
            order += [i for i in range(t) if (t, i) in self.R and values[self.R[t, i]] > 0.5] + [t]
        return tuple(order)

    def values(self, table) -> dict:
        """A variable table's solution values, by key."""
        return {key: float(self.solution[col]) for key, col in table.items()}

    def peak_value(self) -> float:
        """The solved ``peak`` variable (budget None), in bytes above ``fixed_bytes``."""
        return float(self.solution[self.peak]) * self.unit_mem


def _highs_instance(highspy, arrays, options):
    """A HiGHS instance with the model of ``arrays`` (:meth:`CheckmateModel._highs_arrays`: row-wise matrix,
    integrality, offset and an optional start ``solution``) and ``options``. Self-contained: the HiGHS child
    process runs its source (``_HIGHS_CHILD``)."""
    lp = highspy.HighsLp()
    lp.num_col_ = len(arrays["col_cost"])
    lp.num_row_ = len(arrays["row_lower"])
    lp.col_cost_ = arrays["col_cost"]
    lp.col_lower_ = arrays["col_lower"]
    lp.col_upper_ = arrays["col_upper"]
    lp.row_lower_ = arrays["row_lower"]
    lp.row_upper_ = arrays["row_upper"]
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.start_ = arrays["start"]
    lp.a_matrix_.index_ = arrays["index"]
    lp.a_matrix_.value_ = arrays["value"]
    if arrays["integral"] is not None:
        lp.integrality_ = [highspy.HighsVarType.kInteger if integer else highspy.HighsVarType.kContinuous
                           for integer in arrays["integral"]]
    if arrays["offset"]:
        lp.offset_ = arrays["offset"]
    highs = highspy.Highs()
    for key, value in options.items():
        highs.setOptionValue(key, value)
    highs.passModel(lp)
    if arrays["solution"] is not None:
        solution = highspy.HighsSolution()
        solution.col_value = arrays["solution"].tolist()
        solution.value_valid = True
        highs.setSolution(solution)
    return highs


def _highs_outcome(highspy, highs, relaxed):
    """``(status, primal_valid, objective, dual_bound, col_values, row_dual)`` of a solved HiGHS instance: status
    "optimal", "infeasible" or HiGHS's name; values only when there is a primal solution (row multipliers for a
    relaxed model). Self-contained, as :func:`_highs_instance`."""
    status = highs.getModelStatus()
    name = ("optimal" if status == highspy.HighsModelStatus.kOptimal else
            "infeasible" if status == highspy.HighsModelStatus.kInfeasible else str(status))
    info = highs.getInfo()
    valid = info.primal_solution_status == 2
    solution = highs.getSolution() if valid else None
    return (name, valid, float(info.objective_function_value), float(info.mip_dual_bound),
            None if solution is None else list(solution.col_value),
            list(solution.row_dual) if solution is not None and relaxed else None)


_HIGHS_CHILD_MAIN = """
import os, pickle, sys, time
out = os.fdopen(os.dup(1), "wb")  # the result; HiGHS's banner goes to /dev/null
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
try:  # killed with the parent
    import ctypes, signal
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)
except Exception:
    pass
import highspy
job = pickle.load(sys.stdin.buffer)
options = dict(job["options"])
highs = _highs_instance(highspy, job["arrays"], options)
if job["deadline"] is not None:
    highs.setOptionValue("time_limit", max(0.01, job["deadline"] - time.monotonic()))
highs.run()
pickle.dump(_highs_outcome(highspy, highs, job["relaxed"]), out, protocol=pickle.HIGHEST_PROTOCOL)
out.flush()
"""


def _child_script() -> str:
    """The HiGHS child process's program: :func:`_highs_instance`, :func:`_highs_outcome` and the main part (their
    source read once, at import, while it is the code running here)."""
    import inspect

    return "\n".join([inspect.getsource(_highs_instance), inspect.getsource(_highs_outcome), _HIGHS_CHILD_MAIN])


_HIGHS_CHILD = _child_script()


def checkmate(graph: Graph, budget: int, backend: str = "highs", time_limit=None, gap: float = 0.0):
    """The fastest frontier-advancing schedule within ``budget`` bytes (proven optimal unless a time limit stopped
    the search, or ``gap`` > 0 allowed one relatively that far from the bound).

    ``time_limit`` (seconds) is a deadline for the whole solve: the greedy start, building the model, the LP
    first, its roundings and the MILP each get only what is left of it. When it runs out before the MILP
    could run, the best schedule so far (the greedy start, or a rounding of the LP) is returned, not proven
    optimal; when there is none, :class:`NoSchedule` says what time limit to give instead.
    """
    from solvers.graph import GraphSolution
    from solvers.graph_heuristic import greedy_order

    margin = 0.0 if time_limit is None else _MARGIN + 0.01 * time_limit  # for reading and replaying the schedule
    solve_by = Deadline(None if time_limit is None else max(0.0, time_limit - margin))
    params = {"backend": backend} if time_limit is None else {"backend": backend, "time_limit": time_limit}
    if gap:
        params["gap"] = gap
    heuristic_limit = 5.0 if time_limit is None else max(0.0, min(5.0, 0.1 * time_limit))
    start_order = greedy_order(graph, budget, heuristic_limit)
    simulator = GraphSimulator(graph)
    lower = None  # a lower bound on the step time (model units, offset included), from the LP

    def best_so_far():  # when the time runs out before the MILP: the start, with its gap to the bound
        if start_order is None:
            return None
        seconds = simulator.run(schedule_with_frees(graph, start_order)).time
        bound = graph.compute_time if lower is None else lower * model.unit_time
        return GraphSolution(schedule_with_frees(graph, start_order), params=params, optimal=False,
                             gap=max(0.0, (seconds - bound) / seconds) if seconds > 0 else 0.0)

    model = None
    try:
        model = CheckmateModel(graph, budget, deadline=solve_by)
    except TimeLimitReached as exc:
        if start_order is not None:
            return best_so_far()
        raise _out_of_time(time_limit, exc, f"{graph.size} nodes") from None
    left = solve_by.left()
    if left is not None and _LP_FIRST and backend == "highs" and left > _LP_FIRST_COST * model.build_seconds:
        # a time limit may stop the MILP before its root LP: first the LP by the interior point method, for a
        # bound that holds whatever happens next, and its roundings, for a better start
        lower, values = model.relaxation(_LP_SHARE * left)
        if values is not None:
            found = _best_rounding(graph, {key: values[col] for key, col in model.S.items()}, budget, 8,
                                   np.random.default_rng(0), simulator, solve_by)
            if found is not None and (start_order is None or found[0] < simulator.run(
                    schedule_with_frees(graph, start_order)).time):
                start_order = found[1]
    if solve_by.passed() and start_order is not None:
        return best_so_far()
    start = None if start_order is None else model.start_vector(start_order)
    if lower is not None and start is not None:  # the start may already be within the gap asked for of the LP's bound
        upper = float(np.dot(model.col_cost, start)) + model.objective_offset
        if upper - lower <= max(gap, 1e-9) * upper:
            return GraphSolution(schedule_with_frees(graph, start_order), params=params,
                                 optimal=upper - lower <= 1e-9 * upper, gap=max(0.0, (upper - lower) / upper))
    if solve_by.passed() and start_order is not None:
        return best_so_far()
    try:
        result = model.solve(backend, solve_by, gap, start=start)
    except NoSchedule as exc:
        if exc.proven or time_limit is None:
            raise
        if start_order is None:
            raise NoSchedule(f"the time limit ({time_limit:g} s) ran out before any schedule was found (the greedy "
                             f"start found none within the budget; the model took {model.build_seconds:.1f} s to "
                             "build)", proven=False, enough=enough_time(4 * time_limit)) from None
        return best_so_far()  # a start the model cannot take (outside its class) is still a schedule
    optimal, gap_value = result.optimal, result.gap
    if not optimal and lower is not None and result.objective:
        gap_value = min(gap_value, max(0.0, (result.objective - lower) / result.objective))
    return GraphSolution(schedule_with_frees(graph, result.order), params=params, optimal=optimal, gap=gap_value)


def _rebuild(graph: Graph, checkpoints) -> tuple:
    """The compute order that makes the rounded checkpoint sets valid with the least recomputation.

    ``checkpoints[t]`` is the set of values resident when stage ``t`` starts;
    stage ``t`` recomputes, in index order, what node ``t`` and the values
    checkpointed into stage ``t+1`` need and is not resident (recursively).
    """
    order = []
    n = graph.size
    for t in range(n):
        have = set(checkpoints[t])
        wanted = {t} | {i for i in (checkpoints[t + 1] if t + 1 < n else ()) if i not in have}
        stack = list(wanted)
        while stack:
            v = stack.pop()
            for dep in graph.nodes[v].deps:
                if dep not in have and dep not in wanted:
                    wanted.add(dep)
                    stack.append(dep)
        order += sorted(wanted)
    return tuple(order)


def checkmate_lp(graph: Graph, budget: int, backend: str = "highs", samples: int = 16, seed: int = 0,
                 time_limit=None):
    """Checkmate's LP relaxation with rounding: the fastest feasible schedule among the roundings tried (never
    marked optimal; its gap to the LP's safe bound at the true budget, when HiGHS solved it). ``samples``
    randomised roundings per LP; ``time_limit`` bounds the whole search (seconds)."""
    from solvers.graph import GraphSolution

    rng = np.random.default_rng(seed)
    simulator = GraphSimulator(graph)
    deadline = Deadline(None if time_limit is None else max(0.0, time_limit - _MARGIN - 0.01 * time_limit))
    best = None
    bound = None  # a lower bound on the step time: from the LP at the true budget
    stopped = None  # the phase the deadline stopped, if any
    for fraction in (1.0, 0.9, 0.8, 0.65, 0.5):
        if fraction < 1.0 and deadline.passed():  # the first model is built in any case: it says how far it got
            break
        target = graph.fixed_bytes + int((budget - graph.fixed_bytes) * fraction)
        try:
            model = CheckmateModel(graph, target, relaxed=True, deadline=deadline)
        except TimeLimitReached as exc:
            stopped = exc
            break
        try:
            model.solve(backend, deadline)
        except NoSchedule:
            continue
        if fraction == 1.0 and model.row_dual is not None:
            bound = model.safe_bound(model.row_dual) * model.unit_time
        found = _best_rounding(graph, model.values(model.S), budget, samples, rng, simulator, deadline)
        if found is not None and (best is None or found[0] < best[0]):
            best = (found[0], schedule_with_frees(graph, found[1]))
        if best is not None:
            break
    if best is None and stopped is not None:
        raise _out_of_time(time_limit, stopped, f"{graph.size} nodes")
    if best is None and deadline.passed():
        raise NoSchedule(f"the time limit ({time_limit:g} s) ran out before any schedule was found (no rounding "
                         "of the LP relaxation fitted the budget by then)",
                         proven=False, enough=enough_time(4 * time_limit))
    if best is None:
        raise NoSchedule("no rounding of the LP relaxation fits the budget (the budget may still be feasible: "
                         "try --solver checkmate)", proven=False)
    params = {"backend": backend, "samples": samples, "seed": seed}
    if time_limit is not None:
        params["time_limit"] = time_limit
    gap = None if bound is None else max(0.0, (best[0] - bound) / best[0]) if best[0] > 0 else 0.0
    return GraphSolution(best[1], params=params, optimal=False, gap=gap)


def _best_rounding(graph: Graph, values: dict, budget: int, samples: int, rng, simulator=None,
                   deadline: Deadline = None):
    """``(seconds, compute order)`` of the fastest rounding of the LP values ``S[t,i]`` (``values``) that fits the
    budget (deterministic at 1/2, then ``samples`` randomised, as far as ``deadline`` allows), or None."""
    simulator = simulator or GraphSimulator(graph)
    keys = list(values)
    kept = [{i for i in range(t) if graph.nodes[i].keep} for t in range(graph.size)]
    best = None
    for number, draw in enumerate([np.full(len(keys), 0.5)] + [rng.random(len(keys)) for _ in range(samples)]):
        if number and deadline is not None and deadline.passed():
            break
        checkpoints = [set(k) for k in kept]
        for (t, i), u in zip(keys, draw):
            if values[t, i] > u:
                checkpoints[t].add(i)
        order = _rebuild(graph, checkpoints)
        result = simulator.run(schedule_with_frees(graph, order))
        if result.peak_bytes <= budget and (best is None or result.time < best[0]):
            best = (result.time, order)
    return best


def least_peak(graph: Graph, backend: str = "highs", time_limit=None):
    """(bytes, proven): the least peak of any frontier-advancing schedule, or ``(None, False)`` when the time
    limit (building the model included) stops the search first. ``fixed_bytes`` included."""
    deadline = Deadline(time_limit)
    try:
        model = CheckmateModel(graph, None, deadline=deadline)
        result = model.solve(backend, deadline)
    except (NoSchedule, TimeLimitReached):
        return None, False
    if result.optimal:
        peak = GraphSimulator(graph).run(schedule_with_frees(graph, result.order)).peak_bytes
        return peak, True
    return None, False
