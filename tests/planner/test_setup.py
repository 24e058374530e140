"""The training setup as one value (planner/setup/): its fields, the one table of combinations that do not mix,
the one lowering, and one least figure for one setup wherever it is quoted (floors, budgets, refusals)."""

import dataclasses
import itertools
import json

import pytest

import solvers
from checks import one_line
from paths import TESTS
from planner.accumulate import accumulating_chain, held_gradient_bytes
from planner.chain import load_chain
from planner.errors import MemschedError
from planner.plan import Plan
from planner.setup import FLAGS, NEEDS, RULES, Run, TrainingSetup, check, lower
from planner.setup.rules import _PRESENT
from planner.simulate import simulate
from planner.transfer import Transfer
from planner.updates import updated_chain
from solvers.budgets import least_budget, least_device_memory, solve_for_budget, whole_step_floors

CHAIN = load_chain(str(TESTS / "golden" / "chain.json"))
LAID_OUT = load_chain(str(TESTS / "golden" / "chain-layout.json"))  # with its parameters' rows: ZeRO over ranks
CHANNEL = Transfer(d2h_bandwidth=1e9, h2d_bandwidth=1e9)

# For each feature, a setup and a run that have it and nothing else.
HAVING = {
    "accumulate": (TrainingSetup(accumulate=4), Run()),
    "update": (TrainingSetup(update="in-backward"), Run()),
    "transfers": (TrainingSetup(host_weights="all"), Run(transfers=True)),
    "compile": (TrainingSetup(), Run(compile=True)),
    "pipeline": (TrainingSetup(), Run(pipeline=True)),
    "sharded": (TrainingSetup(), Run(sharded=True)),
    "graph": (TrainingSetup(), Run(graph=True)),
    "options": (TrainingSetup(), Run(options=True)),
    "clipping": (TrainingSetup(), Run(clipping=True)),
    "target": (TrainingSetup(), Run(target=True)),
    "autocast": (TrainingSetup(), Run(autocast=True)),
    "batch_search": (TrainingSetup(), Run(batch_search=True, target=True)),  # (with what it needs)
    "global_batch": (TrainingSetup(), Run(global_batch=True)),
}
NEEDED = {need.feature: need.needed for need in NEEDS}


def _both(first: str, second: str) -> tuple:
    """A setup and a run having the features ``first`` and ``second``."""
    (a, run_a), (b, run_b) = HAVING[first], HAVING[second]
    fields = {name: getattr(b, name) for name in ("update", "accumulate", "host_weights")
              if getattr(b, name) != getattr(TrainingSetup(), name)}
    runs = {name: getattr(run_a, name) or getattr(run_b, name) for name in Run.__dataclass_fields__}
    return dataclasses.replace(a, **fields), Run(**runs)


def test_every_feature_is_spelled_by_both_interfaces_and_has_a_witness():
    assert set(FLAGS["cli"]) == set(FLAGS["fit"]) == set(_PRESENT) == set(HAVING)
    for feature, (setup, run) in HAVING.items():
        present = {name for name, present in _PRESENT.items() if present(setup, run)}
        assert present == {feature, *([NEEDED[feature]] if feature in NEEDED else [])}


@pytest.mark.parametrize("need", NEEDS, ids=lambda need: f"{need.feature}-{need.needed}")
@pytest.mark.parametrize("interface", ["cli", "fit"])
def test_a_feature_without_what_it_needs_is_refused_in_one_line_naming_both(need, interface):
    setup, run = HAVING[need.feature]
    with pytest.raises(MemschedError) as caught:
        check(setup, dataclasses.replace(run, **{need.needed: False}), interface)
    feature, needed = (FLAGS[interface][name] for name in (need.feature, need.needed))
    assert one_line(caught, f"give {needed}", need.why).startswith(f"{feature} needs {needed}")
    check(setup, run)  # with it, fine


def test_each_combination_is_ruled_once():
    pairs = [frozenset((rule.first, rule.second)) for rule in RULES]
    assert len(pairs) == len(set(pairs)) and all(len(pair) == 2 for pair in pairs)


