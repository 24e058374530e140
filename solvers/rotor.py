"""Rotor: the optimal persistent checkpointing of heterogeneous chains.

Beaumont, Eyraud-Dubois, Herrmann, Joly, Shilova, "Optimal checkpointing for
heterogeneous chains: how to train deep neural networks with limited memory"
(arXiv 1911.13214), extended with parameter gradients. ``opt[i, e, m]`` is the
least time to run the backward of stages ``i..e`` (``e = L`` is the loss) when
``a_i`` and ``δ_{e+1}`` are held and ``m`` units remain besides ``a_i`` and the
parameter gradients of stages after ``e``. Two choices at ``i``:

* *chain*: ``F_all i``, solve ``i+1..e`` in ``m − x̄_{i+1}``, then ``B i``
  (checked with the parameter gradients of ``i+1..e`` now resident, and
  ``ā_{i+1}`` shrunk to ``own_saved_bytes`` since ``δ_{i+1}`` exists);
* *leaf j*: ``F_ck i, F_none i+1..j−1`` to reach ``a_j``, solve ``j..e`` in
  ``m − x_j``, then ``i..j−1`` in ``m`` minus the parameter gradients of ``j..e``.

Each forward's peak is checked where it happens, so every schedule found fits
the simulator's model (planner.simulator) in bytes; the exhaustive searches in
the tests confirm nothing faster exists. Memory is discretised as in the
published implementation: ``unit = budget // slots``, sizes rounded up, the
input's units taken from the ``slots`` first. The table is filled by a numba
kernel, diagonal by diagonal, stages of one diagonal in parallel.
"""

import numba
import numpy as np

from planner.chain import Chain
from planner.errors import MemschedError
from planner.simulator import ChainSimulator
from solvers.extremes import store_all_schedule
from solvers.minimum import least_memory_schedule
from solvers.result import Solution
from solvers.sqrt import fastest_segments
from solvers.rotor_model import CHAIN, RotorArrays, build_schedule, rotor_arrays

# Numba's default threading layers keep their workers spinning after a parallel kernel, which slows the
# PyTorch work that follows a solve (profile, solve and train share one process) by up to 20x on 2 cores;
# the workqueue layer lets them sleep. It must be chosen before the first parallel call.
numba.config.THREADING_LAYER = "workqueue"

DEFAULT_SLOTS = 500
SEGMENTS_CHECKED_UP_TO = 64  # stages: beyond, checking every segment schedule costs more than the DP


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
def _fill_table(x, xbar, xown, fwd_tmp, nograd_tmp, bwd_tmp, param_prefix, fwd_time, bwd_time, opt):
    """Fill ``opt[i, e, :]`` for every ``i <= e`` (entries with ``i > e`` are left untouched)."""
    length = len(fwd_time) - 1
    top = opt.shape[2] - 1
    zeros = np.zeros(top + 1)
    for i in numba.prange(length + 1):
        low = max(x[i + 1] + xbar[i + 1] + fwd_tmp[i], x[i] + x[i + 1] + xown[i + 1] + bwd_tmp[i])
        row = opt[i, i]
        for m in range(top + 1):
            row[m] = fwd_time[i] + bwd_time[i] if m >= low else np.inf
    for span in range(1, length + 1):
        for i in numba.prange(length + 1 - span):
            end = i + span
            best = np.full(top + 1, np.inf)
            advance, forwards = 0.0, 0
            for j in range(i + 1, end + 1):  # leaf j: advance to a_j, solve j..e, then i..j-1
                advance += fwd_time[j - 1]
                forwards = _advance_need(x, nograd_tmp, i, j, end, forwards)
                later_params = param_prefix[end + 1] - param_prefix[j]
                low = max(forwards, x[j], later_params)
                if low <= top:
                    _relax(best, low, top + 1, advance, opt[j, end], x[j], opt[i, j - 1], later_params)
            low = _chain_need(x, xbar, xown, fwd_tmp, bwd_tmp, param_prefix, i, end)
            if low <= top:  # chain: F_all i, solve i+1..e, B i
                _relax(best, low, top + 1, fwd_time[i] + bwd_time[i], opt[i + 1, end], xbar[i + 1], zeros, 0)
            opt[i, end, :] = best


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
    """``opt`` of shape (L+1, L+1, top+1): least seconds for every sub-chain ``i <= e`` and memory ``m``."""
    size = arrays.length + 1
    opt = np.empty((size, size, top + 1))
    _fill_table(arrays.x, arrays.xbar, arrays.xown, arrays.fwd_tmp, arrays.nograd_tmp, arrays.bwd_tmp, arrays.param_prefix,
                arrays.fwd_time, arrays.bwd_time, opt)
    return opt


