"""The hierarchical solver (Rotor's dynamic program choosing among per-stage options) against exhaustive search,
against Rotor, and the chain and plan formats with options."""

import json

import numpy as np
import pytest

from checks import one_line
from oracles.exhaustive import fastest_time, least_peak
from planner.chain import Chain, Stage, StageOption
from planner.errors import MemschedError
from planner.ops import Op
from planner.plan import load_plan, save_plan
from planner.setup import TrainingSetup
from planner.simulate import check_schedule, simulate
from profiles.synthetic import random_chain
from solvers import solve, store_all_peak
from solvers.minimum import least_memory_schedule, minimum_budget


def small_chain(length, seed, **kind):
    """Sizes of a few bytes, so that a one-byte unit makes the discretisation exact."""
    return random_chain(length, seed, scale_bytes=6, options=3, **kind)


def _chains():
    for seed in range(120):
        length = 4 if seed % 6 == 5 else 1 + seed % 3
        yield seed, small_chain(length, seed, tmp=seed % 2 == 1, params=seed % 3 != 0, own_saved=seed % 7 < 3)


@pytest.mark.slow
@pytest.mark.parametrize("seed, chain", list(_chains()), ids=lambda v: str(v) if isinstance(v, int) else "")
def test_hierarchical_and_its_minimum_equal_exhaustive_search(seed, chain):
    low, high = least_peak(chain), store_all_peak(chain)
    assert minimum_budget(chain, options=True) == low
    assert simulate(chain, least_memory_schedule(chain, options=True)).peak_bytes == low
    assert low <= minimum_budget(chain)
    rng = np.random.default_rng(seed)
    for budget in sorted({low, int(rng.integers(low, high + 1)), high}):
        plan = solve(chain, budget, "hierarchical", slots=budget)
        assert plan.predicted.peak_bytes <= budget
        assert plan.predicted.time == pytest.approx(fastest_time(chain, budget), rel=1e-12)
        if budget >= minimum_budget(chain):
            assert plan.predicted.time <= solve(chain, budget, "rotor", slots=budget).predicted.time * (1 + 1e-12)


def _options_help(chain: Chain) -> Chain:
    """``chain`` with, on every stage, an option that keeps only its output and recomputes the rest."""
    stages = tuple(Stage(**{**{f: getattr(s, f) for f in (
        "name", "fwd_time", "bwd_time", "out_bytes", "saved_bytes", "fwd_tmp_bytes", "bwd_tmp_bytes", "param_bytes",
        "nograd_tmp_bytes", "own_saved_bytes")}, "options": (StageOption(
            recompute=(), fwd_time=s.fwd_time, bwd_time=s.bwd_time + s.fwd_time, saved_bytes=s.out_bytes,
            own_saved_bytes=0, fwd_tmp_bytes=s.fwd_tmp_bytes, bwd_tmp_bytes=s.bwd_tmp_bytes + s.saved_bytes),)})
        for s in chain.stages)
    return Chain(name=chain.name, device=chain.device, input_bytes=chain.input_bytes, stages=stages, loss=chain.loss)


@pytest.mark.parametrize("seed", range(4))
def test_hierarchical_is_never_slower_than_rotor_and_goes_lower(seed):
    chain = random_chain(12, seed, tmp=True, params=True, options=4)
    low, high = minimum_budget(chain, options=True), store_all_peak(chain)
    assert low <= minimum_budget(chain)
    for budget in np.linspace(minimum_budget(chain), high, 10).astype(int):
        ours, theirs = solve(chain, int(budget), "hierarchical"), solve(chain, int(budget), "rotor")
        assert ours.predicted.time <= theirs.predicted.time * (1 + 1e-9)
        assert simulate(chain, ours.schedule).peak_bytes <= budget
    assert solve(chain, low, "hierarchical").predicted.peak_bytes <= low


def test_auto_picks_hierarchical_where_options_exist_and_rotor_gets_the_same_schedule_without_them():
    chain = random_chain(10, 1, tmp=True, params=True, options=3)
    budget = (minimum_budget(chain) + store_all_peak(chain)) // 2
    assert solve(chain, budget).solver == "hierarchical"
    plain = chain.without_options()
    assert solve(plain, budget).solver == "rotor"
    assert solve(plain, budget, "hierarchical").schedule == solve(plain, budget, "rotor").schedule


def test_a_stage_whose_saved_tensors_dominate_goes_below_rotors_least_memory():
    """Its forward's peak (what it saves, and its temporaries on top) binds rotor's least memory; an option that
    keeps less lowers it."""
    stage = Stage(name="block", fwd_time=1.0, bwd_time=2.0, out_bytes=10, saved_bytes=100, fwd_tmp_bytes=200)
    chain = _options_help(Chain(name="c", device="d", input_bytes=10, stages=(stage,) * 3,
                                loss=random_chain(1, 0).loss))
    assert minimum_budget(chain, options=True) < minimum_budget(chain.without_options())
    plan = solve(chain, minimum_budget(chain, options=True), "hierarchical")
    assert any(op.option is not None for op in plan.schedule)
    with pytest.raises(MemschedError, match="below the minimum feasible"):
        solve(chain, minimum_budget(chain, options=True), "rotor")


def test_48_identical_blocks_are_planned_no_slower_than_rotor():
    """(Its seconds, once asserted here below 5, are bench/chain_solvers.py's: a loaded machine is no failure.)"""
    seed = next(seed for seed in range(1000)  # a block with six options, as a profiled transformer block has
                if len(random_chain(1, seed, tmp=True, params=True, options=6).stages[0].options) == 6)
    one = random_chain(1, seed, tmp=True, params=True, options=6).stages[0]
    base = random_chain(48, 7, tmp=True, params=True)
    chain = Chain(name="blocks", device="d", input_bytes=base.input_bytes, stages=(one,) * 48, loss=base.loss)
    budget = (minimum_budget(chain) + store_all_peak(chain)) // 3
    plan = solve(chain, budget, "hierarchical")
    assert plan.predicted.time <= solve(chain, budget, "rotor").predicted.time * (1 + 1e-9)


