"""POFO (solvers/pofo.py): recomputation and offloading in one dynamic program.

Checked against an exhaustive search of its class on small chains (every combination of Rotor's choices and
the offload of each sub-chain's first activation, each schedule replayed by the offload simulator), against
Rotor (never slower; equal without a channel), and its table's times against the simulator's.
"""

import itertools
import math

import numpy as np
import pytest

from checks import one_line
from paths import EXAMPLE
from planner.chain import Chain, Loss, Stage, load_chain
from planner.errors import MemschedError
from planner.ops import Op
from planner.simulate import simulate
from planner.simulate.replay import ScheduleError
from planner.transfer import Transfer
from profiles.synthetic import random_chain
from solvers.extremes import store_all_schedule
from solvers.minimum import minimum_budget
from solvers.offload import offload
from solvers.pofo import HELD_ALONE, PofoTables, pofo
from solvers.rotor import discretise, rotor

ALONE, SAVED = "input", "saved"


def class_schedules(length):
    """Every schedule of POFO's class for a chain of ``length`` stages (as :mod:`solvers.pofo` describes it)."""

    def sub(k, e, kind):
        if k == e:
            yield [Op("Loss")] if k == length else [Op("F_all", k), Op("B", k)]
            return
        item = Op("Offload", k, "input") if kind == ALONE else Op("Offload", k - 1, "saved")
        release, prefetch = item._replace(kind="Release"), item._replace(kind="Prefetch")
        movable = k > 0
        for right in sub(k + 1, e, SAVED):
            yield [Op("F_all", k)] + right + [Op("B", k)]
            if movable:
                yield [item, Op("F_all", k), release] + right[:-1] + [prefetch, right[-1], Op("B", k)]
        for j in range(k + 1, e + 1):
            forwards = [Op("F_ck", k)] + [Op("F_none", i) for i in range(k + 1, j)]
            for right, left in itertools.product(list(sub(j, e, ALONE)), list(sub(k, j - 1, kind))):
                yield forwards + right + left
                if movable:
                    yield [item] + forwards + [release] + right[:-1] + [prefetch, right[-1]] + left

    return sub(0, length, ALONE)


def fastest_in_class(chain, budget, transfer):
    best = math.inf
    for schedule in class_schedules(chain.length):
        try:
            result = simulate(chain, schedule, transfer)
        except ScheduleError:
            continue
        if result.peak_bytes <= budget:
            best = min(best, result.time)
    return best


def small_chain(length, seed, **kind):
    """Sizes of a few bytes: a one-byte unit (slots = budget) makes the discretisation exact."""
    return random_chain(length, seed, scale_bytes=6, **kind)


def channels(chain):
    """No channel, and channels moving one stage's output in about 0.3x, 1x and 3x its forward time."""
    bytes_per_stage = np.mean([s.out_bytes for s in chain.stages]) or 1.0
    seconds = np.mean([s.fwd_time for s in chain.stages])
    out = [Transfer(0.0, 0.0)]
    for ratio in (0.3, 1.0, 3.0):
        bandwidth = bytes_per_stage / (ratio * seconds)
        out.append(Transfer(bandwidth, 0.7 * bandwidth, 0.05 * seconds))
    return out


@pytest.mark.parametrize("seed", range(40))
def test_dp_equals_exhaustive_search_of_its_class(seed):
    length = 1 + seed % 4
    chain = small_chain(length, seed, tmp=seed % 2 == 1, params=seed % 3 != 0, own_saved=seed % 5 < 2)
    low = minimum_budget(chain)
    high = simulate(chain, store_all_schedule(length)).peak_bytes
    rng = np.random.default_rng(seed)
    for transfer in channels(chain)[:: 1 + seed % 2]:
        for budget in sorted({low, int(rng.integers(low, high + 1)), max(low, high - 1)}):
            unit, arrays, top = discretise(chain, budget, budget)  # one-byte unit
            tables = PofoTables(arrays, top, transfer, unit, chain)
            table_time = tables.time[HELD_ALONE, 0, length, top]
            assert table_time == pytest.approx(fastest_in_class(chain, budget, transfer), rel=1e-12)
            schedule = tables.schedule(0, length, top, HELD_ALONE)
            result = simulate(chain, schedule, transfer)
            assert result.peak_bytes <= budget and result.time == pytest.approx(table_time, rel=1e-12)


