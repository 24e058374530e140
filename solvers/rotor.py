"""Rotor: the optimal persistent checkpointing of heterogeneous chains.

Beaumont, Eyraud-Dubois, Herrmann, Joly, Shilova, "Optimal checkpointing for
heterogeneous chains: how to train deep neural networks with limited memory"
(arXiv 1911.13214), extended with parameter gradients. ``opt[i, e, m]`` is the
least time to run the backward of stages ``i..e`` (``e = L`` is the loss) when
``a_i`` and ``δ_{e+1}`` are held and ``m`` units remain besides ``a_i`` and the
parameter gradients of stages after ``e``. Two choices at ``i``:

* *chain*: ``F_all i``, solve ``i+1..e`` in ``m − x̄_{i+1}``, then ``B i``
  (checked with the parameter gradients of ``i+1..e`` now resident);
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
from planner.plan import Op
from solvers.result import Solution
from solvers.rotor_model import RotorArrays, rotor_arrays

CHAIN = 0  # `what` code for the chain choice; a positive code j is a leaf at j; -1 infeasible
DEFAULT_SLOTS = 500


@numba.njit(cache=True, parallel=True)
def _fill_table(x, xbar, fwd_tmp, bwd_tmp, params, param_prefix, fwd_time, bwd_time, opt, what):
    length = len(fwd_time) - 1
    top = opt.shape[2] - 1
    for i in numba.prange(length + 1):
        low = max(x[i + 1] + xbar[i + 1] + fwd_tmp[i], x[i] + x[i + 1] + xbar[i + 1] + params[i] + bwd_tmp[i])
        for m in range(low, top + 1):
            opt[i, i, m] = fwd_time[i] + bwd_time[i]
            what[i, i, m] = CHAIN
    for span in range(1, length + 1):
        for i in numba.prange(length + 1 - span):
            end = i + span
            held = x[end + 1]
            mmin = held + x[i + 1] + fwd_tmp[i]
            for k in range(i + 1, end):
                mmin = max(mmin, held + x[k] + x[k + 1] + fwd_tmp[k])
            if mmin > top:
                continue
            row = opt[i, end]
            choice = what[i, end]
            advance = 0.0
            for j in range(i + 1, end + 1):
                advance += fwd_time[j - 1]
                later_params = param_prefix[end + 1] - param_prefix[j]
                right = opt[j, end]
                left = opt[i, j - 1]
                for m in range(max(mmin, x[j], later_params), top + 1):
                    cost = advance + right[m - x[j]] + left[m - later_params]
                    if cost < row[m]:
                        row[m] = cost
                        choice[m] = j
            inner_params = param_prefix[end + 1] - param_prefix[i + 1]
            low = max(mmin, xbar[i + 1], held + xbar[i + 1] + fwd_tmp[i],
                      x[i] + x[i + 1] + xbar[i + 1] + params[i] + bwd_tmp[i] + inner_params)
            sub = opt[i + 1, end]
            step = fwd_time[i] + bwd_time[i]
            for m in range(low, top + 1):
                cost = step + sub[m - xbar[i + 1]]
                if cost < row[m]:
                    row[m] = cost
                    choice[m] = CHAIN


def compute_table(arrays: RotorArrays, top: int):
    """``(opt, what)`` of shape (L+1, L+1, top+1): least seconds and the choice, for every sub-chain and memory."""
    size = arrays.length + 1
    opt = np.full((size, size, top + 1), np.inf)
    what = np.full((size, size, top + 1), -1, dtype=np.int32)
    _fill_table(arrays.x, arrays.xbar, arrays.fwd_tmp, arrays.bwd_tmp, arrays.params, arrays.param_prefix,
                arrays.fwd_time, arrays.bwd_time, opt, what)
    return opt, what


def backtrack(arrays: RotorArrays, what: np.ndarray, top: int) -> tuple:
    """The schedule behind ``opt[0, L, top]``, rebuilt from the choices."""
    length = arrays.length
    ops = []
    tasks = [("solve", 0, length, top)]  # worked through last in, first out
    while tasks:
        task = tasks.pop()
        if task[0] == "op":
            ops.append(task[1])
            continue
        _, i, end, m = task
        if i == end:
            ops.extend([Op("Loss")] if i == length else [Op("F_all", i), Op("B", i)])
            continue
        choice = int(what[i, end, m])
        if choice == CHAIN:
            ops.append(Op("F_all", i))
            tasks.append(("op", Op("B", i)))
            tasks.append(("solve", i + 1, end, m - int(arrays.xbar[i + 1])))
        else:
            ops.append(Op("F_ck", i))
            ops.extend(Op("F_none", k) for k in range(i + 1, choice))
            later_params = int(arrays.param_prefix[end + 1] - arrays.param_prefix[choice])
            tasks.append(("solve", i, choice - 1, m - later_params))
            tasks.append(("solve", choice, end, m - int(arrays.x[choice])))
    return tuple(ops)


def discretise(chain: Chain, budget: int, slots: int):
    """``(unit, arrays, top)``: the unit in bytes, the arrays in units, and the units left once the input is held."""
    if slots < 1:
        raise MemschedError(f"rotor: slots must be a positive integer, got {slots}")
    unit = max(1, budget // slots)
    arrays = rotor_arrays(chain, unit)
    return unit, arrays, slots - int(arrays.x[0])


def rotor(chain: Chain, budget: int, slots: int = DEFAULT_SLOTS) -> Solution:
    """The fastest schedule whose peak fits ``budget`` at ``slots`` discretisation."""
    unit, arrays, top = discretise(chain, budget, slots)
    if top >= 0:
        opt, what = compute_table(arrays, top)
        if np.isfinite(opt[0, chain.length, top]):
            return Solution(backtrack(arrays, what, top), params={"slots": slots, "unit_bytes": unit}, optimal=True)
    raise MemschedError(
        f"rotor: no schedule fits {budget} bytes once sizes are rounded up to {unit}-byte units "
        f"({slots} slots); raise --slots or the budget"
    )