def test_options_round_trip_and_old_chains_keep_their_fingerprints(tmp_path):
    chain = random_chain(6, 3, tmp=True, params=True, options=3)
    assert Chain.from_dict(json.loads(json.dumps(chain.to_dict()))) == chain
    plain = random_chain(6, 3, tmp=True, params=True)
    assert "options" not in json.dumps(plain.to_dict())
    assert chain.without_options().fingerprint() == plain.fingerprint() != chain.fingerprint()
    plan = solve(chain, (minimum_budget(chain, options=True) + store_all_peak(chain)) // 3, "hierarchical")
    save_plan(plan, tmp_path / "plan.json")
    assert load_plan(tmp_path / "plan.json").schedule == plan.schedule
    assert "option" in (tmp_path / "plan.json").read_text() or all(op.option is None for op in plan.schedule)


@pytest.mark.parametrize("change, message", [
    (lambda o: {**o, "recompute": [3, 1]}, "recompute must be a list of distinct operation positions"),
    (lambda o: {**o, "saved_bytes": 0}, "is below the stage's out_bytes"),
    (lambda o: {**o, "own_saved_bytes": o["saved_bytes"] + 1}, "own_saved_bytes"),
    (lambda o: {**o, "colour": 1}, "colour"),
])
def test_a_bad_option_is_refused_in_one_line(change, message):
    chain = _options_help(random_chain(2, 0))
    data = chain.to_dict()
    data["stages"][1]["options"][0] = change(data["stages"][1]["options"][0])
    with pytest.raises(MemschedError, match=message) as error:
        Chain.from_dict(data)
    one_line(error, "stages[1]")


def test_an_option_the_stage_lacks_or_on_another_op_is_refused():
    chain = _options_help(random_chain(2, 0))
    schedule = [Op("F_all", 0, option=1), Op("F_all", 1), Op("Loss"), Op("B", 1), Op("B", 0)]
    with pytest.raises(MemschedError, match="option 1 is not one"):
        simulate(chain, schedule)
    check_schedule(schedule, 2)  # without the chain, any option index may be the stage's
    with pytest.raises(MemschedError, match="only F_all runs with an option"):
        check_schedule([Op("F_ck", 0, option=0), Op("F_all", 1), Op("Loss"), Op("B", 1), Op("F_all", 0),
                        Op("B", 0)], 2)


def test_the_schedule_and_the_chain_table_show_the_options():
    from planner.render import chain_table, compact_schedule

    chain = _options_help(random_chain(3, 0))
    schedule = [Op("F_all", 0, option=0), Op("F_all", 1, option=0), Op("F_all", 2), Op("Loss"), Op("B", 2),
                Op("B", 1), Op("B", 0)]
    assert compact_schedule(schedule).startswith("F_all[0] 0-1, F_all 2, Loss")
    assert chain_table(chain)[-1].startswith("stage options: 3 on 3 stages;")


def test_auto_with_host_weights_keeps_stages_whole():
    """Stage options and transfers do not run together: auto solves a host-weight plan with rotor."""
    from planner.transfer import Transfer

    chain = random_chain(6, 1, tmp=True, params=True, options=3)
    chain = Chain(name=chain.name, device=chain.device, input_bytes=chain.input_bytes, stages=chain.stages,
                  loss=chain.loss, transfer=Transfer(1e9, 1e-5))
    plan = solve(chain, (minimum_budget(chain) + store_all_peak(chain)) // 2, "auto", TrainingSetup(host_weights="all"))
    assert plan.solver == "rotor" and not any(op.option is not None for op in plan.schedule)


@pytest.mark.parametrize("name", ["gpt-tiny", "resnet-tiny"])
def test_hierarchical_beats_rotor_on_the_models_profiles(name):
    """Issue 16's figures on the models' profiles estimated on fake tensors (sizes exact, seconds from FLOPs:
    the same on every run): at 10 budgets from rotor's least feasible to the store-all peak, hierarchical's
    predicted overhead is at most rotor's and at least 10% lower on average over 30-70% of the range, and its
    least feasible budget is at most rotor's (measured: gpt-tiny 0.027 against 0.135, 9.47 against 10.03 MiB;
    resnet-tiny 0.066 against 0.149, 12.44 against 14.44 MiB)."""
    import statistics

    from profiles.chain_profiler import profile_chain
    from profiles.fake_build import build_fake
    from profiles.zoo import MODELS

    _, model = build_fake(lambda: MODELS[name]())
    chain = profile_chain(model.stages, model.example_inputs, loss_fn=model.loss_fn, estimate=True, options=4)
    low, high = minimum_budget(chain), store_all_peak(chain)
    middle = []
    for k in range(10):
        budget = low + (high - low) * k // 9
        rotor, hierarchical = (solve(chain, budget, solver).predicted.overhead for solver in ("rotor", "hierarchical"))
        assert hierarchical <= rotor + 1e-12, (name, budget)
        if 3 <= k <= 6:
            middle.append((rotor, hierarchical))
    rotor_mean, hierarchical_mean = (statistics.mean(pair[j] for pair in middle) for j in (0, 1))
    print(f"{name}: mean overhead over 30-70%: rotor {rotor_mean:.3f}, hierarchical {hierarchical_mean:.3f}")
    assert hierarchical_mean <= 0.9 * rotor_mean
    assert minimum_budget(chain, options=True) <= low
