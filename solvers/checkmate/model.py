"""The reduced Checkmate MILP of one graph and budget (or its LP relaxation), as sparse rows: built with numpy,
started from a compute order (:meth:`CheckmateModel.start_vector`), solved by HiGHS or CBC
(solvers/checkmate/backends.py), bounded safely from any row multipliers (:meth:`CheckmateModel.safe_bound`).
docs/solvers.md derives the variables, constraints and reductions.
"""

import functools
import math
import time
from dataclasses import dataclass

import numpy as np

from planner.errors import MemschedError
from planner.graph import Graph
from solvers.checkmate.backends import solve_cbc, solve_highs
from solvers.limits import Deadline, Progress
from solvers.result import NoSchedule

BACKENDS = ("highs", "cbc")
_EXCLUSIVE = True  # R + S <= 1
_USED = True  # R[t,i] <= S[t+1,i] + Σ R[t,c]
_ONE = (-1, 1.0)  # a term: (column, constant); column -1 is the constant
_ZERO = (-1, 0.0)


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
            found, proven, objective, bound, values = solve_highs(self, deadline, gap, start)
        else:
            found, proven, objective, bound, values = solve_cbc(self, deadline, gap, start)
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
        found, finished, _, _, values = solve_cbc(self, Deadline.of(time_limit), 0.0, None, relax=True)
        if not (found and finished) or self.row_dual is None:
            return None, None
        return self.safe_bound(self.row_dual), values

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
