"""POFO: recomputation and offloading decided together, by one dynamic program over the chain (after Beaumont,
Eyraud-Dubois, Shilova, NeurIPS 2021).

Rotor's recurrence (:mod:`solvers.rotor`) with a third option per activation: the item that holds ``a_k``
leaves the device while it is not needed (*chain, offloaded* and *leaf j, offloaded*), timed exactly for that
class and filled by a numba kernel at Rotor's discretisation. :func:`pofo` runs it and Rotor, keeps the faster,
then re-times the plan with the exact offload solver (:mod:`solvers.offload`) on the same compute schedule and
on store-all's and Rotor's, within what is left of ``time_limit`` (a deadline for the whole solve; a Ctrl-C
stops the table within milliseconds). It returns a :class:`solvers.result.Solution` over the copy channel;
a re-timed plan is not marked optimal. docs/solvers.md derives the class, its timing and the re-timing.
"""

import math

import numba
import numpy as np

from planner.chain import Chain
from planner.errors import MemschedError
from planner.ops import TRANSFER_OPS, Op
from planner.simulate import simulate
from planner.simulate.chain import ChainSimulator
from planner.transfer import Transfer
from planner.units import format_bytes
from solvers.extremes import store_all_schedule
from solvers.kernels import compile_for
from solvers.limits import Deadline, TimeLimitReached, enough_time, fill_by_spans
from solvers.minimum import minimum_budget
from solvers.offload import channel_of, offload_within
from solvers.result import Solution
from solvers.rotor import DEFAULT_SLOTS, discretise, final_state_fits, rotor
from solvers.rotor_model import RotorArrays

CHAIN, CHAIN_OFFLOAD = 0, -1  # choice codes; a leaf j is +j, an offloaded leaf j is -(j + 1); NONE has no schedule
NONE = -(1 << 30)
DEFAULT_RETIMING_LIMIT = 10.0  # seconds for the whole solve: the table, Rotor, and re-timing with what is left
HELD_ALONE, IN_SAVED = 0, 1  # how a sub-chain's a_k is held: on its own (input k) or inside ā_k (saved k-1)


@numba.njit(cache=True, inline="always")
def _need_last(x, xown, bwd_tmp, param_prefix, k, e):
    """Units the last operation of ``k..e`` (``B k``, or the loss) needs: ``δ_k``, ``δ_{k+1}``, ``ā_{k+1}``
    shrunk, its temporary and the parameter gradients of ``k+1..e``."""
    return x[k] + x[k + 1] + xown[k + 1] + bwd_tmp[k] + param_prefix[e + 1] - param_prefix[k + 1]


@numba.njit(cache=True, inline="always")
def _relax(time, choice, low, shift, step, right, left, left_shift, code):
    """``time[m] = min(time[m], step + right[min(m - shift, top)] (+ left[m - left_shift] when left_shift >= 0))``
    for ``m >= low``, recording ``code`` where it improves."""
    top = len(time) - 1
    start = max(low, shift, 0)
    split = min(top, top + shift)  # beyond it m - shift > top: read right at the top
    if left_shift >= 0:
        for m in range(start, split + 1):
            cost = step + right[m - shift] + left[m - left_shift]
            if cost < time[m]:
                time[m] = cost
                choice[m] = code
        for m in range(max(start, split + 1), top + 1):
            cost = step + right[top] + left[m - left_shift]
            if cost < time[m]:
                time[m] = cost
                choice[m] = code
    else:
        for m in range(start, split + 1):
            cost = step + right[m - shift]
            if cost < time[m]:
                time[m] = cost
                choice[m] = code
        for m in range(max(start, split + 1), top + 1):
            cost = step + right[top]
            if cost < time[m]:
                time[m] = cost
                choice[m] = code


@numba.njit(cache=True)
def _fill_diagonal(x, xbar, xown, fwd_tmp, bwd_tmp, param_prefix, fwd_time, bwd_time, time, choice):
    """Fill ``time[kind, k, k, :]`` and ``choice`` for every ``k`` (in place)."""
    length = len(fwd_time) - 1
    top = time.shape[3] - 1
    for k in range(length + 1):
        low = max(x[k + 1] + xbar[k + 1] + fwd_tmp[k], _need_last(x, xown, bwd_tmp, param_prefix, k, k))
        for kind in range(2):
            for m in range(low, top + 1):
                time[kind, k, k, m] = fwd_time[k] + bwd_time[k]
                choice[kind, k, k, m] = CHAIN