@pytest.mark.parametrize("rule", RULES, ids=lambda rule: f"{rule.first}-{rule.second}")
@pytest.mark.parametrize("interface", ["cli", "fit"])
def test_a_rule_refuses_its_pair_in_one_line_naming_both(rule, interface):
    setup, run = _both(rule.first, rule.second)
    with pytest.raises(MemschedError) as caught:
        check(setup, run, interface)
    first, second = (FLAGS[interface][f].format(accumulate=4, update="in-backward") for f in (rule.first, rule.second))
    assert one_line(caught, second, rule.why).startswith(first)
    for alone in (rule.first, rule.second):
        check(*HAVING[alone])  # each feature alone is fine


def test_pairs_no_rule_names_are_allowed():
    ruled = {frozenset((rule.first, rule.second)) for rule in RULES}
    with_needs = {feature: {feature, NEEDED.get(feature, feature)} for feature in HAVING}
    for first, second in itertools.combinations(HAVING, 2):
        if not any(frozenset((a, b)) in ruled for a in with_needs[first] for b in with_needs[second]):
            check(*_both(first, second))


def test_the_setup_fields_are_checked_in_one_line():
    for fields, wanted in (({"accumulate": 0}, "accumulate"), ({"host_stages": (1,)}, "on-host"),
                           ({"update": "on-host", "host_stages": "x"}, "host_stages"),
                           ({"host_weights": "1,x"}, "weights"), ({"host_weights": [-1]}, "weights")):
        with pytest.raises(MemschedError, match=wanted) as caught:
            TrainingSetup(**fields)
        one_line(caught)
    assert TrainingSetup(host_weights="3, 1,3").host_weights == (1, 3)
    assert TrainingSetup(update="on-host", host_stages=[4, 2]).host_stages == (2, 4)


def test_lower_applies_the_update_then_accumulation():
    hosted = TrainingSetup(update="on-host", host_stages=(1, 2))
    assert lower(CHAIN, hosted, CHANNEL).chain == updated_chain(CHAIN, "on-host", CHANNEL, (1, 2))
    assert lower(CHAIN, TrainingSetup()).chain == CHAIN and lower(CHAIN, TrainingSetup()).held_bytes == 0
    accumulating = lower(CHAIN, TrainingSetup(accumulate=3))
    assert accumulating.chain == accumulating_chain(CHAIN) and accumulating.held_bytes == held_gradient_bytes(CHAIN)


def test_solve_does_not_recurse(monkeypatch):
    original, calls = solvers.solve, []

    def counted(*args, **kwargs):
        calls.append(args[2] if len(args) > 2 else kwargs.get("solver"))
        return original(*args, **kwargs)

    monkeypatch.setattr(solvers, "solve", counted)
    budget = solvers.store_all_peak(CHAIN) * 8 // 10
    for setup in (TrainingSetup(), TrainingSetup(update="in-backward"), TrainingSetup(accumulate=2),
                  TrainingSetup(update="on-host", host_stages=(1,)), TrainingSetup(host_weights=(1, 3))):
        calls.clear()
        solvers.solve(CHAIN, budget * (2 if setup.accumulate > 1 else 1), "auto", setup, transfer=CHANNEL)
        assert len(calls) == 1, setup


def test_apply_plan_checks_the_rules_once_with_the_plans_setup(monkeypatch):
    torch = pytest.importorskip("torch")
    import planner.execute.chain as executor

    original, checked = executor.check, []

    def counted(setup, *args, **kwargs):
        checked.append(setup)
        return original(setup, *args, **kwargs)

    monkeypatch.setattr(executor, "check", counted)
    stages = [torch.nn.Linear(4, 4) for _ in range(CHAIN.length)]
    chain = dataclasses.replace(CHAIN, measured_on=None)  # these stages are not the ones it was measured on
    budget = solvers.store_all_peak(chain) * 8 // 10
    for setup in (TrainingSetup(), TrainingSetup(update="in-backward"), TrainingSetup(accumulate=2),
                  TrainingSetup(update="on-host", host_stages=(1,))):
        plan = solvers.solve(chain, budget * setup.accumulate, "rotor", setup, transfer=CHANNEL)
        checked.clear()
        executor.apply_plan(stages, plan)
        assert checked == [plan.setup], setup


SETUPS = {"bf16": TrainingSetup(precision="bf16"), "fp32": TrainingSetup(), "zero2": TrainingSetup(zero=2, dp=2),
          "zero3": TrainingSetup(zero=3, dp=2),
          "fp16-zero1": TrainingSetup(optimizer="sgd", precision="fp16", zero=1, dp=4)}