@pytest.mark.parametrize("seed", range(12))
def test_never_slower_than_rotor_and_equal_without_a_channel(seed):
    chain = random_chain(12, seed, tmp=True, params=seed % 2 == 0, own_saved=seed % 3 == 0)
    low = minimum_budget(chain)
    high = simulate(chain, store_all_schedule(chain.length)).peak_bytes
    for fraction in (0.0, 0.3, 0.6, 0.9):
        budget = int(low + fraction * (high - low))
        plain = simulate(chain, rotor(chain, budget).schedule)
        none = pofo(chain, budget, Transfer(0.0, 0.0), time_limit=0)
        assert none.schedule == rotor(chain, budget).schedule
        for transfer in channels(chain)[1:]:
            solution = pofo(chain, budget, transfer, time_limit=0)
            result = simulate(chain, solution.schedule, transfer)
            assert result.peak_bytes <= budget
            assert result.time <= plain.time * (1 + 1e-12)


def test_offloading_pays_when_copies_hide_behind_compute():
    """With a channel twenty times faster than compute, POFO at a tight budget is clearly faster than Rotor and
    its copies cost almost no stalls."""
    chain = random_chain(16, 3, tmp=True, params=True)
    low = minimum_budget(chain)
    high = simulate(chain, store_all_schedule(chain.length)).peak_bytes
    budget = int(low + 0.2 * (high - low))
    base = channels(chain)[1]
    transfer = Transfer(20 * base.d2h_bandwidth, 20 * base.h2d_bandwidth)
    solution = pofo(chain, budget, transfer, time_limit=0)
    result = simulate(chain, solution.schedule, transfer)
    plain = simulate(chain, rotor(chain, budget).schedule)
    assert any(op.kind == "Offload" for op in solution.schedule)
    assert result.time < 0.97 * plain.time
    assert result.stall_time < 0.02 * result.time


def test_store_all_when_it_fits_and_clear_errors():
    chain = random_chain(6, 1, tmp=True)
    high = simulate(chain, store_all_schedule(chain.length)).peak_bytes
    assert pofo(chain, high, Transfer(1e9, 1e9)).schedule == store_all_schedule(chain.length)
    with pytest.raises(MemschedError,
                       match="pofo: no schedule.*below the least memory of any recomputation schedule") as info:
        pofo(chain, minimum_budget(chain) // 2, Transfer(1e12, 1e12), time_limit=2)
    one_line(info)
    for bad in (-1, float("inf"), "10"):
        with pytest.raises(MemschedError, match="time_limit must be"):
            pofo(chain, high, Transfer(1e9, 1e9), time_limit=bad)


@pytest.mark.slow
def test_retiming_keeps_the_faster_plan():
    """The example chain at 30% of the way from the least memory to store-all, with copies as long as forwards:
    the class's plan stalls where the exact offload solver hides every copy; the re-timed plan is never slower
    than the class's, nor than the store-all offload plan, and is marked not optimal when it is another."""
    chain = load_chain(EXAMPLE)
    low = minimum_budget(chain)
    high = simulate(chain, store_all_schedule(chain.length)).peak_bytes
    budget = int(low + 0.3 * (high - low))
    transfer = channels(chain)[2]
    table = pofo(chain, budget, transfer, time_limit=0)
    retimed = pofo(chain, budget, transfer, time_limit=6)
    store_all_offload = offload(chain, budget, transfer, time_limit=2)
    seconds = [simulate(chain, s.schedule, transfer).time for s in (table, retimed, store_all_offload)]
    assert seconds[1] <= seconds[0] and seconds[1] <= seconds[2] * (1 + 1e-12)
    assert seconds[1] < seconds[0] and not retimed.optimal and table.optimal
    assert simulate(chain, retimed.schedule, transfer).peak_bytes <= budget


def test_reaches_below_the_least_memory_of_recomputation_when_offloading_can():
    chain = random_chain(3, 0, own_saved=True)
    least = minimum_budget(chain)
    transfer = Transfer(1e12, 1e12)
    solution = pofo(chain, least - 1, transfer, time_limit=6)
    result = simulate(chain, solution.schedule, transfer)
    assert result.peak_bytes < least and any(op.kind == "Offload" for op in solution.schedule)
    with pytest.raises(MemschedError, match="below the least memory"):
        pofo(chain, least - 1, transfer, time_limit=0)  # the table alone cannot


def test_input_is_never_moved():
    stages = tuple(Stage(f"s{i}", 1.0, 1.0, 10, 10) for i in range(3))
    chain = Chain("big-input", "cpu", 1000, stages, Loss())
    for budget in range(minimum_budget(chain), 1100, 7):
        schedule = pofo(chain, budget, Transfer(1e6, 1e6), time_limit=0).schedule
        assert Op("Offload", 0, "input") not in schedule
