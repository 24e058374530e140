"""Rotor: the optimal persistent checkpointing of heterogeneous chains (Beaumont et al., arXiv 1911.13214),
extended with parameter gradients.

:func:`rotor` fills ``opt[i, e, m]`` (the least time of the backward of stages ``i..e`` with ``m`` memory units
to spare; choices *chain* or *leaf j*) by numba kernels in interruptible chunks, and reads the fastest schedule
back; every schedule fits the chain simulator's model in bytes. ``slots=N`` is the published discretisation
(refused above ``TABLE_LIMIT_BYTES``); ``slots=None`` chooses the levels from the chain and merges stages when
the table would exceed ``TABLE_LIMIT_BYTES`` or ``WORK_LIMIT`` (then not optimal). It is never slower than
:func:`solvers.sqrt.sqrt` or :func:`solvers.revolve.revolve`; chains of more than ``MAX_STAGES`` stages are
refused in one line. docs/solvers.md gives the recurrence, the discretisation and the limits.
"""

import numba
import numpy as np

import solvers.rotor_numpy as rotor_numpy
from planner.chain import Chain, Stage
from planner.errors import MemschedError
from planner.ops import Op
from planner.simulate.chain import ChainSimulator
from planner.units import format_bytes
from solvers.extremes import store_all_schedule
from solvers.kernels import compile_for, in_numpy, ready, use_numpy
from solvers.limits import fill_by_spans
from solvers.minimum import least_memory_schedule
from solvers.result import Solution
from solvers.revolve import revolve_schedule
from solvers.rotor_model import NONE, RotorArrays, build_schedule, rotor_arrays
from solvers.sqrt import fastest_segments, segment_bounds

# Numba's default threading layers keep their workers spinning after a parallel kernel, which slows the
# PyTorch work that follows a solve (profile, solve and train share one process) by up to 20x on 2 cores;
# the workqueue layer lets them sleep. It must be chosen before the first parallel call.
numba.config.THREADING_LAYER = "workqueue"

DEFAULT_SLOTS = 500  # the published units in the budget, and the levels of the automatic choice's table
TABLE_LIMIT_BYTES = 2 * 2**30  # the largest table allocated: (stages+1)² × levels × 8 bytes
WORK_LIMIT = 2.5e9  # automatic choice: the most additions, stages³/6 × levels (about 2 s on 2 cores)
MAX_STAGES = 4000  # beyond, the exact least memory alone (O(L³), in every solve) takes minutes
HEADROOM_FROM = 0.02  # automatic choice: below this inflation by rounding, every level is the budget's (published)
MAX_HEADROOM = 1.0  # automatic choice: the budget keeps at least DEFAULT_SLOTS / (1 + MAX_HEADROOM) levels


@numba.njit(cache=True, inline="always")
def _relax(best, low, high, step, right, right_shift, left, left_shift):
    """``best[m] = min(best[m], step + right[m - right_shift] + left[m - left_shift])`` for ``low <= m < high``."""
    target = best[low:high]
    first = right[low - right_shift:high - right_shift]
    second = left[low - left_shift:high - left_shift]
    for k in range(high - low):  # slices and a counter from 0: no negative-index checks in the hot loop
        cost = step + first[k] + second[k]
        if cost < target[k]:
            target[k] = cost


@numba.njit(cache=True, parallel=True)
def _fill_diagonal(x, xbar, xown, fwd_tmp, bwd_tmp, fwd_time, bwd_time, opt):
    """Fill ``opt[i, i, :]`` for every ``i`` (in place); the way arrays are (ways, index) as in RotorArrays."""
    top = opt.shape[2] - 1
    for i in numba.prange(fwd_time.shape[1]):
        row = opt[i, i]
        row[:] = np.inf
        for k in range(fwd_time.shape[0]):
            low = max(x[i + 1] + xbar[k, i + 1] + fwd_tmp[k, i], x[i] + x[i + 1] + xown[k, i + 1] + bwd_tmp[k, i])
            cost = fwd_time[k, i] + bwd_time[k, i]
            for m in range(low, top + 1):
                if cost < row[m]:
                    row[m] = cost


