"""The chain plan format ``memsched.plan/1`` (planner/plan.py): layout, round trips, validation, and a plan
refused on a chain other than its own."""

import copy
import dataclasses
import json
import math

import pytest

from checks import one_line
from format_cases import delete_at, set_at, write_text
from planner import (
    Chain,
    MemschedError,
    Plan,
    check_plan_matches,
    load_chain,
    load_plan,
    save_chain,
    save_plan,
    simulate,
)
from planner.ops import Op
from profiles.synthetic import random_chain


def test_plan_round_trips(rotor_plan, tmp_path):
    chain, plan = rotor_plan
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    loaded = load_plan(path)
    assert loaded == plan
    assert loaded.schedule == plan.schedule
    assert all(isinstance(op, Op) for op in loaded.schedule)
    assert loaded.predicted == plan.predicted
    assert loaded.params == plan.params
    assert loaded.fingerprint == plan.fingerprint == chain.fingerprint()
    assert loaded.optimal is plan.optimal
    assert loaded.solver == "rotor"
    assert loaded.budget_bytes == plan.budget_bytes
    assert loaded.problem_name == chain.name
    assert Plan.from_dict(plan.to_dict()) == plan
    # the loaded plan still replays to the predicted figures
    check_plan_matches(loaded, chain)
    check_plan_matches(loaded, load_chain_after_save(chain, tmp_path))
    result = simulate(chain, loaded)
    assert result.peak_bytes == plan.predicted.peak_bytes <= plan.budget_bytes
    assert math.isclose(result.time, plan.predicted.time)


def load_chain_after_save(chain, folder):
    save_chain(chain, folder / "chain.json")
    return load_chain(folder / "chain.json")


def test_plan_json_layout(rotor_plan, tmp_path):
    chain, plan = rotor_plan
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    data = json.loads(path.read_text())
    assert set(data) == {"format", "kind", "problem", "solver", "budget_bytes", "predicted", "schedule", "check"}
    assert list(data)[-1] == "check" and data["check"].startswith("sha256:") and len(data["check"]) == 7 + 64
    assert data["format"] == "memsched.plan/1"
    assert data["kind"] == "chain"
    assert set(data["problem"]) == {"name", "fingerprint"}
    assert data["problem"] == {"name": chain.name, "fingerprint": chain.fingerprint()}
    assert set(data["solver"]) == {"name", "params", "solve_seconds", "optimal"}
    assert data["solver"]["name"] == "rotor"
    assert isinstance(data["solver"]["params"], dict)
    assert isinstance(data["solver"]["solve_seconds"], float) and data["solver"]["solve_seconds"] >= 0
    assert isinstance(data["solver"]["optimal"], bool)
    assert data["budget_bytes"] == plan.budget_bytes and isinstance(data["budget_bytes"], int)
    assert set(data["predicted"]) == {"peak_bytes", "time", "baseline_time", "overhead"}
    assert isinstance(data["predicted"]["peak_bytes"], int)
    assert data["predicted"]["baseline_time"] == pytest.approx(chain.compute_time)
    assert data["predicted"]["overhead"] == pytest.approx(
        data["predicted"]["time"] / data["predicted"]["baseline_time"] - 1)
    assert isinstance(data["schedule"], list) and data["schedule"]
    losses = 0
    for item in data["schedule"]:
        if item["op"] == "Loss":
            assert item == {"op": "Loss"}
            losses += 1
        else:
            assert set(item) == {"op", "stage"}
            assert item["op"] in ("F_all", "F_ck", "F_none", "B")
            assert type(item["stage"]) is int and 0 <= item["stage"] < chain.length
    assert losses == 1
    assert [Op(item["op"], item.get("stage")) for item in data["schedule"]] == list(plan.schedule)


def _loss_index(data):
    return next(i for i, item in enumerate(data["schedule"]) if item["op"] == "Loss")


def _set_loss_stage(data):
    data["schedule"][_loss_index(data)]["stage"] = 3


def _loss_stage_fragment(data):
    return f"schedule[{_loss_index(data)}]"


