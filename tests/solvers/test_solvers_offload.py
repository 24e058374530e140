"""The offload solvers (solvers/offload/): exact against an exhaustive search, greedy, hand policy, registry."""

import pytest

from checks import one_line
from oracles.offload_brute import all_results, best_time
from planner.errors import MemschedError
from planner.ops import TRANSFER_OPS
from planner.plan import Plan
from planner.simulate import simulate
from planner.transfer import Transfer
from profiles.synthetic import random_chain
from solvers import solve, store_all_peak
from solvers.extremes import store_all_schedule
from solvers.minimum import minimum_budget
from solvers.offload import offload, offload_all_policy, offload_greedy
from solvers.offload.exact import exact_windows
from solvers.offload.greedy import greedy_windows
from solvers.offload.problem import build_problem, least_offload_peak, schedule_with_windows
from solvers.rotor import rotor

FREE = Transfer(1e18, 1e18, 0.0)  # copies take no time: offloading is free


def channel(chain, factor):
    """A channel on which copying one stage's saved bytes (the chain's mean) takes ``factor`` forward times."""
    if factor is None:
        return FREE
    saved = sum(s.saved_bytes for s in chain.stages) / chain.length
    forward = sum(s.fwd_time for s in chain.stages) / chain.length
    bandwidth = saved / (factor * forward)
    return Transfer(bandwidth, bandwidth, 1e-5)


def moves(schedule) -> bool:
    return any(op.kind in TRANSFER_OPS for op in schedule)


def own_rotor(chain, factor):
    return rotor(chain, int(minimum_budget(chain) * factor)).schedule


# (chain, compute schedule, channels as copy-time / forward-time factors); None: a free channel
BRUTE_CASES = [
    ("L3", random_chain(3, 0), None, (None, 0.5, 2.0, 1000.0)),
    ("L3-tmp-params-own", random_chain(3, 3, tmp=True, params=True, own_saved=True), None, (0.5, 20.0)),
    ("L3-own-rotor", random_chain(3, 0, own_saved=True), 1.05, (None, 2.0)),
    ("L4", random_chain(4, 0), None, (2.0, 20.0)),
    ("L4-own-rotor", random_chain(4, 5, own_saved=True), 1.1, (0.5,)),
]


def _budgets(results, count=5):
    peaks = sorted({peak for peak, _, _ in results})
    if len(peaks) <= count:
        return peaks
    return sorted({peaks[round(i * (len(peaks) - 1) / (count - 1))] for i in range(count)})


@pytest.mark.slow
@pytest.mark.parametrize("name, chain, rotor_factor, factors", BRUTE_CASES, ids=[c[0] for c in BRUTE_CASES])
def test_exact_equals_the_exhaustive_optimum(name, chain, rotor_factor, factors):
    ops = store_all_schedule(chain.length) if rotor_factor is None else own_rotor(chain, rotor_factor)
    for factor in factors:
        transfer = channel(chain, factor)
        results = all_results(chain, ops, transfer)
        plain = simulate(chain, ops)
        assert results[0][:2] == (plain.peak_bytes, plain.time)
        least = min(peak for peak, _, _ in results)
        assert least_offload_peak(build_problem(chain, ops, transfer)) == least
        for budget in _budgets(results):
            expected = best_time(results, budget)
            solution = offload(chain, budget, transfer, schedule=ops, method="exact")
            result = simulate(chain, solution.schedule, transfer)
            assert result.peak_bytes <= budget
            assert solution.optimal and solution.gap == 0.0
            assert result.time <= solution.model_time + 1e-9
            assert result.time == pytest.approx(expected, abs=1e-7), (name, factor, budget)
            if factor is None:  # a free channel: no stall at all
                assert result.time == pytest.approx(plain.time, abs=1e-7)
            problem = build_problem(chain, ops, transfer)  # the CP-SAT model itself, with and without the hint
            for hint in (None, greedy_windows(problem, budget)):
                windows, optimal, _, model_time, _ = exact_windows(problem, budget, 30.0, hint=hint)
                model_plan = simulate(chain, schedule_with_windows(problem, windows), transfer)
                assert optimal and model_plan.peak_bytes <= budget and model_plan.time <= model_time + 1e-9
                assert model_plan.time == pytest.approx(expected, abs=1e-7), (name, factor, budget, hint)
            for other in (offload_greedy(chain, budget, transfer, schedule=ops).schedule if budget >= least else None,
                          offload_all_policy(chain, budget, transfer, schedule=ops).schedule):
                if other is not None:
                    judged = simulate(chain, other, transfer)
                    if judged.peak_bytes <= budget:
                        assert judged.time >= expected - 1e-7
        with pytest.raises(MemschedError, match="infeasible") as info:
            offload(chain, least - 1, transfer, schedule=ops)
        one_line(info, f"({least} bytes)")