@numba.njit(cache=True, parallel=True)
def _fill_spans(x, nograd_tmp, param_prefix, fwd_time, xbar, xown, fwd_tmp, bwd_tmp, way_fwd_time, bwd_time, opt,
                first, last):
    """Fill ``opt[i, e, :]`` (in place) for the sub-chains of spans ``e - i`` in ``first..last-1``, the shorter
    ones being filled (entries with ``i > e`` are left untouched). ``fwd_time`` is a stage's forward without
    autograd (leaves); the way arrays (ways, index) give each way of F_all and B (chain)."""
    length = len(fwd_time) - 1
    top = opt.shape[2] - 1
    zeros = np.zeros(top + 1)
    for span in range(first, last):
        for i in numba.prange(length + 1 - span):
            end = i + span
            best = opt[i, end]  # relaxed in place: no choice reads the cell it fills
            for m in range(top + 1):  # element by element: a slice assignment compiles numba's shape error (3-4 s)
                best[m] = np.inf
            advance, forwards = 0.0, 0
            for j in range(i + 1, end + 1):  # leaf j: advance to a_j, solve j..e, then i..j-1
                advance += fwd_time[j - 1]
                forwards = _advance_need(x, nograd_tmp, i, j, end, forwards)
                later_params = param_prefix[end + 1] - param_prefix[j]
                low = max(forwards, x[j], later_params)
                if low <= top:
                    _relax(best, low, top + 1, advance, opt[j, end], x[j], opt[i, j - 1], later_params)
            for k in range(xbar.shape[0]):  # chain: F_all i (way k), solve i+1..e, B i
                low = _chain_need(x, xbar[k], xown[k], fwd_tmp[k], bwd_tmp[k], param_prefix, i, end)
                if low <= top:
                    _relax(best, low, top + 1, way_fwd_time[k, i] + bwd_time[k, i], opt[i + 1, end], xbar[k, i + 1],
                           zeros, 0)


@numba.njit(cache=True)
def _advance_need(x, nograd_tmp, i, j, end, previous):
    """Units to advance from ``a_i`` to ``a_j`` (``F_ck i``, ``F_none i+1..j-1``) with ``δ_{e+1}`` held.

    ``previous`` is the need up to ``a_{j-1}`` (ignored for ``j = i+1``): the peaks only grow with ``j``.
    """
    if j == i + 1:
        return x[end + 1] + x[i + 1] + nograd_tmp[i]
    return max(previous, x[end + 1] + x[j - 1] + x[j] + nograd_tmp[j - 1])


@numba.njit(cache=True)
def _chain_need(x, xbar, xown, fwd_tmp, bwd_tmp, param_prefix, i, end):
    """Units the *chain* choice needs for ``F_all i`` (δ_{e+1} held) and for ``B i`` (gradients of i+1..e held,
    ``ā_{i+1}`` shrunk to what stage i's backward reads)."""
    return max(xbar[i + 1], x[end + 1] + xbar[i + 1] + fwd_tmp[i],
               x[i] + x[i + 1] + xown[i + 1] + bwd_tmp[i] + param_prefix[end + 1] - param_prefix[i + 1])


def final_state_fits(arrays: RotorArrays, top: int) -> bool:
    """After the last backward the input's gradient and every parameter gradient are held besides the input."""
    return int(arrays.x[0] + arrays.param_prefix[-1]) <= top