INVALID_PLANS = [
    pytest.param(set_at("format", "memsched.plan/2"), ["memsched.plan/2", "this memsched reads", "memsched.plan/1"],
                 id="unsupported-version"),
    pytest.param(set_at("format", "memsched.chain/1"), ["memsched.chain/1", "expected", "memsched.plan/1"],
                 id="chain-format-tag-in-a-plan"),
    pytest.param(delete_at("format"), ["format", "missing"], id="missing-format"),
    pytest.param(set_at("kind", "graph"), ["kind", "'graph'"], id="kind-graph"),
    pytest.param(delete_at("kind"), ["kind", "missing"], id="missing-kind"),
    pytest.param(set_at("schedule", 2, "op", "F_foo"), ["schedule[2]", "F_foo", "F_all", "B"], id="unknown-op"),
    pytest.param(set_at("schedule", 0, "stage", -1), ["schedule[0]", "stage", "-1"], id="stage-negative"),
    pytest.param(set_at("schedule", 0, "stage", "3"), ["schedule[0]", "stage", "'3'"], id="stage-string"),
    pytest.param(set_at("schedule", 1, "stage", True), ["schedule[1]", "stage", "True"], id="stage-bool"),
    pytest.param(set_at("schedule", 1, "stage", 1.0), ["schedule[1]", "stage", "1.0"], id="stage-float"),
    pytest.param(delete_at("schedule", 0, "stage"), ["schedule[0]", "stage", "missing"], id="stage-missing"),
    pytest.param(set_at("schedule", 0, "stge", 0), ["schedule[0]", "stge", "known fields"], id="unknown-op-field"),
    pytest.param(set_at("schedule", 0, "F_all 0"), ["schedule[0]", "object"], id="op-not-an-object"),
    pytest.param(_set_loss_stage, ["Loss", "stage", _loss_stage_fragment], id="loss-with-stage"),
    pytest.param(set_at("schedule", []), ["schedule", "non-empty"], id="empty-schedule"),
    pytest.param(delete_at("schedule"), ["schedule", "missing"], id="missing-schedule"),
    pytest.param(delete_at("predicted"), ["predicted", "missing"], id="missing-predicted"),
    pytest.param(delete_at("predicted", "peak_bytes"), ["predicted", "peak_bytes", "missing"],
                 id="missing-predicted-peak_bytes"),
    pytest.param(set_at("predicted", "time", float("nan")), ["predicted.time"], id="nan-predicted-time"),
    pytest.param(set_at("predicted", "peek_bytes", 1), ["predicted", "peek_bytes", "known fields"],
                 id="unknown-predicted-field"),
    pytest.param(set_at("solver", "optimal", "yes"), ["solver.optimal"], id="optimal-string"),
    pytest.param(set_at("solver", "optimal", 1), ["solver.optimal"], id="optimal-int"),
    pytest.param(set_at("solver", "params", [500]), ["solver.params"], id="params-not-an-object"),
    pytest.param(delete_at("solver", "name"), ["solver", "name", "missing"], id="missing-solver-name"),
    pytest.param(delete_at("problem", "fingerprint"), ["problem", "fingerprint", "missing"], id="missing-fingerprint"),
    pytest.param(set_at("budget_bytes", -1), ["budget_bytes", "-1"], id="negative-budget"),
    pytest.param(set_at("budget_bytes", "4GiB"), ["budget_bytes", "'4GiB'"], id="string-budget"),
    pytest.param(set_at("budget", 1), ["unknown field 'budget'", "known fields", "budget_bytes"],
                 id="unknown-top-level-field"),
]


@pytest.mark.parametrize("via", ["from_dict", "file"])
@pytest.mark.parametrize("mutate, fragments", INVALID_PLANS)
def test_invalid_plan(rotor_plan, tmp_path, via, mutate, fragments):
    _, plan = rotor_plan
    data = copy.deepcopy(plan.to_dict())
    fragments = [f(data) if callable(f) else f for f in fragments]
    mutate(data)
    if via == "from_dict":
        with pytest.raises(MemschedError) as excinfo:
            Plan.from_dict(data)
    else:
        path = write_text(tmp_path / "bad.plan.json", json.dumps(data))
        with pytest.raises(MemschedError) as excinfo:
            load_plan(path)
        fragments = [str(path)] + fragments
    one_line(excinfo, *fragments)


def test_unreadable_plan_files(tmp_path):
    with pytest.raises(MemschedError) as excinfo:
        load_plan(tmp_path / "absent.plan.json")
    one_line(excinfo, "absent.plan.json", "no such file")
    path = write_text(tmp_path / "list.plan.json", "[]")
    with pytest.raises(MemschedError) as excinfo:
        load_plan(path)
    one_line(excinfo, "JSON object")
    path = write_text(tmp_path / "bad.plan.json", '{"format": "memsched.plan/1",\n  "kind": chain}')
    with pytest.raises(MemschedError) as excinfo:
        load_plan(path)
    one_line(excinfo, "not valid JSON", "line 2", "column")


def _with_fwd_time_changed(chain, stage=3, delta=0.001, name=None):
    stages = list(chain.stages)
    stages[stage] = dataclasses.replace(stages[stage], fwd_time=stages[stage].fwd_time + delta)
    return dataclasses.replace(chain, stages=tuple(stages), name=name or chain.name)


def test_plan_refused_on_a_changed_chain(rotor_plan):
    chain, plan = rotor_plan
    other = _with_fwd_time_changed(chain)
    assert other.fingerprint() != chain.fingerprint()
    with pytest.raises(MemschedError) as excinfo:
        check_plan_matches(plan, other)
    one_line(excinfo, f"'{chain.name}'")
    with pytest.raises(MemschedError) as excinfo:
        simulate(other, plan)
    one_line(excinfo, chain.name)