def test_zero_bandwidth_keeps_the_compute_schedule_or_refuses_in_one_line():
    chain = random_chain(6, 1)
    peak = store_all_peak(chain)
    none = Transfer(0.0, 0.0)
    solution = offload(chain, peak, none)
    assert solution.schedule == store_all_schedule(6) and solution.optimal
    plan = solve(chain, peak, "offload", transfer=none)
    assert not plan.moves_data and plan.predicted.time == pytest.approx(chain.compute_time)
    for solver in ("offload", "offload_greedy"):
        with pytest.raises(MemschedError, match="cannot move data both ways") as info:
            solve(chain, peak - 1, solver, transfer=none)
        one_line(info)
    one_way = offload(chain, peak, Transfer(1e9, 0.0))
    assert not moves(one_way.schedule)


@pytest.mark.parametrize("seed", range(4))
def test_every_plan_fits_the_simulator(seed):
    chain = random_chain(8, seed, tmp=seed % 2 == 0, params=seed >= 2, own_saved=seed % 2 == 1)
    peak = store_all_peak(chain)
    transfer = channel(chain, [0.5, 1.0, 2.0, 4.0][seed])
    least = least_offload_peak(build_problem(chain, store_all_schedule(8), transfer))
    for fraction in (0.9, 0.5, 0.0):
        budget = int(least + fraction * (peak - least))
        for solver, params in (("offload", {"time_limit": 10}), ("offload_greedy", {})):
            plan = solve(chain, budget, solver, transfer=transfer, **params)
            assert plan.predicted.peak_bytes <= budget and plan.transfer == transfer
            again = simulate(chain, plan)
            assert (again.peak_bytes, again.time) == (plan.predicted.peak_bytes, plan.predicted.time)
            assert Plan.from_dict(plan.to_dict()) == plan
        exact = offload(chain, budget, transfer, time_limit=10)
        assert simulate(chain, exact.schedule, transfer).time <= exact.model_time + 1e-9
        assert exact.optimal == exact.stats["status"].startswith("OPTIMAL")


def test_offload_goes_below_store_all_and_below_rotors_minimum():
    chain = random_chain(3, 0, own_saved=True)
    minimum = minimum_budget(chain)
    transfer = channel(chain, 0.5)
    with pytest.raises(MemschedError, match="below the minimum feasible"):
        solve(chain, minimum - 1, "rotor")
    plan = solve(chain, minimum - 1, "offload", transfer=transfer, schedule="rotor",
                 schedule_budget=int(minimum * 1.05))
    assert plan.moves_data and plan.predicted.peak_bytes < minimum
    assert plan.params["schedule"] == "rotor"
    big = random_chain(12, 3)
    budget = int(0.6 * store_all_peak(big))
    plan = solve(big, budget, "offload", transfer=channel(big, 0.5), time_limit=10)
    assert plan.moves_data and plan.predicted.peak_bytes <= budget
    assert plan.predicted.overhead < solve(big, budget, "rotor").predicted.overhead