def compute_table(arrays: RotorArrays, top: int) -> np.ndarray:
    """``opt`` of shape (L+1, L+1, top+1): least seconds for every sub-chain ``i <= e`` and memory ``m``; a
    small table in numpy while the kernels are not compiled (solvers/kernels.py), the same values."""
    a, length = arrays, arrays.length
    opt = np.empty((length + 1, length + 1, top + 1))

    def work(span):
        return (length + 1 - span) * (span + len(a.ways_xbar)) * (top + 1)  # sub-chains x (leaves + ways) x levels

    if use_numpy(_fill_spans, sum(work(span) for span in range(1, length + 1)), rotor_numpy.ROTOR_WORK):
        with in_numpy():
            rotor_numpy.fill_diagonal(a, opt)
            fill_by_spans(length, work, lambda first, last: rotor_numpy.fill_spans(a, opt, first, last))
        return opt
    compile_for(_fill_diagonal, a.x, *a.ways, opt)
    compile_for(_fill_spans, a.x, a.nograd_tmp, a.param_prefix, a.fwd_time, *a.ways, opt, 1, 1)
    compile_for(_best_choice, a.x, a.nograd_tmp, a.param_prefix, a.fwd_time, *a.ways, opt, 0, 0, 0)
    _fill_diagonal(a.x, *a.ways, opt)
    # In chunks of a few milliseconds: a Ctrl-C is raised between two of them, never inside numba (solvers/limits.py).
    fill_by_spans(length, work, lambda first, last: _fill_spans(a.x, a.nograd_tmp, a.param_prefix, a.fwd_time,
                                                                *a.ways, opt, first, last))
    return opt


def best_choice(arrays: RotorArrays, opt: np.ndarray, i: int, end: int, m: int) -> int:
    """The choice behind ``opt[i, e, m]`` (CHAIN or -k for way k, or a leaf j), recomputed with the table's
    arithmetic (for ``i == e``, the way of the single stage): only the O(L) sub-chains on the optimal path are
    asked, so the table need not store choices. Ties go to a leaf, to the first j among leaves, and to the first
    way. By the kernel once compiled, else in numpy (the same choice)."""
    a = arrays
    if not ready(_best_choice):
        return rotor_numpy.best_choice(a, opt, i, end, m)
    return _best_choice(a.x, a.nograd_tmp, a.param_prefix, a.fwd_time, *a.ways, opt, i, end, m)


@numba.njit(cache=True)
def _best_choice(x, nograd_tmp, param_prefix, fwd_time, xbar, xown, fwd_tmp, bwd_tmp, way_fwd_time, bwd_time, opt,
                 i, end, m):
    best, choice = np.inf, NONE
    if i == end:
        for k in range(xbar.shape[0]):
            low = max(x[i + 1] + xbar[k, i + 1] + fwd_tmp[k, i], x[i] + x[i + 1] + xown[k, i + 1] + bwd_tmp[k, i])
            cost = way_fwd_time[k, i] + bwd_time[k, i]
            if m >= low and cost < best:
                best, choice = cost, -k
        return choice
    advance, forwards = 0.0, 0
    for j in range(i + 1, end + 1):
        advance += fwd_time[j - 1]
        forwards = _advance_need(x, nograd_tmp, i, j, end, forwards)
        later_params = param_prefix[end + 1] - param_prefix[j]
        if m >= max(forwards, x[j], later_params):
            cost = advance + opt[j, end, m - x[j]] + opt[i, j - 1, m - later_params]
            if cost < best:
                best, choice = cost, j
    for k in range(xbar.shape[0]):
        if m >= _chain_need(x, xbar[k], xown[k], fwd_tmp[k], bwd_tmp[k], param_prefix, i, end):
            cost = (way_fwd_time[k, i] + bwd_time[k, i]) + opt[i + 1, end, m - xbar[k, i + 1]]
            if cost < best:
                best, choice = cost, -k
    return choice


def discretise(chain: Chain, budget: int, slots: int):
    """``(unit, arrays, top)``: the unit in bytes, the arrays in units, and the units left once the input is held."""
    if slots < 1:
        raise MemschedError(f"rotor: slots must be a positive integer, got {slots}")
    unit, levels = units_of(budget, slots)
    arrays = rotor_arrays(chain, unit)
    return unit, arrays, levels - int(arrays.x[0])


