"""Rotor on long chains (issue 19): the parameter gradients' rounding, the automatic resolution (levels split
around the budget, stages merged into groups within the table limits), the segment check in bytes at every
length, and the one-line refusals beyond the limits."""

import importlib

import numpy as np
import pytest

from checks import one_line
from planner import ChainSimulator, MemschedError, simulate
from planner.ops import Op
from profiles.synthetic import random_chain
from solvers import solve, store_all_peak
from solvers.minimum import least_memory_schedule, minimum_budget
from solvers.rotor_model import rotor_arrays
from solvers.sqrt import checkpoint_sequential_bounds, fastest_segments, segment_bounds, segments_schedule

rotor_module = importlib.import_module("solvers.rotor")  # `solvers.rotor` itself is the function
rotor = rotor_module.rotor
minimum_module = importlib.import_module("solvers.minimum")


def least_memory_not_reached(*args):
    """In place of the least memory's table (every least-memory computation fills it): not to be reached."""
    raise AssertionError("the least memory was computed (minutes on a long chain) before the refusal")


def budgets(chain, count):
    low, high = minimum_budget(chain), store_all_peak(chain)
    return [int(b) for b in np.linspace(low, high - 1, count)]


def test_parameter_gradients_are_rounded_as_the_suffixes_they_are_held_in():
    chain = random_chain(40, 3, tmp=True, params=True)
    params = [s.param_bytes for s in chain.stages]
    for unit in (1, 1000, 10**6, 10**7, 10**9):
        arrays = rotor_arrays(chain, unit)
        for k in range(chain.length + 2):
            held = sum(params[k:])  # the gradients of stages k.. (after the backward of stage k)
            assert arrays.param_prefix[-1] - arrays.param_prefix[k] == -(-held // unit)
        assert np.array_equal(np.diff(arrays.param_prefix), arrays.params)
    assert rotor_arrays(chain, 1).params[:-1].tolist() == params


def test_a_table_with_fewer_slots_than_stages_keeps_its_schedules():
    """Rounding each stage's gradients up lost a unit per stage: with fewer slots than stages not even the final
    state fitted, and only the least-memory schedule was left (at 500 slots, on every chain of 500 stages)."""
    chain = random_chain(120, 5, tmp=True, params=True)
    budget = (minimum_budget(chain) + store_all_peak(chain)) // 2
    _, arrays, top = rotor_module.discretise(chain, budget, 100)
    assert rotor_module.final_state_fits(arrays, top)
    assert np.isfinite(rotor_module.compute_table(arrays, top)[0, chain.length, top])
    plan = solve(chain, budget, "rotor", slots=100)
    assert plan.params == {"slots": 100}
    assert plan.predicted.time < 0.6 * simulate(chain, least_memory_schedule(chain)).time


def random_schedule(simulator, length, rng, limit=400):
    """A random schedule that the simulator accepts (any order, not only persistent ones), or None."""
    moves = [Op(kind, i) for i in range(length) for kind in ("F_all", "F_ck", "F_none", "B")] + [Op("Loss")]
    state, ops = simulator.initial_state(), []
    while not simulator.is_complete(state) and len(ops) < limit:
        valid = []
        for op in moves:
            try:
                valid.append((op, simulator.step(state, op)[0]))
            except ValueError:
                pass
        weights = np.array([4.0 if op.kind in ("B", "Loss") else 1.0 for op, _ in valid])
        op, state = valid[rng.choice(len(valid), p=weights / weights.sum())]
        ops.append(op)
    return tuple(ops) if simulator.is_complete(state) else None


@pytest.mark.parametrize("seed", range(8))
def test_a_merged_chain_bounds_its_stages_in_every_schedule(seed):
    chain = random_chain(9, seed, tmp=seed % 2 == 0, params=seed % 3 != 0, own_saved=seed % 4 < 2)
    rng = np.random.default_rng(seed)
    cuts = sorted(rng.choice(np.arange(1, 9), size=int(rng.integers(2, 6)), replace=False).tolist())
    bounds = [0] + cuts + [9]
    merged = rotor_module.merge_stages(chain, bounds)
    assert merged.length == len(bounds) - 1
    merged_simulator, simulator = ChainSimulator(merged), ChainSimulator(chain)
    schedules = [random_schedule(merged_simulator, merged.length, rng) for _ in range(40)]
    schedules += [rotor(merged, b, slots=200).schedule for b in budgets(merged, 6)]
    checked = 0
    for schedule in filter(None, schedules):
        coarse = merged_simulator.run(schedule)
        fine = simulator.run(rotor_module.expand_schedule(schedule, bounds))
        assert fine.peak_bytes <= coarse.peak_bytes
        assert fine.time == pytest.approx(coarse.time, rel=1e-12)
        checked += 1
    assert checked >= 30


def fastest_segments_by_replaying_every_cut(chain, budget):
    simulator, best = ChainSimulator(chain), None
    for count in range(1, chain.length + 1):
        for bounds in sorted({tuple(segment_bounds(chain.length, count)),
                              tuple(checkpoint_sequential_bounds(chain.length, count))}):
            result = simulator.run(segments_schedule(chain.length, count, list(bounds)))
            if result.peak_bytes <= budget and (best is None or result.time < best[0]):
                best = (result.time, segments_schedule(chain.length, count, list(bounds)))
    return best


@pytest.mark.parametrize("seed", range(10))
def test_fastest_segments_replays_few_cuts_and_finds_the_fastest(seed):
    chain = random_chain(5 + 4 * seed, seed, tmp=seed % 2 == 0, params=seed % 3 != 0, own_saved=seed % 4 == 0,
                         homogeneous=seed % 5 == 0)
    for budget in budgets(chain, 9) + [store_all_peak(chain)]:
        assert fastest_segments(chain, budget) == fastest_segments_by_replaying_every_cut(chain, budget)


def assert_never_slower_than_sqrt_and_revolve(chain, count):
    for budget in budgets(chain, count):
        plan = solve(chain, budget, "rotor")
        for name in ("sqrt", "revolve"):
            try:
                other = solve(chain, budget, name).predicted.time
            except MemschedError:  # its schedule does not fit
                continue
            assert plan.predicted.time <= other * (1 + 1e-12), (name, budget, plan.params)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(6))