def test_plan_refused_on_another_chain_names_both(rotor_plan):
    chain, plan = rotor_plan
    other = _with_fwd_time_changed(chain, name="resnet_other")
    with pytest.raises(MemschedError) as excinfo:
        check_plan_matches(plan, other)
    one_line(excinfo, chain.name, "resnet_other")
    with pytest.raises(MemschedError) as excinfo:
        simulate(other, plan)
    one_line(excinfo, chain.name, "resnet_other")
    # a completely different chain of the same length is refused as well
    unrelated = random_chain(8, seed=4, tmp=True, params=True)
    with pytest.raises(MemschedError) as excinfo:
        simulate(unrelated, plan)
    one_line(excinfo, chain.name, unrelated.name)


def test_plan_accepted_on_its_own_chain(rotor_plan):
    chain, plan = rotor_plan
    check_plan_matches(plan, chain)
    check_plan_matches(plan, Chain.from_dict(json.loads(json.dumps(chain.to_dict()))))
    assert simulate(chain, plan).peak_bytes == plan.predicted.peak_bytes


# --- a plan checked against itself (issue 38): nothing edited or damaged runs over its budget ---------------------

def _edited(data: dict, **fields) -> dict:
    return {**copy.deepcopy(data), **fields}


@pytest.mark.parametrize("fields, fragments", [
    ({"budget_bytes": 0}, ["budget_bytes is 0", "at least 1 byte"]),
    ({"budget_bytes": "peak - 1"}, ["is above budget_bytes", "edited"]),
    ({"setup": None}, ["setup must be a JSON object"]),
    ({"setup": {}}, ["setup lacks optimizer, precision, zero, dp", "solve again"]),
    ({"setup": {"optimizer": "adam", "precision": "fp32"}}, ["setup lacks zero, dp"]),
    ({"accumulate": 4}, ["not those its check was written for", "drop 'check'"]),
    ({"update": "in-backward"}, ["not those its check was written for"]),
    ({"budget_bytes": "peak"}, ["not those its check was written for"]),
])
def test_a_damaged_plan_is_refused_on_load_in_one_line(rotor_plan, tmp_path, fields, fragments):
    """Every reader of a plan file (memsched show, train --plan, apply_plan after load_plan) loads it here: a budget
    of 0 (a ZeroDivisionError in show before), a budget below its own predicted peak, a setup null or missing
    fields, and any field edited under the check memsched wrote (accumulation added, an update moved, the budget
    lowered to the peak) are each refused in one line."""
    _, plan = rotor_plan
    data = plan.to_dict()
    peak = data["predicted"]["peak_bytes"]
    fields = {key: {"peak - 1": peak - 1, "peak": peak}.get(value, value) if isinstance(value, str) else value
              for key, value in fields.items()}
    with pytest.raises(MemschedError) as error:
        load_plan(write_text(tmp_path / "plan.json", json.dumps(_edited(data, **fields))))
    one_line(error, *fragments)


def test_a_plan_run_over_its_budget_is_refused_by_apply_plan(rotor_plan):
    """An edit taken as its author's (its check dropped) loads, but apply_plan with the chain replays it: with
    accumulation added, or an update inside the backward dropped, the schedule would pass the budget it records."""
    import torch

    from planner.chain import Loss, Stage
    from planner.execute.chain import apply_plan
    from planner.setup.training import TrainingSetup
    from solvers import solve

    chain, plan = rotor_plan
    stages = {stage.name: torch.nn.Identity() for stage in chain.stages}
    tight = dataclasses.replace(plan, budget_bytes=plan.predicted.peak_bytes)
    apply_plan(stages, tight, chain)  # as solved: runs
    accumulating = {key: value for key, value in tight.to_dict().items() if key != "check"}
    with pytest.raises(MemschedError) as error:
        apply_plan(stages, Plan.from_dict(dict(accumulating, accumulate=4)), chain)
    one_line(error, "peaks at", f"above its budget_bytes {tight.budget_bytes}", "edited")
    # two stages whose gradients (1000 bytes) outweigh their activations: the update inside the backward frees them
    heavy = Chain(name="heavy", device="cpu", input_bytes=10, loss=Loss(), stages=tuple(
        Stage(name, 1.0, 1.0, out_bytes=20, saved_bytes=20, param_bytes=1000) for name in ("a", "b")))
    in_backward = solve(heavy, 10**6, "rotor", setup=TrainingSetup(update="in-backward"))
    dropped = {key: value for key, value in in_backward.to_dict().items() if key not in ("update", "check")}
    dropped["budget_bytes"] = dropped["predicted"]["peak_bytes"]
    assert simulate(heavy, Plan.from_dict(dropped)).peak_bytes > in_backward.predicted.peak_bytes  # it would pass
    with pytest.raises(MemschedError) as error:
        apply_plan({"a": torch.nn.Identity(), "b": torch.nn.Identity()}, Plan.from_dict(dropped), heavy)
    one_line(error, "peaks at", "edited")
    with pytest.raises(MemschedError) as error:
        apply_plan(stages, dataclasses.replace(plan, budget_bytes=0))
    one_line(error, "budget_bytes is 0")
