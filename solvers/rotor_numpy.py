"""Rotor's tables in numpy, span by span: what a small chain is solved with, no kernel compiled.

The numba kernels (solvers/rotor.py, solvers/minimum.py) take seconds to compile on their first call on a machine
(issue 40: 9.5 CPU s for the first solve of a new install), while a chain of a few dozen stages fills its tables
in numpy in milliseconds. Each function here fills the same cells with the same arithmetic in the same order (a
stage's advance summed in index order, ``step + right + left``, the least over the choices, ties to the first
leaf, then the first way), so its tables equal the kernels' bit for bit (tests/solvers/test_rotor_numpy.py).

One span at a time, every sub-chain ``i..i+span`` of that span at once: the leaves ``j`` as a second axis and the
memory ``m`` as a third; the temporaries hold ``(L+1-span) x span x (top+1)`` values, which is why
:func:`solvers.rotor.compute_table` sends only small tables here (:data:`ROTOR_WORK`, :data:`MINIMUM_WORK`).
"""

import numpy as np

from solvers.rotor_model import CHAIN, NONE, RotorArrays

# The most steps (sub-chains x (leaves + ways) x levels, summed over the spans) of a table filled here while its
# kernel is not compiled: about a second (Rotor's: 62 stages at 500 levels; the least memory's: 400 stages).
ROTOR_WORK = 2.5e7
MINIMUM_WORK = 1.2e7


def _leaves(a: RotorArrays, i: np.ndarray, span: int):
    """For the sub-chains ``i..i+span`` (``i`` an array) and their leaves ``j = i+1..i+span`` (axis 1): ``(end,
    j, advance, forwards, later_params)``: the seconds and the units (``δ_{e+1}`` held) to advance from ``a_i``
    to ``a_j``, and the parameter gradients of ``j..end`` held meanwhile."""
    end = i + span
    j = i[:, None] + np.arange(1, span + 1)[None, :]
    advance = np.cumsum(a.fwd_time[j - 1], axis=1)  # in index order, as the kernels add them
    held = a.x[end + 1][:, None]
    step = np.where(j == i[:, None] + 1, held + a.x[i + 1][:, None] + a.nograd_tmp[i][:, None],
                    held + a.x[j - 1] + a.x[j] + a.nograd_tmp[j - 1])
    forwards = np.maximum.accumulate(step, axis=1)  # F_ck i, then F_none up to j-1: the peaks only grow with j
    later_params = a.param_prefix[end + 1][:, None] - a.param_prefix[j]
    return end, j, advance, forwards, later_params


def _leaf_low(a: RotorArrays, j, forwards, later_params):
    """Units a leaf ``j`` needs at least: to advance, to hold ``a_j``, and the gradients of ``j..end``."""
    return np.maximum(np.maximum(forwards, a.x[j]), later_params)


def _chain_lows(a: RotorArrays, i, end):
    """Units the *chain* choice needs, per way (axis 0) and sub-chain ``i..end`` (axis 1)."""
    xbar, xown, fwd_tmp, bwd_tmp = (w[:, i] for w in (a.ways_xbar[:, 1:], a.ways_xown[:, 1:], a.ways_fwd_tmp,
                                                      a.ways_bwd_tmp))
    return np.maximum(np.maximum(xbar, a.x[end + 1] + xbar + fwd_tmp),
                      a.x[i] + a.x[i + 1] + xown + bwd_tmp + a.param_prefix[end + 1] - a.param_prefix[i + 1])


def _single_stage(a: RotorArrays):
    """Per way (axis 0) and stage: the units ``F_all i`` then ``B i`` needs, and its seconds."""
    i = np.arange(a.length + 1)
    low = np.maximum(a.x[i + 1] + a.ways_xbar[:, i + 1] + a.ways_fwd_tmp,
                     a.x[i] + a.x[i + 1] + a.ways_xown[:, i + 1] + a.ways_bwd_tmp)
    return low, a.ways_fwd_time + a.ways_bwd_time


def fill_diagonal(a: RotorArrays, opt: np.ndarray) -> None:
    """``opt[i, i, :]`` for every ``i``, in place: the fastest way of the single stage that fits."""
    low, cost = _single_stage(a)
    memory = np.arange(opt.shape[2])
    i = np.arange(a.length + 1)
    opt[i, i] = np.where(memory >= low[:, :, None], cost[:, :, None], np.inf).min(axis=0)