def best_choice(arrays: RotorArrays, opt: np.ndarray, i: int, end: int, m: int) -> int:
    """The choice behind ``opt[i, e, m]`` (CHAIN or a leaf j), recomputed with the kernel's arithmetic.

    Only the O(L) sub-chains on the optimal path are asked, so the table need
    not store choices. Ties go to a leaf, and to the first j among leaves.
    """
    a = arrays
    best, choice = np.inf, -1
    advance, forwards = 0.0, 0
    for j in range(i + 1, end + 1):
        advance += a.fwd_time[j - 1]
        forwards = _advance_need(a.x, a.nograd_tmp, i, j, end, forwards)
        later_params = int(a.param_prefix[end + 1] - a.param_prefix[j])
        if m >= max(forwards, a.x[j], later_params):
            cost = advance + opt[j, end, m - a.x[j]] + opt[i, j - 1, m - later_params]
            if cost < best:
                best, choice = cost, j
    if m >= _chain_need(a.x, a.xbar, a.xown, a.fwd_tmp, a.bwd_tmp, a.param_prefix, i, end):
        cost = (a.fwd_time[i] + a.bwd_time[i]) + opt[i + 1, end, m - a.xbar[i + 1]]
        if cost < best:
            best, choice = cost, CHAIN
    return choice


def discretise(chain: Chain, budget: int, slots: int):
    """``(unit, arrays, top)``: the unit in bytes, the arrays in units, and the units left once the input is held."""
    if slots < 1:
        raise MemschedError(f"rotor: slots must be a positive integer, got {slots}")
    unit = max(1, budget // slots)
    arrays = rotor_arrays(chain, unit)
    return unit, arrays, slots - int(arrays.x[0])


def rotor(chain: Chain, budget: int, slots: int = DEFAULT_SLOTS) -> Solution:
    """The fastest schedule whose peak fits ``budget`` at ``slots`` discretisation.

    Rounding sizes up can hide schedules that fit in exact bytes at the two
    ends of the budget range, so both ends are checked in bytes first: when
    storing everything fits, that is the optimum; when the discretised table
    has no schedule, the least-memory schedule is returned if it fits (not
    marked optimal). Rounding can also hide a schedule whose peak is within a
    few units of the budget: on chains of up to ``SEGMENTS_CHECKED_UP_TO``
    stages every segment schedule (Chen's and ``checkpoint_sequential``'s
    cuts) is checked in bytes too, and one faster than the table's is returned
    (not marked optimal), so Rotor is never slower than them at any budget.
    """
    params = {"slots": slots}
    simulator = ChainSimulator(chain)
    store_all = store_all_schedule(chain.length)
    if simulator.run(store_all).peak_bytes <= budget:
        return Solution(store_all, params=params, optimal=True)
    unit, arrays, top = discretise(chain, budget, slots)
    found = None
    if top >= 0:
        opt = compute_table(arrays, top)
        if np.isfinite(opt[0, chain.length, top]) and final_state_fits(arrays, top):
            schedule = build_schedule(arrays, lambda i, end, m: best_choice(arrays, opt, i, end, m), top)
            found = Solution(schedule, params=params, optimal=True)
    if chain.length <= SEGMENTS_CHECKED_UP_TO:
        segments = fastest_segments(chain, budget)
        if segments is not None and (found is None or segments[0] < simulator.run(found.schedule).time):
            found = Solution(segments[1], params=params, optimal=False)
    if found is not None:
        return found
    least = least_memory_schedule(chain)
    if simulator.run(least).peak_bytes <= budget:
        return Solution(least, params=params, optimal=False)
    raise MemschedError(f"rotor: no schedule fits {budget} bytes; the least memory any schedule needs is above it")