def units_of(budget: int, slots: int) -> tuple:
    """``(unit, units)``: ``budget`` in ``slots`` units of ``budget // slots`` bytes (at least 1), and how many
    whole units it holds (fewer than ``slots`` when the budget is below ``slots`` bytes)."""
    unit = max(1, budget // slots)
    return unit, min(slots, budget // unit)


def table_bytes(stages: int, levels: int) -> int:
    """Bytes of Rotor's table over ``stages`` stages with ``levels`` memory levels (float64 entries)."""
    return (stages + 1) ** 2 * levels * 8


def table_work(stages: int, levels: int) -> float:
    """Additions filling that table: every sub-chain, every split, every level."""
    return stages ** 3 / 6 * levels


def merge_stages(chain: Chain, bounds) -> Chain:
    """The chain whose stage ``g`` runs stages ``bounds[g]..bounds[g+1]-1`` of ``chain`` one after the other.

    Its sizes bound the originals' in the simulator's model: a merged ``F_all`` is the stages' ``F_all`` in
    order (saved: their sum; the forward temporary covers each one's peak over those before it), ``F_ck`` is
    ``F_ck`` then ``F_none``, ``F_none`` all ``F_none``, ``B`` the backwards in reverse (its temporary covers
    every inner backward's peak, the inner gradients and saved tensors included), with the same memory
    after each operation, so a schedule of the merged chain, expanded by :func:`expand_schedule`, peaks no
    higher on ``chain`` and takes the same time (checked by the tests).
    """
    stages, merged = chain.stages, []
    for start, end in zip(bounds[:-1], bounds[1:]):
        group = stages[start:end]
        act = [chain.act_bytes(k) for k in range(start, end + 1)]
        saved, forward_peak = 0, 0
        for stage in group:
            forward_peak = max(forward_peak, saved + stage.saved_bytes + stage.fwd_tmp_bytes)
            saved += stage.saved_bytes
        nograd_peak = max([group[0].out_bytes + group[0].nograd_tmp_bytes]
                          + [act[k] + group[k].out_bytes + group[k].nograd_tmp_bytes for k in range(1, len(group))])
        # backward: the memory before each inner B, relative to before the group's first, and each one's peak
        offset, backward_peak = 0, 0
        for k in range(len(group) - 1, -1, -1):
            stage = group[k]
            backward_peak = max(backward_peak, offset + act[k] + stage.bwd_tmp_bytes)
            if k > 0:  # B k frees ā_{k+1}, δ_{k+1}; keeps its parameter gradients and δ_k; ā_k shrinks
                previous = group[k - 1]
                offset += (stage.param_bytes + act[k] - stage.own_saved_bytes - stage.out_bytes
                           - (previous.saved_bytes - previous.own_saved_bytes))
        merged.append(Stage(
            name=group[0].name if len(group) == 1 else f"{group[0].name}..{group[-1].name}",
            fwd_time=sum(stage.fwd_time for stage in group), bwd_time=sum(stage.bwd_time for stage in group),
            out_bytes=act[-1], saved_bytes=saved,
            own_saved_bytes=saved - group[-1].saved_bytes + group[-1].own_saved_bytes,
            fwd_tmp_bytes=max(0, forward_peak - saved), nograd_tmp_bytes=max(0, nograd_peak - act[-1]),
            bwd_tmp_bytes=max(0, backward_peak - act[0]), param_bytes=sum(stage.param_bytes for stage in group)))
    return Chain(name=f"{chain.name}_in_{len(merged)}_groups", device=chain.device, input_bytes=chain.input_bytes,
                 stages=tuple(merged), loss=chain.loss)


def expand_schedule(schedule, bounds) -> tuple:
    """A schedule of :func:`merge_stages`' chain as operations on the original stages."""
    ops = []
    for op in schedule:
        if op.kind == "Loss":
            ops.append(op)
            continue
        start, end = bounds[op.stage], bounds[op.stage + 1]
        if op.kind == "F_all":
            ops.extend(Op("F_all", k) for k in range(start, end))
        elif op.kind == "F_ck":
            ops.append(Op("F_ck", start))
            ops.extend(Op("F_none", k) for k in range(start + 1, end))
        elif op.kind == "F_none":
            ops.extend(Op("F_none", k) for k in range(start, end))
        else:
            ops.extend(Op("B", k) for k in range(end - 1, start - 1, -1))
    return tuple(ops)


def _inflation(chain: Chain, arrays: RotorArrays, unit: int) -> float:
    """How much rounding to ``unit`` inflates the store-all footprint (input, saved tensors, gradients)."""
    exact = chain.input_bytes + sum(s.saved_bytes + s.param_bytes for s in chain.stages)
    return (int(arrays.x[0]) + int(arrays.xbar.sum()) + int(arrays.param_prefix[-1])) * unit / max(1, exact) - 1


def _split_levels(chain: Chain, budget: int, levels: int):
    """``(unit, slots, headroom)``: the table's ``levels`` split into the budget's ``slots`` (``unit = budget //
    slots``) and ``headroom`` levels above it. The budget keeps them all while rounding to ``budget // levels``
    inflates the store-all footprint by less than ``HEADROOM_FROM``; beyond, it gets ``levels / (1 + 2 ×
    inflation)`` of them (the inflation taken at the unit that gives, in three steps), at least ``levels / (1 +
    MAX_HEADROOM)``: a schedule at the budget's level loses that inflation, one above it may fit in bytes."""
    levels = max(1, min(levels, budget))
    unit = budget // levels
    inflation = _inflation(chain, rotor_arrays(chain, unit), unit)
    if inflation < HEADROOM_FROM:
        return unit, levels, 0
    slots = levels
    for _ in range(3):
        slots = max(1, round(levels / (1 + min(MAX_HEADROOM, 2 * inflation))))
        unit = budget // slots
        inflation = _inflation(chain, rotor_arrays(chain, unit), unit)
    return unit, slots, levels - slots


def _most_stages(levels: int, length: int) -> int:
    """The most stages (at most ``length``) whose table of ``levels`` fits both limits."""
    stages = length
    while stages > 1 and (table_bytes(stages, levels) > TABLE_LIMIT_BYTES
                          or table_work(stages, levels) > WORK_LIMIT):
        stages = min(stages - 1, int(stages * 0.98))
    return stages


def automatic_resolution(chain: Chain, budget: int):
    """``(bounds, unit, slots, headroom)`` for ``slots=None``: the table keeps ``DEFAULT_SLOTS`` levels, as
    the published default, over every stage, or over as many groups of consecutive stages as the limits allow
    (``bounds``; None: every stage its own); they are split by :func:`_split_levels`."""
    groups = _most_stages(DEFAULT_SLOTS + 1, chain.length)
    bounds = None if groups == chain.length else tuple(segment_bounds(chain.length, groups))
    problem = chain if bounds is None else merge_stages(chain, bounds)
    return (bounds, *_split_levels(problem, budget, DEFAULT_SLOTS))


class _Levels:
    """Rotor's table for ``chain`` (merged into ``bounds`` groups, or not) at ``unit`` up to level ``top``, and
    the schedule of each level, expanded to the original stages and replayed."""

    def __init__(self, chain: Chain, bounds, unit: int, top: int, options: bool = False):
        self.bounds = bounds
        self.problem = chain if bounds is None else merge_stages(chain, bounds)
        self.arrays = rotor_arrays(self.problem, unit, options)
        self.opt = compute_table(self.arrays, top)
        self.simulator = ChainSimulator(chain)
        self._replays = {}

    def feasible(self, level: int) -> bool:
        return bool(np.isfinite(self.opt[0, self.problem.length, level])) and final_state_fits(self.arrays, level)

    def lowest(self):
        """The least level with a schedule (None: none up to the top): feasibility only grows with the level."""
        finite = np.flatnonzero(np.isfinite(self.opt[0, self.problem.length]))
        return next((int(level) for level in finite if final_state_fits(self.arrays, int(level))), None)

    def replay(self, level: int):
        """``(schedule, SimResult)`` of the table's schedule at ``level`` on the original chain."""
        if level not in self._replays:
            a, opt = self.arrays, self.opt
            schedule = build_schedule(a, lambda i, end, m: best_choice(a, opt, i, end, m), level)
            schedule = schedule if self.bounds is None else expand_schedule(schedule, self.bounds)
            self._replays[level] = schedule, self.simulator.run(schedule)
        return self._replays[level]

    def fits(self, level: int, budget: int) -> bool:
        return self.feasible(level) and self.replay(level)[1].peak_bytes <= budget


def _highest_fitting_level(levels: _Levels, budget: int, base: int, top: int):
    """The highest level up to ``top`` whose schedule fits ``budget`` in bytes, by bisection from the lowest
    feasible one (every level up to ``base``, the budget's, fits by construction); None when none does."""
    lowest = levels.lowest()
    if lowest is None:
        return None
    low = max(lowest, min(base, top))
    if not levels.fits(low, budget):
        return None
    if levels.fits(top, budget):
        return top
    high = top - 1  # the answer is in [low, high]
    while low < high:
        middle = (low + high + 1) // 2
        if levels.fits(middle, budget):
            low = middle
        else:
            high = middle - 1
    return low


def fastest_revolve(chain: Chain, budget: int):
    """``(seconds, schedule)``: Revolve's binomial schedule with the most snapshots whose peak fits ``budget``
    (doubling, then bisecting: Revolve's own answer where the peak grows with the snapshots, while its table
    stays as small as the answer), or None."""
    simulator, length = ChainSimulator(chain), chain.length
    replays = {}

    def fits(snapshots):
        if snapshots not in replays:
            schedule = revolve_schedule(length, snapshots)
            replays[snapshots] = schedule, simulator.run(schedule)
        return replays[snapshots][1].peak_bytes <= budget

    if not fits(1):
        return None
    low, high = 1, length  # low fits; the answer is in [low, high]
    while low < high:
        probe = min(high, 2 * low)
        if fits(probe):
            low = probe
        else:
            high = probe - 1
            break
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    schedule, result = replays[low]
    return result.time, schedule


def _limit_error(chain: Chain, slots: int, levels: int) -> str:
    most = max(0, TABLE_LIMIT_BYTES // ((chain.length + 1) ** 2 * 8) - 1)
    return (f"rotor: {slots} slots on {chain.length} stages need a {format_bytes(table_bytes(chain.length, levels))} "
            f"table, above its {format_bytes(TABLE_LIMIT_BYTES)} limit (solvers.rotor.TABLE_LIMIT_BYTES); give at "
            f"most {most} slots, or none to let rotor choose (it merges stages to fit)")


def check_length(chain: Chain) -> None:
    """Refuse, in one line, a chain longer than ``MAX_STAGES``: its exact least memory alone takes minutes."""
    if chain.length > MAX_STAGES:
        raise MemschedError(f"rotor: {chain.length} stages is above its limit of {MAX_STAGES} (solvers.rotor."
                            "MAX_STAGES; the exact least memory costs O(L³) time); profile the model in fewer, "
                            "larger stages")


def rotor(chain: Chain, budget: int, slots: int = None) -> Solution:
    """The fastest schedule whose peak fits ``budget``, at ``slots`` discretisation (None: chosen from the
    chain, see docs/solvers.md; the plan's ``params`` record what was used); every ``F_all`` keeps everything
    its stage saves (the stages' options are not used: :func:`hierarchical` chooses among them).

    Rounding sizes up can hide schedules that fit in exact bytes at the two
    ends of the budget range, so both ends are checked in bytes first: when
    storing everything fits, that is the optimum; when the discretised table
    has no schedule, the least-memory schedule is returned if it fits (not
    marked optimal). Rounding can also hide a schedule whose peak is within a
    few units of the budget: every segment schedule (Chen's and
    ``checkpoint_sequential``'s cuts) is checked in bytes too, and Revolve's
    where the plan is slower than any Revolve schedule can be; one faster than
    the table's is returned (not marked optimal), so Rotor is never slower than
    them at any budget.
    """
    return _fastest(chain, budget, slots, options=False)


def hierarchical(chain: Chain, budget: int, slots: int = None) -> Solution:
    """Rotor's dynamic program where each ``F_all i`` also chooses one of stage i's options (planner/chain.py,
    :class:`planner.chain.StageOption`: which of its results the stage keeps for its backward) or none; the same
    discretisation, byte checks and fallbacks as :func:`rotor`, of which it is a superset (never slower at any
    budget; below rotor's least memory where a stage's own saved tensors dominate). A chain without options
    gets rotor's schedule; a chain merged into groups to fit the table (long chains) loses its options.

    Where rounding leaves both tables without a schedule at the budget's level, each falls back on its own
    least-memory schedule, and hierarchical's (the least memory over options) can be the slower: rotor's
    answer is then taken, so that it is never slower at any budget, in bytes."""
    ours = _fastest(chain, budget, slots, options=True)
    if not chain.has_options:
        return ours
    try:
        theirs = _fastest(chain, budget, slots, options=False)
    except MemschedError:  # below rotor's least memory
        return ours
    simulator = ChainSimulator(chain)
    return theirs if simulator.run(theirs.schedule).time < simulator.run(ours.schedule).time else ours


def _fastest(chain: Chain, budget: int, slots, options: bool) -> Solution:
    length = chain.length
    check_length(chain)
    if slots is not None and (isinstance(slots, bool) or not isinstance(slots, (int, np.integer)) or slots < 1):
        raise MemschedError(f"rotor: slots must be a positive integer, got {slots}")
    if slots is None:
        bounds, unit, units, headroom = automatic_resolution(chain, budget)
        params = {"slots": units}
        if headroom:
            params["headroom_slots"] = headroom
        if bounds is not None:
            params["stage_groups"] = len(bounds) - 1
    else:
        bounds, headroom = None, 0
        unit, units = units_of(budget, slots)
        params = {"slots": slots}
    simulator = ChainSimulator(chain)
    store_all = store_all_schedule(length)
    if simulator.run(store_all).peak_bytes <= budget:
        return Solution(store_all, params=params, optimal=True)
    x0 = -(-chain.input_bytes // unit)
    base, top = units - x0, units + headroom - x0
    if slots is not None and table_bytes(length, top + 1) > TABLE_LIMIT_BYTES:
        raise MemschedError(_limit_error(chain, slots, top + 1))
    found, found_time = None, np.inf
    if top >= 0:
        levels = _Levels(chain, bounds, unit, top, options)
        level = _highest_fitting_level(levels, budget, base, top)
        if level is not None:
            schedule, result = levels.replay(level)
            # at or above the budget's level, as fast as any schedule that fits at this discretisation
            optimal = bounds is None and base >= 0 and levels.feasible(base)
            found, found_time = Solution(schedule, params=params, optimal=optimal), result.time
    segments = fastest_segments(chain, budget)
    if segments is not None and segments[0] < found_time:
        found, found_time = Solution(segments[1], params=params, optimal=False), segments[0]
    if found is None:
        least = least_memory_schedule(chain, options)
        result = simulator.run(least)
        if result.peak_bytes <= budget:
            found, found_time = Solution(least, params=params, optimal=False), result.time
    # Revolve runs F_all and B once per stage, the loss once, and advances every stage but the last at least
    # once: no faster than this bound. Only a plan slower than it (a tight budget: few snapshots) is checked.
    if found_time > (chain.compute_time + sum(s.fwd_time for s in chain.stages[:-1])) * (1 - 1e-9):
        binomial = fastest_revolve(chain, budget)
        if binomial is not None and binomial[0] < found_time:
            found, found_time = Solution(binomial[1], params=params, optimal=False), binomial[0]
    if found is None:
        raise MemschedError(f"{'hierarchical' if options else 'rotor'}: no schedule fits {budget} bytes; the "
                            "least memory any schedule needs is above it")
    return found
