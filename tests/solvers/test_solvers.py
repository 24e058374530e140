"""Chain solvers checked against the published optimum, against each other and against exhaustive search."""

import json
from math import comb

import numpy as np
import pytest

from checks import one_line
from oracles.exhaustive import fastest_time, least_peak
from paths import FIXTURES
from planner import ChainSimulator, MemschedError, simulate
from profiles.synthetic import random_chain
from solvers import SOLVERS, choose_solver, solve, store_all_peak
from solvers.minimum import least_memory_schedule, minimum_budget
from solvers.revolve import revolve_schedule
from solvers.rotor import compute_table, discretise, rotor
from solvers.rotor_model import rotor_arrays
from solvers.rotor_plain import compute_table_plain
from solvers.sqrt import segments_schedule

REFERENCE = FIXTURES / "rotor_L20.json"  # a chain and the published Rotor's optimum on it


def small_chain(length, seed, **kind):
    """A chain with sizes of a few bytes, so that a one-byte unit makes Rotor's discretisation exact."""
    return random_chain(length, seed, scale_bytes=6, **kind)


def exact_rotor_time(chain, budget):
    """Rotor's optimum with a one-byte unit (slots = budget): no rounding at all."""
    plan = solve(chain, budget, "rotor", slots=budget)
    assert plan.params == {"slots": budget}
    return plan.predicted.time


@pytest.fixture(scope="module")
def reference():
    return json.loads(REFERENCE.read_text())


def test_rotor_equals_the_published_optimum(reference):
    from planner import Chain

    chain = Chain.from_dict(reference["chain"])
    plan = solve(chain, reference["budget_bytes"], "rotor", slots=reference["slots"])
    assert plan.predicted.time == pytest.approx(reference["expected_optimal_time"], rel=1e-12)
    assert plan.predicted.baseline_time == pytest.approx(reference["store_all_time"], rel=1e-12)
    assert plan.predicted.peak_bytes <= reference["budget_bytes"]
    assert plan.optimal


@pytest.mark.parametrize("seed", range(12))
def test_compiled_table_equals_plain_python_table(seed):
    chain = random_chain(2 + seed % 7, seed, tmp=seed % 2 == 0, params=seed % 3 != 0, own_saved=seed % 4 < 2)
    budget = (minimum_budget(chain) + store_all_peak(chain)) // 2
    _, arrays, top = discretise(chain, budget, 60)
    fast = compute_table(arrays, top)
    plain = np.array(compute_table_plain(arrays, top))
    upper = np.triu_indices(chain.length + 1)
    assert np.array_equal(fast[upper], plain[upper])


def _chains_for_exhaustive_search():
    for seed in range(300):
        length = 5 if seed % 5 == 4 else 1 + seed % 4
        yield seed, small_chain(length, seed, tmp=seed % 2 == 1, params=seed % 3 != 0, own_saved=seed % 7 < 3)


@pytest.mark.slow
@pytest.mark.parametrize("seed, chain", list(_chains_for_exhaustive_search()),
                         ids=lambda v: str(v) if isinstance(v, int) else "")
def test_rotor_and_minimum_equal_exhaustive_search(seed, chain):
    low, high = least_peak(chain), store_all_peak(chain)
    assert minimum_budget(chain) == low
    assert simulate(chain, least_memory_schedule(chain)).peak_bytes == low
    rng = np.random.default_rng(seed)
    budgets = ({low, int(rng.integers(low, high + 1))} if chain.length == 5
               else {low, int(rng.integers(low, high + 1)), high})
    for budget in sorted(budgets):
        plan = solve(chain, budget, "rotor", slots=budget)
        assert plan.predicted.peak_bytes <= budget
        assert plan.predicted.time == pytest.approx(fastest_time(chain, budget), rel=1e-12)