@pytest.mark.parametrize("name, update", [(name, update) for name in SETUPS for update in ("after", "in-backward")
                                          if not (SETUPS[name].sharded and update != "after")])  # (rules.py)
def test_one_least_figure_for_one_setup(name, update):
    """The floor ``memory`` prints is the least device memory ``solve --budget auto`` accepts, and the refusal one
    byte below it quotes that figure (on gpt-tiny in bf16 they were 20.7 MiB, 21.9 MiB and 10.0 MiB)."""
    setup, chain = dataclasses.replace(SETUPS[name], update=update), LAID_OUT if SETUPS[name].sharded else CHAIN
    floor = next(f for f in whole_step_floors(chain, setup) if f.update == update).total
    assert floor == least_device_memory(chain, setup)
    plan, how = solve_for_budget(chain, "auto", "auto", setup, floor)
    assert plan.budget_bytes == least_budget(chain, setup) and plan.predicted.peak_bytes <= plan.budget_bytes
    with pytest.raises(MemschedError) as caught:
        solve_for_budget(chain, "auto", "auto", setup, floor - 1)
    one_line(caught, f"least device memory for this setup is {floor} bytes")


def test_a_plan_records_its_setup_and_is_simulated_through_it(tmp_path):
    sharded = TrainingSetup(optimizer="adamw", precision="bf16", zero=2, dp=2)
    plan = solvers.solve(LAID_OUT, solvers.store_all_peak(LAID_OUT), "auto", sharded)
    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again.setup == sharded and simulate(LAID_OUT, again).peak_bytes == plan.predicted.peak_bytes
    setup = TrainingSetup(optimizer="adamw", precision="bf16", zero=3, dp=1, accumulate=2)
    plan = solvers.solve(CHAIN, solvers.store_all_peak(CHAIN, 2) * 7 // 10, "auto", setup)
    assert plan.setup == setup
    raw = plan.to_dict()
    assert raw["setup"] == {"optimizer": "adamw", "precision": "bf16", "zero": 3, "dp": 1} and raw["accumulate"] == 2
    again = Plan.from_dict(json.loads(json.dumps(raw)))
    assert again.setup == setup and simulate(CHAIN, again).peak_bytes == plan.predicted.peak_bytes
    assert "setup" not in solvers.solve(CHAIN, solvers.store_all_peak(CHAIN), "auto").to_dict()
    for bad, wanted in (({"zero": 5}, "zero"), ({"epochs": 1}, "epochs")):
        with pytest.raises(MemschedError, match=wanted):
            Plan.from_dict(dict(raw, setup=dict(raw["setup"], **bad)))
    with pytest.raises(MemschedError, match="--accumulate 2 does not mix with --update in-backward"):
        Plan.from_dict(dict(raw, update="in-backward"))


def test_fit_takes_the_setup_as_one_value():
    torch = pytest.importorskip("torch")
    from planner import fit

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 16))
                                  for _ in range(4)))
    x = torch.randn(8, 16)
    quick = dict(warmup=0, repeats=1, stage_options=0, progress=False, loss_fn=lambda out: out.square().mean())
    fitted = fit(model, x, "90%", setup=TrainingSetup(accumulate=3), **quick)
    assert fitted.plan.setup == TrainingSetup(accumulate=3) and len(fitted.micro_batch_peaks) == 3
    for given, wanted in (({"accumulate": 2}, "accumulate= is a field of the setup given"),
                          ({"update": "in-backward"}, "update= is a field of the setup given"),
                          ({"compile": True}, "accumulate=3 does not mix with compile=True")):
        with pytest.raises(MemschedError, match=wanted) as caught:
            fit(model, x, "90%", setup=TrainingSetup(accumulate=3), **quick, **given)
        one_line(caught)


def test_update_auto_keeps_a_sharded_step_after_the_backward():
    setup = TrainingSetup(zero=2, dp=2)
    memory = least_device_memory(LAID_OUT, setup) + (1 << 20)
    plan, how = solve_for_budget(LAID_OUT, "auto", "auto", setup, memory, update_auto=True, transfer=CHANNEL)
    assert plan.update == "after" and plan.setup == setup and how.endswith("update after, the only one a sharded "
                                                                           "step takes")