def fill_spans(a: RotorArrays, opt: np.ndarray, first: int, last: int) -> None:
    """``opt[i, e, :]`` for the spans ``e - i`` in ``first..last-1``, in place, the shorter ones filled."""
    memory = np.arange(opt.shape[2])
    for span in range(first, last):
        i = np.arange(a.length + 1 - span)
        end, j, advance, forwards, later_params = _leaves(a, i, span)
        low = _leaf_low(a, j, forwards, later_params)
        right = opt[j[:, :, None], end[:, None, None], np.maximum(memory - a.x[j][:, :, None], 0)]
        left = opt[i[:, None, None], j[:, :, None] - 1, np.maximum(memory - later_params[:, :, None], 0)]
        leaf = np.where(memory >= low[:, :, None], advance[:, :, None] + right + left, np.inf).min(axis=1)
        step = a.ways_fwd_time[:, i] + a.ways_bwd_time[:, i]  # per way (axis 0) and sub-chain
        rest = opt[i[None, :, None] + 1, end[None, :, None], np.maximum(memory - a.ways_xbar[:, i + 1, None], 0)]
        chain = np.where(memory >= _chain_lows(a, i, end)[:, :, None], step[:, :, None] + rest, np.inf).min(axis=0)
        opt[i, end] = np.minimum(leaf, chain)  # (below a choice's low, the index clipped to 0 is masked)


def best_choice(a: RotorArrays, opt: np.ndarray, i: int, end: int, m: int) -> int:
    """The choice behind ``opt[i, e, m]`` (CHAIN or -k for way k, or a leaf j; NONE where nothing fits), by the
    table's arithmetic: ties go to a leaf, to the first j among leaves, and to the first way."""
    if i == end:
        low, cost = _single_stage(a)
        costs = np.where(m >= low[:, i], cost[:, i], np.inf)
    else:
        _, j, advance, forwards, later_params = (v[0] for v in _leaves(a, np.array([i]), end - i))
        fits = m >= _leaf_low(a, j, forwards, later_params)
        leaf = np.where(fits, advance + opt[j, end, np.where(fits, m - a.x[j], 0)]
                        + opt[i, j - 1, np.where(fits, m - later_params, 0)], np.inf)
        fits = m >= _chain_lows(a, np.array([i]), np.array([end]))[:, 0]
        chain = np.where(fits, (a.ways_fwd_time[:, i] + a.ways_bwd_time[:, i])
                         + opt[i + 1, end, np.where(fits, m - a.ways_xbar[:, i + 1], 0)], np.inf)
        costs = np.concatenate([leaf, chain])
    best = int(np.argmin(costs))
    if not np.isfinite(costs[best]):
        return NONE
    leaves = 0 if i == end else end - i
    return i + 1 + best if best < leaves else CHAIN - (best - leaves)


def least_memory_diagonal(a: RotorArrays, need: np.ndarray, choice: np.ndarray) -> None:
    """``need[i, i]`` and its way ``choice[i, i]`` (CHAIN or -k, the first of the least) for every ``i``."""
    low, _ = _single_stage(a)
    i = np.arange(a.length + 1)
    need[i, i] = low.min(axis=0)
    choice[i, i] = CHAIN - np.argmin(low, axis=0)


def least_memory_spans(a: RotorArrays, need: np.ndarray, choice: np.ndarray, first: int, last: int) -> None:
    """``need[i, e]`` and ``choice[i, e]`` for the spans ``e - i`` in ``first..last-1``, in place, the shorter
    ones filled: the least units, and the first choice reaching it (the leaves in order, then the ways)."""
    for span in range(first, last):
        i = np.arange(a.length + 1 - span)
        end, j, _, forwards, later_params = _leaves(a, i, span)
        leaf = np.maximum(np.maximum(forwards, a.x[j] + need[j, end[:, None]]), later_params + need[i[:, None], j - 1])
        xbar = a.ways_xbar[:, i + 1]
        chain = np.maximum(np.maximum(a.x[end + 1] + xbar + a.ways_fwd_tmp[:, i], xbar + need[i + 1, end]),
                           a.x[i] + a.x[i + 1] + a.ways_xown[:, i + 1] + a.ways_bwd_tmp[:, i]
                           + a.param_prefix[end + 1] - a.param_prefix[i + 1])
        candidates = np.concatenate([leaf, chain.T], axis=1)
        best = np.argmin(candidates, axis=1)
        need[i, end] = candidates[i, best]  # (i runs from 0: the row of sub-chain i..end)
        choice[i, end] = np.where(best < span, i + 1 + best, CHAIN - (best - span))