@pytest.mark.parametrize("seed", range(8))
def test_rotor_time_never_increases_with_budget(seed):
    chain = small_chain(6, seed, tmp=True, params=seed % 2 == 0)
    low, high = minimum_budget(chain), store_all_peak(chain)
    times = [exact_rotor_time(chain, budget) for budget in range(low, high + 1)]
    assert all(later <= earlier * (1 + 1e-12) for earlier, later in zip(times, times[1:]))
    assert times[-1] == pytest.approx(chain.compute_time, rel=1e-12)


@pytest.mark.parametrize("seed", range(10))
def test_rotor_overhead_is_zero_at_the_store_all_peak(seed):
    chain = random_chain(5 + 3 * seed, seed, tmp=seed % 2 == 0, params=True)
    plan = solve(chain, store_all_peak(chain), "rotor")
    assert plan.predicted.overhead == 0.0


@pytest.mark.parametrize("seed", range(6))
def test_rotor_never_slower_than_revolve_on_homogeneous_chains(seed):
    chain = small_chain(4 + 2 * seed, seed, homogeneous=True, tmp=seed % 2 == 0)
    simulator = ChainSimulator(chain)
    for snapshots in range(1, chain.length + 1):
        schedule = revolve_schedule(chain.length, snapshots)
        result = simulator.run(schedule)  # a valid schedule: the simulator accepts it
        assert exact_rotor_time(chain, result.peak_bytes) <= result.time + 1e-12
    for budget in np.linspace(minimum_budget(chain), store_all_peak(chain), 6).astype(int):
        try:
            revolve_plan = solve(chain, int(budget), "revolve")
        except MemschedError:
            continue
        assert exact_rotor_time(chain, int(budget)) <= revolve_plan.predicted.time + 1e-12


def _closed_form_advances(length, snapshots):
    """Griewank's t(l, s) = r·l − β(s+1, r−1), β(s, r) = C(s+r, s), β(s, r−1) < l <= β(s, r)."""
    def beta(s, r):
        return comb(s + r, s) if r >= 0 else 0

    r = 0
    while not beta(snapshots, r - 1) < length <= beta(snapshots, r):
        r += 1
    return r * length - beta(snapshots + 1, r - 1)


@pytest.mark.slow
def test_revolve_matches_the_closed_form_for_every_length_and_snapshot_count():
    for snapshots in range(1, 21):
        # the longest first: revolve's table grows to each larger size asked for, rebuilt whole (once per count here,
        # not once per length); 2,400 schedules of up to 120 stages
        for length in range(120, 0, -1):
            schedule = revolve_schedule(length, snapshots)
            advances = sum(op.kind in ("F_ck", "F_none") for op in schedule)
            assert advances == _closed_form_advances(length, snapshots), (length, snapshots)
            assert sum(op.kind == "F_all" for op in schedule) == length


def test_revolve_schedules_run_in_the_simulator_and_use_more_memory_with_more_snapshots():
    chain = random_chain(30, 5, homogeneous=True)
    simulator = ChainSimulator(chain)
    peaks = [simulator.run(revolve_schedule(30, s)).peak_bytes for s in range(1, 31)]
    assert peaks == sorted(peaks)


@pytest.mark.parametrize("seed", range(6))
def test_sqrt_picks_the_fastest_segment_count_that_fits(seed):
    chain = random_chain(9 + seed, seed, tmp=True, params=True)
    simulator = ChainSimulator(chain)
    results = [simulator.run(segments_schedule(chain.length, k)) for k in range(1, chain.length + 1)]
    budget = int(np.median([r.peak_bytes for r in results]))
    plan = solve(chain, budget, "sqrt")
    fitting = [r.time for r in results if r.peak_bytes <= budget]
    assert plan.predicted.time == pytest.approx(min(fitting))
    assert segments_schedule(chain.length, 1) == SOLVERS["store_all"](chain, budget).schedule


