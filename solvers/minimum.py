"""The least memory any schedule needs: the smallest feasible budget, exactly, in bytes.

Same structure as Rotor's recurrence (solvers/rotor.py) with the time
replaced by the peak: ``need[i, e]`` is the least memory, besides ``a_i`` and
the parameter gradients of stages after ``e``, that processing stages
``i..e`` requires with ``δ_{e+1}`` held. No discretisation, so the result is
exact; budgets below it have no schedule at all. The table is filled chunk by chunk
(solvers/limits.py): a deadline and Ctrl-C are seen between chunks.
"""

import dataclasses

import numba
import numpy as np

import solvers.rotor_numpy as rotor_numpy
from planner.chain import Chain, StageOption
from solvers.kernels import compile_for, in_numpy, use_numpy
from solvers.limits import Deadline, fill_by_spans
from solvers.rotor_model import CHAIN, build_schedule, rotor_arrays


@numba.njit(cache=True)
def _least_memory_diagonal(x, xbar, xown, fwd_tmp, bwd_tmp, need, choice):
    """``need[i, i]`` and the way ``choice[i, i]`` (CHAIN or -k) for every ``i`` (in place); the way arrays are
    (ways, index) as in RotorArrays."""
    for i in range(len(need)):
        need[i, i], choice[i, i] = np.iinfo(np.int64).max, CHAIN
        for k in range(xbar.shape[0]):
            low = max(x[i + 1] + xbar[k, i + 1] + fwd_tmp[k, i], x[i] + x[i + 1] + xown[k, i + 1] + bwd_tmp[k, i])
            if low < need[i, i]:
                need[i, i], choice[i, i] = low, -k


@numba.njit(cache=True)
def _least_memory_spans(x, nograd_tmp, param_prefix, xbar, xown, fwd_tmp, bwd_tmp, need, choice, first, last):
    """``need[i, e]`` and ``choice[i, e]`` (in place) for the sub-chains ``i..e`` of spans ``first..last-1``,
    the shorter ones being filled: the least bytes and the choice (CHAIN or -k for way k, or leaf j) that
    achieves it."""
    length = len(need) - 1
    for span in range(first, last):
        for i in range(length + 1 - span):
            end = i + span
            held = x[end + 1]
            forwards = held + x[i + 1] + nograd_tmp[i]  # F_ck i, then F_none k for i < k < j, with δ_{e+1} held
            best, best_choice = np.iinfo(np.int64).max, CHAIN
            for j in range(i + 1, end + 1):
                if j > i + 1:
                    forwards = max(forwards, held + x[j - 1] + x[j] + nograd_tmp[j - 1])
                later_params = param_prefix[end + 1] - param_prefix[j]
                leaf = max(forwards, x[j] + need[j, end], later_params + need[i, j - 1])
                if leaf < best:
                    best, best_choice = leaf, j
            for k in range(xbar.shape[0]):
                chain = max(held + xbar[k, i + 1] + fwd_tmp[k, i], xbar[k, i + 1] + need[i + 1, end],
                            x[i] + x[i + 1] + xown[k, i + 1] + bwd_tmp[k, i] + param_prefix[end + 1]
                            - param_prefix[i + 1])
                if chain < best:
                    best, best_choice = chain, -k
            need[i, end], choice[i, end] = best, best_choice


def _least_memory_table(a, deadline: Deadline = None):
    """``(need, choice)`` over sub-chains ``i..e`` of the arrays ``a``, filled chunk by chunk (interruptible;
    :class:`TimeLimitReached` once ``deadline`` passes); a small table in numpy while the kernels are not compiled
    (solvers/kernels.py), the same values."""
    length = len(a.params) - 1
    need = np.zeros((length + 1, length + 1), dtype=np.int64)
    choice = np.full((length + 1, length + 1), CHAIN, dtype=np.int64)

    def work(span):
        return (length + 1 - span) * (span + len(a.ways_xbar))  # sub-chains x (leaves + ways)

    if use_numpy(_least_memory_spans, sum(work(span) for span in range(1, length + 1)), rotor_numpy.MINIMUM_WORK):
        with in_numpy():
            rotor_numpy.least_memory_diagonal(a, need, choice)
            fill_by_spans(length, work, lambda first, last: rotor_numpy.least_memory_spans(a, need, choice, first,
                                                                                             last),
                          deadline, "computing the least memory")
        return need, choice
    ways = a.ways[:4]  # xbar, xown, fwd_tmp, bwd_tmp per way

    def compile_kernels():  # then the diagonal
        compile_for(_least_memory_diagonal, a.x, *ways, need, choice)
        compile_for(_least_memory_spans, a.x, a.nograd_tmp, a.param_prefix, *ways, need, choice, 1, 1)
        _least_memory_diagonal(a.x, *ways, need, choice)

    fill_by_spans(length, work,
                  lambda first, last: _least_memory_spans(a.x, a.nograd_tmp, a.param_prefix, *ways, need, choice,
                                                          first, last),
                  deadline, "computing the least memory", warm_up=compile_kernels)
    return need, choice


def _table(chain: Chain, deadline: Deadline = None, options: bool = False):
    a = rotor_arrays(chain, options=options)
    return a, *_least_memory_table(a, deadline)


def minimum_budget(chain: Chain, deadline: Deadline = None, options: bool = False) -> int:
    """Bytes: the peak of the least-memory schedule for ``chain`` (the input included), its F_all choosing among
    the stages' options with ``options``; raises :class:`TimeLimitReached` when ``deadline`` passes first."""
    arrays, need, _ = _table(chain, deadline, options)
    final_state = arrays.x[0] + arrays.param_prefix[-1]  # δ_0 and every parameter gradient, after the last backward
    return int(arrays.x[0] + max(need[0, chain.length], final_state))


def least_budget_bound(chain: Chain, stages=None) -> int:
    """Bytes: a lower bound of :func:`minimum_budget` with ``options`` for ``chain`` once the stages ``stages``
    (indices; None: all) have whatever options they will have, known before those are measured. Every option
    keeps at least the stage's output (``saved_bytes`` counts it) and no bytes can be negative, so an ideal option,
    keeping the output alone with no temporaries, is no worse on any count than a measured one; the least memory
    only falls as a stage gains a way no worse on each count (each appears added inside a maximum, under a
    minimum over ways), so the least with an ideal option on each of ``stages`` is at most the least with any
    measured ones. The least without them is an upper bound."""
    chosen = range(chain.length) if stages is None else set(stages)
    ideal = tuple(dataclasses.replace(stage, options=stage.options + (StageOption(
        recompute=(), fwd_time=stage.fwd_time, bwd_time=stage.bwd_time, saved_bytes=stage.out_bytes,
        own_saved_bytes=0),)) if k in chosen else stage for k, stage in enumerate(chain.stages))
    return minimum_budget(dataclasses.replace(chain, stages=ideal), options=True)


def least_memory_schedule(chain: Chain, options: bool = False) -> tuple:
    """A schedule whose peak is :func:`minimum_budget` (the slowest useful one, usually)."""
    arrays, _, choice = _table(chain, options=options)
    return build_schedule(arrays, lambda i, end, m: choice[i, end], 0)