def test_rotor_is_never_slower_than_sqrt_or_revolve(seed):
    chain = random_chain(20 + 12 * seed, seed, tmp=True, params=seed % 2 == 0, homogeneous=seed % 3 == 2)
    assert_never_slower_than_sqrt_and_revolve(chain, 10)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3))
def test_rotor_on_merged_stages_is_never_slower_than_sqrt_or_revolve(seed, monkeypatch):
    monkeypatch.setattr(rotor_module, "WORK_LIMIT", 1e6)  # 30-40 groups of 90 stages
    chain = random_chain(90, seed, tmp=True, params=True, homogeneous=seed == 2)
    plan = solve(chain, budgets(chain, 3)[1], "rotor")
    assert 20 < plan.params["stage_groups"] < 90 and not plan.optimal
    assert_never_slower_than_sqrt_and_revolve(chain, 8)


def test_short_chains_keep_the_published_discretisation():
    chain = random_chain(12, 1, tmp=True, params=True)
    for budget in budgets(chain, 5):
        automatic, published = rotor(chain, budget), rotor(chain, budget, slots=rotor_module.DEFAULT_SLOTS)
        assert automatic.params == published.params == {"slots": 500}
        assert automatic.schedule == published.schedule and automatic.optimal == published.optimal


def test_automatic_resolution_follows_the_chain():
    chain = random_chain(200, 7, tmp=True, params=True)
    budget = (minimum_budget(chain) + store_all_peak(chain)) // 2
    bounds, unit, slots, headroom = rotor_module.automatic_resolution(chain, budget)
    assert bounds is None and unit == budget // slots and headroom > 0 and slots + headroom == 500
    plan = solve(chain, budget, "rotor")
    assert plan.params == {"slots": slots, "headroom_slots": headroom} and plan.optimal
    # the levels above the budget's are used: the table at the budget's level alone is slower
    below = rotor(chain, budget, slots=500)
    assert plan.predicted.time < simulate(chain, below.schedule).time
    long = random_chain(2000, 7, tmp=True, params=True)
    bounds, unit, slots, headroom = rotor_module.automatic_resolution(long, store_all_peak(long) // 2)
    groups = len(bounds) - 1
    assert bounds == tuple(segment_bounds(2000, groups)) and 200 < groups < 400
    assert rotor_module.table_bytes(groups, slots + headroom + 1) <= rotor_module.TABLE_LIMIT_BYTES
    assert rotor_module.table_work(groups, slots + headroom + 1) <= rotor_module.WORK_LIMIT


@pytest.fixture(scope="module")
def chain_500():
    chain = random_chain(500, 500, tmp=True, params=True)
    return chain, minimum_budget(chain), store_all_peak(chain)


@pytest.mark.parametrize("fraction", [0.5, 0.1])
def test_rotor_beats_sqrt_on_500_stages(chain_500, fraction):
    """It fell back on the least-memory schedule there, 1.7 times slower than sqrt."""
    chain, low, high = chain_500
    budget = int(low + fraction * (high - low))
    plan = solve(chain, budget, "rotor")
    groups, levels = plan.params["stage_groups"], plan.params["slots"] + plan.params.get("headroom_slots", 0) + 1
    assert groups < 500 and rotor_module.table_work(groups, levels) <= rotor_module.WORK_LIMIT  # its work bounded
    assert plan.predicted.peak_bytes <= budget
    segments_time = fastest_segments(chain, budget)[0]  # sqrt's cut and checkpoint_sequential's, every count
    assert plan.predicted.time < 0.98 * segments_time  # the table's schedule, not the segment check's


def test_limits_are_refused_in_one_line(monkeypatch):
    chain = random_chain(30, 2, tmp=True, params=True)
    budget = (minimum_budget(chain) + store_all_peak(chain)) // 2
    monkeypatch.setattr(rotor_module, "TABLE_LIMIT_BYTES", 2 * 2**20)
    most = rotor_module.TABLE_LIMIT_BYTES // (31 ** 2 * 8) - 1
    assert rotor(chain, budget, slots=most).params == {"slots": most}
    limit = f"above its 2.0 MiB limit .*TABLE_LIMIT_BYTES.*at most {most} slots"
    with pytest.raises(MemschedError, match=limit) as error:
        rotor(chain, budget, slots=2 * most)
    one_line(error)
    assert rotor(chain, budget).params["stage_groups"] == 21  # the automatic choice merges stages to fit it
    long = random_chain(rotor_module.MAX_STAGES + 1, 0)
    with pytest.raises(MemschedError, match=f"{rotor_module.MAX_STAGES + 1} stages is above its limit of "
                                            f"{rotor_module.MAX_STAGES}") as error:
        rotor(long, 10**12)
    one_line(error)
    monkeypatch.setattr(minimum_module, "_least_memory_table", least_memory_not_reached)
    with pytest.raises(MemschedError, match="stages is above its limit"):  # before the least memory (minutes)
        solve(long, 10**12, "rotor")