@pytest.mark.parametrize("seed", range(10))
def test_every_solver_fits_its_budget_or_says_why(seed):
    chain = random_chain(6 + 2 * seed, seed, tmp=seed % 2 == 0, params=seed % 3 == 0)
    low, high = minimum_budget(chain), store_all_peak(chain)
    for budget in np.linspace(low, high, 5).astype(int):
        for name in SOLVERS:
            try:
                plan = solve(chain, int(budget), name)
            except MemschedError as error:
                assert name != "rotor", error  # rotor always has a schedule above the minimum
                one_line(error)
                continue
            replay = simulate(chain, plan)
            assert replay.peak_bytes == plan.predicted.peak_bytes <= budget
            assert replay.time == pytest.approx(plan.predicted.time)
        rotor_time = solve(chain, int(budget), "rotor").predicted.time
        for name in ("sqrt", "revolve", "recompute_all"):
            try:
                other = solve(chain, int(budget), name).predicted.time
            except MemschedError:
                continue
            assert rotor_time <= other * (1 + 1e-12) or budget == low, (name, budget)


def test_budget_below_the_minimum_states_the_minimum():
    chain = random_chain(10, 1)
    minimum = minimum_budget(chain)
    with pytest.raises(MemschedError, match=f"below the minimum feasible .*{minimum} bytes"):
        solve(chain, minimum - 1)
    assert solve(chain, minimum).predicted.peak_bytes == minimum


def test_auto_stores_everything_when_it_fits_and_uses_rotor_otherwise():
    chain = random_chain(10, 2)
    peak = store_all_peak(chain)
    assert choose_solver(chain, peak) == "store_all" and solve(chain, peak).solver == "store_all"
    assert solve(chain, peak - 1).solver == "rotor"


def test_unknown_solver_and_parameter_are_clear_errors():
    chain = random_chain(4, 0)
    with pytest.raises(MemschedError, match="unknown solver 'chen'; choose one of auto, store_all"):
        solve(chain, store_all_peak(chain), "chen")
    with pytest.raises(MemschedError, match="solver 'rotor' takes no parameter 'segments'"):
        solve(chain, store_all_peak(chain), "rotor", segments=3)


def test_discretised_rotor_fits_in_bytes_and_nearly_matches_the_exact_optimum():
    chain = random_chain(12, 4, tmp=True, params=True)
    budget = (minimum_budget(chain) + store_all_peak(chain)) // 2
    coarse = rotor(chain, budget, slots=200)
    result = simulate(chain, coarse.schedule)
    assert result.peak_bytes <= budget
    _, arrays, top = discretise(chain, budget, 200)
    assert result.time == pytest.approx(compute_table(arrays, top)[0, chain.length, top], rel=1e-12)
    assert rotor_arrays(chain, 1).x[0] == chain.input_bytes


@pytest.mark.parametrize("seed", [27, 28, 29, 3, 10])
def test_rotor_is_never_slower_than_any_segment_schedule_that_fits(seed):
    """Rounding to 500 slots can hide a schedule whose peak is within a few units of the budget (on these
    homogeneous chains the table alone is up to 2% slower than checkpoint_sequential's cut at its own peak);
    the segment schedules (Chen's and checkpoint_sequential's cuts) are checked in bytes, so none beats Rotor."""
    from solvers.sqrt import checkpoint_sequential_bounds, segments_schedule

    chain = random_chain(8 + seed % 20, seed, homogeneous=True, tmp=seed % 3 == 0, params=seed % 2 == 0)
    for count in range(2, chain.length + 1):
        schedule = segments_schedule(chain.length, count, checkpoint_sequential_bounds(chain.length, count))
        exact = simulate(chain, schedule)  # its peak, to the byte, as the budget: the hardest case for rounding
        plan = solve(chain, exact.peak_bytes, "rotor")
        assert plan.predicted.time <= exact.time * (1 + 1e-12)
        assert plan.predicted.peak_bytes <= exact.peak_bytes