@numba.njit(cache=True, parallel=True)
def _fill_spans(x, xbar, xown, fwd_tmp, nograd_tmp, bwd_tmp, param_prefix, fwd_time, bwd_time, units, d2h, h2d,
                time, choice, span_from, span_to):
    """Fill ``time[kind, k, e, :]`` and ``choice`` (in place) for every ``k < e`` with ``e - k`` in
    ``span_from..span_to-1``, the shorter spans being filled (see :class:`PofoTables`)."""
    length = len(fwd_time) - 1
    top = time.shape[3] - 1
    for span in range(span_from, span_to):
        for task in numba.prange(2 * (length + 1 - span)):
            kind, k = task % 2, task // 2
            e = k + span
            best, chosen = time[kind, k, e], choice[kind, k, e]
            offloadable = np.isfinite(d2h[kind, k]) and np.isfinite(h2d[kind, k])
            # chain: F_all k, then k+1..e holding ā_{k+1}, then B k
            chain_need = max(xbar[k + 1], x[e + 1] + xbar[k + 1] + fwd_tmp[k],
                             _need_last(x, xown, bwd_tmp, param_prefix, k, e))
            step = fwd_time[k] + bwd_time[k]
            right = time[1, k + 1, e]
            _relax(best, chosen, chain_need, xbar[k + 1], step, right, right, -1, CHAIN)
            if offloadable:
                stall = max(0.0, d2h[kind, k] - fwd_time[k]) + max(0.0, h2d[kind, k] - bwd_time[k + 1])
                last = xbar[k + 1] + _need_last(x, xown, bwd_tmp, param_prefix, k + 1, e)
                _relax(best, chosen, max(chain_need, last), xbar[k + 1] - units[kind, k], step + stall, right, right,
                       -1, CHAIN_OFFLOAD)
            # leaf j: F_ck k, F_none k+1..j-1, then j..e holding a_j, then k..j-1
            advance, forwards = 0.0, 0
            for j in range(k + 1, e + 1):
                advance += fwd_time[j - 1]
                if j == k + 1:
                    forwards = x[e + 1] + x[k + 1] + nograd_tmp[k]
                else:
                    forwards = max(forwards, x[e + 1] + x[j - 1] + x[j] + nograd_tmp[j - 1])
                later = param_prefix[e + 1] - param_prefix[j]
                low = max(forwards, x[j], later)
                if low > top:
                    continue
                left, right = time[kind, k, j - 1], time[0, j, e]
                _relax(best, chosen, low, x[j], advance, right, left, later, j)
                if offloadable:
                    stall = max(0.0, d2h[kind, k] - advance) + max(0.0, h2d[kind, k] - bwd_time[j])
                    last = x[j] + _need_last(x, xown, bwd_tmp, param_prefix, j, e)
                    _relax(best, chosen, max(low, last), x[j] - units[kind, k], advance + stall, right, left, later,
                           -(j + 1))