@pytest.mark.parametrize("seed", range(3))
def test_greedy_and_hand_policy_never_beat_the_exact_optimum(seed):
    chain = random_chain(6, seed, own_saved=True)
    peak = store_all_peak(chain)
    transfer = channel(chain, [0.5, 1.0, 2.0][seed])
    for fraction in (0.8, 0.6):
        budget = int(fraction * peak)
        try:
            exact = offload(chain, budget, transfer, time_limit=20)
        except MemschedError:
            continue
        assert exact.optimal
        best = simulate(chain, exact.schedule, transfer).time
        greedy = simulate(chain, offload_greedy(chain, budget, transfer).schedule, transfer)
        assert greedy.peak_bytes <= budget and greedy.time >= best - 1e-7
        hand = simulate(chain, offload_all_policy(chain, budget, transfer).schedule, transfer)
        if hand.peak_bytes <= budget:
            assert hand.time >= best - 1e-7


def test_hand_policy_offloads_every_saved_activation():
    chain = random_chain(5, 2)
    solution = offload_all_policy(chain, None, channel(chain, 1.0))
    offloaded = {op.stage for op in solution.schedule if op.kind == "Offload"}
    assert offloaded == {0, 1, 2, 3}  # the last is read by the loss, then by its backward: never away
    assert all(op.what == "saved" for op in solution.schedule if op.kind in TRANSFER_OPS)
    result = simulate(chain, solution.schedule, channel(chain, 1.0))
    assert result.peak_bytes < store_all_peak(chain)


def test_greedy_for_long_chains_and_a_time_limit_without_solution(monkeypatch):
    import solvers.offload as module

    chain = random_chain(30, 4)
    budget = int(0.5 * store_all_peak(chain))
    transfer = channel(chain, 1.0)
    monkeypatch.setattr(module, "EXACT_UP_TO", 10)
    solution = offload(chain, budget, transfer)
    assert solution.params["method"] == "greedy" and not solution.optimal and solution.gap is None
    assert simulate(chain, solution.schedule, transfer).peak_bytes <= budget
    quick = offload(chain, budget, transfer, method="exact", time_limit=0.001)
    assert simulate(chain, quick.schedule, transfer).peak_bytes <= budget
    assert quick.optimal == (quick.gap == 0.0)


@pytest.mark.parametrize("params, message", [
    ({"schedule": "revolve"}, "unknown compute schedule 'revolve'"),
    ({"time_limit": -1}, "time_limit must be a positive number"),
    ({"time_limit": 0}, "time_limit must be a positive number"),
    ({"schedule": "store_all", "schedule_budget": 10}, "schedule_budget is for the rotor"),
    ({"schedule": "rotor", "schedule_budget": -5}, "schedule_budget must be a number of bytes"),
    ({"schedule": store_all_schedule(3)}, r"schedule\[3\] \(Loss\): a_4 is not in memory"),
    ({"slots": 10}, "takes no parameter 'slots'"),
])
def test_bad_inputs_are_one_line(params, message):
    chain = random_chain(4, 0)
    with pytest.raises(MemschedError, match=message) as info:
        solve(chain, store_all_peak(chain) // 2, "offload", transfer=FREE, **params)
    one_line(info)


def test_a_chain_without_channel_is_refused_in_one_line():
    chain = random_chain(4, 0)
    with pytest.raises(MemschedError, match="no copy channel") as info:
        solve(chain, store_all_peak(chain) // 2, "offload")
    one_line(info)
    with pytest.raises(MemschedError, match="unknown method"):
        offload(chain, 10**9, FREE, method="fast")


def test_other_solvers_are_unchanged():
    chain = random_chain(10, 2)
    budget = int(0.5 * store_all_peak(chain))
    plan = solve(chain, budget, "rotor")
    assert plan.transfer is None and plan.gap is None and not plan.moves_data
    assert "transfer" not in plan.to_dict() and "gap" not in plan.to_dict()["solver"]