class PofoTables:
    """``time[kind, k, e, m]``: least seconds for sub-chain ``k..e`` with ``m`` spare units, ``a_k`` held as
    ``kind`` (HELD_ALONE or IN_SAVED); ``choice`` the same shape, with the codes above. States with more
    than ``top`` units (reached only inside sub-chains, after an offload) are read at ``top``: the table
    never gets slower with more memory, and the whole chain never has more than ``top``."""

    def __init__(self, arrays: RotorArrays, top: int, transfer: Transfer, unit: int, chain: Chain,
                 deadline: Deadline = None):
        self.a, self.top, self.unit = arrays, top, unit
        length = arrays.length
        self.length = length
        size = length + 1
        act_bytes = [chain.act_bytes(i) for i in range(size)]
        saved_bytes = [0] + [s.saved_bytes for s in chain.stages]
        item_bytes = (act_bytes, saved_bytes)  # indexed [kind][k]: the item holding a_k
        # memory an offload frees, rounded down to units, so that schedules fit in bytes
        self.item_units = np.array([[b // unit for b in items] for items in item_bytes], dtype=np.int64)
        usable = transfer is not None and transfer.usable
        self.d2h, self.h2d = (np.array([[transfer.seconds(b, direction) if usable and k > 0 else np.inf
                                         for k, b in enumerate(items)] for items in item_bytes])
                              for direction in ("d2h", "h2d"))
        self.time = np.full((2, size, size, top + 1), np.inf)
        self.choice = np.full((2, size, size, top + 1), NONE, dtype=np.int32)
        a = arrays

        def compile_kernels():  # compiled or loaded on first use (solvers/kernels.py), then the diagonal
            diagonal = (a.x, a.xbar, a.xown, a.fwd_tmp, a.bwd_tmp, a.param_prefix, a.fwd_time, a.bwd_time,
                        self.time, self.choice)
            compile_for(_fill_diagonal, *diagonal)
            compile_for(_fill_spans, a.x, a.xbar, a.xown, a.fwd_tmp, a.nograd_tmp, a.bwd_tmp, a.param_prefix,
                        a.fwd_time, a.bwd_time, self.item_units, self.d2h, self.h2d, self.time, self.choice, 1, 1)
            _fill_diagonal(*diagonal)

        def work(span):  # inner steps of one span: two tables, its sub-chains, their leaves, the memory states
            return 2 * (length + 1 - span) * span * (top + 1)

        def fill(first, last):
            _fill_spans(a.x, a.xbar, a.xown, a.fwd_tmp, a.nograd_tmp, a.bwd_tmp, a.param_prefix, a.fwd_time,
                        a.bwd_time, self.item_units, self.d2h, self.h2d, self.time, self.choice, first, last)

        # chunk by chunk, so that Ctrl-C and the deadline are seen within milliseconds (solvers.limits)
        fill_by_spans(length, work, fill, deadline, "filling its table", warm_up=compile_kernels)

    def schedule(self, k: int, e: int, m: int, kind: int) -> list:
        """The operations behind ``time[kind][k, e, m]``."""
        code = int(self.choice[kind, k, e, m])
        if code == NONE:
            raise AssertionError(f"no schedule for {k}..{e} at {m} units")
        a = self.a
        item = Op("Offload", k, "input") if kind == HELD_ALONE else Op("Offload", k - 1, "saved")
        release, prefetch = item._replace(kind="Release"), item._replace(kind="Prefetch")
        if k == e:
            return [Op("Loss")] if k == self.length else [Op("F_all", k), Op("B", k)]
        if code in (CHAIN, CHAIN_OFFLOAD):
            freed = int(self.item_units[kind, k]) if code == CHAIN_OFFLOAD else 0
            right = self.schedule(k + 1, e, min(m - int(a.xbar[k + 1]) + freed, self.top), IN_SAVED)
            if code == CHAIN:
                return [Op("F_all", k)] + right + [Op("B", k)]
            return [item, Op("F_all", k), release] + right[:-1] + [prefetch, right[-1], Op("B", k)]
        j = code if code > 0 else -code - 1
        forwards = [Op("F_ck", k)] + [Op("F_none", i) for i in range(k + 1, j)]
        later = int(a.param_prefix[e + 1] - a.param_prefix[j])
        left = self.schedule(k, j - 1, m - later, kind)
        if code > 0:
            return forwards + self.schedule(j, e, m - int(a.x[j]), HELD_ALONE) + left
        right = self.schedule(j, e, min(m - int(a.x[j]) + int(self.item_units[kind, k]), self.top), HELD_ALONE)
        return [item] + forwards + [release] + right[:-1] + [prefetch, right[-1]] + left


def pofo(chain: Chain, budget: int, transfer: Transfer = None, slots: int = DEFAULT_SLOTS,
         time_limit: float = DEFAULT_RETIMING_LIMIT) -> Solution:
    """The fastest schedule of POFO's class (docs/solvers.md) whose peak fits ``budget`` at ``slots``
    discretisation, with copies over ``transfer`` (default: the chain's channel); then re-timed by the exact
    offload solver, the faster plan kept.

    ``time_limit`` (seconds) covers the whole solve: the table, Rotor's plan and the re-timing, which gets what
    is left (none once it has passed: the table's plan is returned). A table that cannot be filled within it
    is a one-line :class:`MemschedError` saying what limit would do. 0: no re-timing, and no limit.
    """
    transfer = channel_of(chain, transfer, "pofo")
    if isinstance(time_limit, bool) or not isinstance(time_limit, (int, float)) or not 0 <= time_limit < math.inf:
        raise MemschedError(f"pofo: time_limit must be a number of seconds >= 0, got {time_limit!r}")
    deadline = Deadline(time_limit if time_limit > 0 else None)
    params = {"slots": slots, "time_limit": time_limit}
    simulator = ChainSimulator(chain)
    store_all = store_all_schedule(chain.length)
    high = simulator.run(store_all).peak_bytes
    if high <= budget:
        return Solution(store_all, params=params, optimal=True, transfer=transfer)
    unit, arrays, top = discretise(chain, budget, slots)
    found = None
    if top >= 0 and final_state_fits(arrays, top):
        try:
            tables = PofoTables(arrays, top, transfer, unit, chain, deadline)
        except TimeLimitReached as exc:
            raise _out_of_time(chain, time_limit, exc, f"{chain.length} stages, {top + 1} memory slots") from None
        if math.isfinite(tables.time[HELD_ALONE, 0, chain.length, top]):
            found = tuple(tables.schedule(0, chain.length, top, HELD_ALONE))
    optimal = found is not None
    found_time = math.inf if found is None else _time(chain, found, transfer)
    try:
        plain = rotor(chain, budget, slots)
    except MemschedError:
        plain = None
    plain_time = math.inf if plain is None else simulator.run(plain.schedule).time
    if plain is not None and plain_time <= found_time:
        optimal = plain.optimal and (found is not None or not transfer.usable)
        found, found_time = plain.schedule, plain_time
    retiming = transfer.usable and time_limit > 0
    if found is None and retiming:
        # below the table's reach: Rotor's schedules for budgets a little above the least memory, and store-all
        try:
            least = minimum_budget(chain, deadline)
        except TimeLimitReached as exc:
            raise _out_of_time(chain, time_limit, exc, f"{chain.length} stages") from None
        tries = [("rotor", least + int(point * (high - least))) for point in BELOW_POINTS] + [("store_all", None)]
        found = _fastest_offload(chain, budget, transfer, tries, deadline)
        if found is not None:
            return Solution(found, params=params, optimal=False, transfer=transfer)
        if deadline.passed(_MARGIN):
            raise MemschedError(f"pofo: no schedule of recomputation and offloading fits {format_bytes(budget)} "
                                f"({budget} bytes) within the time limit of {time_limit:g} s (the budget is below "
                                f"the least memory of any recomputation schedule, {format_bytes(least)}, and the "
                                f"offload plans tried ran out of time); give --time-limit "
                                f"{enough_time(4 * time_limit)} or more, or raise the budget")
    if found is None:
        least = minimum_budget(chain)
        where = (f"below the least memory of any recomputation schedule, {format_bytes(least)} ({least} bytes), "
                 "and no offload plan found reaches it" if budget < least else "at this bandwidth")
        raise MemschedError(f"pofo: no schedule of recomputation and offloading fits {format_bytes(budget)} "
                            f"({budget} bytes) {where}; raise the budget or the bandwidth")
    if retiming:
        # re-timed: the copies placed freely on the same compute schedule, on store-all, and on Rotor's schedule
        # for a budget halfway to the store-all peak
        compute = tuple(op for op in found if op.kind not in TRANSFER_OPS)
        tries = [(compute, None), ("store_all", None), ("rotor", (budget + high) // 2)]
        retimed = _fastest_offload(chain, budget, transfer, tries, deadline, than=found_time)
        if retimed is not None:
            return Solution(retimed, params=params, optimal=False, transfer=transfer)
    return Solution(found, params=params, optimal=optimal, transfer=transfer)


BELOW_POINTS = (0.0, 0.02, 0.05, 0.1, 0.25)  # Rotor schedules tried below the table's reach, as fractions of the
# way from the least memory to the store-all peak
_MARGIN = 0.05  # seconds of the time limit kept for simulating the plan after the last re-timing


def _out_of_time(chain: Chain, time_limit: float, exc: TimeLimitReached, size: str) -> MemschedError:
    """The one-line error of a table (or the least memory) that the time limit stopped half-way."""
    return MemschedError(f"pofo: the time limit ({time_limit:g} s) ran out while {exc.what} for chain "
                         f"'{chain.name}' ({size}; {100 * exc.done:.0f}% done); give --time-limit "
                         f"{enough_time(max(2 * exc.needed(), exc.needed() + 3))} or more")


def _fastest_offload(chain: Chain, budget: int, transfer: Transfer, tries, deadline: Deadline, than=math.inf):
    """The fastest exact offload plan within ``budget`` over the compute schedules ``tries`` (``(schedule,
    schedule_budget)`` pairs, as :func:`solvers.offload.offload` takes them), each given an equal share of what
    is left of ``deadline`` (what one leaves goes to the next), when it is faster than ``than`` seconds; else
    None."""
    best, best_time = None, than
    for index, (schedule, schedule_budget) in enumerate(tries):
        left = deadline.left() - _MARGIN
        if left <= 0.0:
            break
        share = left / (len(tries) - index)
        try:
            solution = offload_within(chain, budget, transfer, schedule, schedule_budget, Deadline(share))
        except MemschedError:  # no offload plan of that schedule fits (or none within its share)
            continue
        seconds = _time(chain, solution.schedule, transfer)
        if seconds < best_time * (1 - 1e-12):
            best, best_time = solution.schedule, seconds
    return best


def _time(chain: Chain, schedule, transfer) -> float:
    return simulate(chain, schedule, transfer).time
