"""The public file formats ``memsched.chain/1`` and ``memsched.plan/1``: loading, validation, fingerprints,
atomic writes, and the byte quantities people type (planner.units)."""

import copy
import dataclasses
import json
import math
import os
import re
import stat

import pytest

import planner
import planner.jsonio
import solvers
from planner import Chain, Loss, MemschedError, Plan, check_plan_matches, load_chain, load_plan, save_chain
from planner import save_plan, simulate
from planner.ops import Op
from planner.units import format_bytes, parse_budget
from profiles.synthetic import random_chain
from solvers.minimum import minimum_budget

STAGE_FIELDS = ("name", "fwd_time", "bwd_time", "out_bytes", "saved_bytes", "fwd_tmp_bytes", "bwd_tmp_bytes",
                "param_bytes")

BASE_CHAIN = {
    "format": "memsched.chain/1",
    "name": "tiny",
    "device": "cpu",
    "input_bytes": 1000,
    "stages": [
        {"name": "conv1", "fwd_time": 0.01, "bwd_time": 0.02, "out_bytes": 2000, "saved_bytes": 5000,
         "fwd_tmp_bytes": 100, "bwd_tmp_bytes": 200, "param_bytes": 300},
        {"name": "conv2", "fwd_time": 0.015, "bwd_time": 0.03, "out_bytes": 1500, "saved_bytes": 4000,
         "fwd_tmp_bytes": 50, "bwd_tmp_bytes": 60, "param_bytes": 70},
        {"name": "fc", "fwd_time": 0.005, "bwd_time": 0.011, "out_bytes": 400, "saved_bytes": 900,
         "fwd_tmp_bytes": 7, "bwd_tmp_bytes": 8, "param_bytes": 9},
    ],
    "loss": {"bwd_time": 0.001, "tmp_bytes": 10},
}


def base_chain() -> dict:
    return copy.deepcopy(BASE_CHAIN)


def assert_one_line(excinfo, *fragments) -> str:
    """The error is a MemschedError with a non-empty one-line message containing every fragment."""
    message = str(excinfo.value)
    assert isinstance(excinfo.value, MemschedError)
    assert message.strip(), "empty error message"
    assert "\n" not in message and "\r" not in message, f"message spans lines: {message!r}"
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


def write_text(path, text: str):
    path.write_text(text)
    return path


# --------------------------------------------------------------------------------------------------------------
# 1. Chain loading
# --------------------------------------------------------------------------------------------------------------


def test_chain_round_trips_through_dict_and_file(tmp_path):
    chain = Chain.from_dict(base_chain())
    assert Chain.from_dict(chain.to_dict()) == chain
    save_chain(chain, tmp_path / "tiny.chain.json")
    loaded = load_chain(tmp_path / "tiny.chain.json")
    assert loaded == chain
    assert loaded.to_dict() == chain.to_dict()
    expected = base_chain()  # the file's every field survives unchanged; the optional one is written out
    for stage in expected["stages"]:
        stage["nograd_tmp_bytes"] = stage["fwd_tmp_bytes"]
    assert chain.to_dict() == expected


def test_synthetic_chain_round_trips(tmp_path):
    chain = random_chain(8, seed=3, tmp=True, params=True)
    assert Chain.from_dict(chain.to_dict()) == chain
    save_chain(chain, tmp_path / "c.json")
    assert load_chain(str(tmp_path / "c.json")) == chain  # a str path works as well as a Path


def test_chain_defaults():
    chain = Chain.from_dict({
        "format": "memsched.chain/1",
        "input_bytes": 64,
        "stages": [{"fwd_time": 1, "bwd_time": 2, "out_bytes": 8, "saved_bytes": 8},
                   {"fwd_time": 0.5, "bwd_time": 0.5, "out_bytes": 4, "saved_bytes": 16}],
    })
    assert chain.name == "chain"
    assert chain.device == "unknown"
    assert chain.loss == Loss(bwd_time=0.0, tmp_bytes=0)
    assert [s.name for s in chain.stages] == ["stage0", "stage1"]
    for stage in chain.stages:
        assert (stage.fwd_tmp_bytes, stage.bwd_tmp_bytes, stage.param_bytes) == (0, 0, 0)
    assert isinstance(chain.stages[0].fwd_time, float) and chain.stages[0].fwd_time == 1.0
    # defaults are written out explicitly: the dict is complete and round-trips
    assert set(chain.to_dict()) == {"format", "name", "device", "input_bytes", "stages", "loss"}
    assert Chain.from_dict(chain.to_dict()) == chain


def test_partial_loss_defaults():
    data = base_chain()
    data["loss"] = {"bwd_time": 0.25}
    assert Chain.from_dict(data).loss == Loss(bwd_time=0.25, tmp_bytes=0)
    data["loss"] = {}
    assert Chain.from_dict(data).loss == Loss()


def test_loss_saved_bytes_is_optional_and_written_only_when_set():
    data = base_chain()
    data["loss"]["saved_bytes"] = 24
    chain = Chain.from_dict(data)
    assert chain.loss.saved_bytes == 24 and chain.to_dict()["loss"] == data["loss"]
    assert chain.fingerprint() != Chain.from_dict(base_chain()).fingerprint()
    data["loss"]["saved_bytes"] = 0  # the default: left out, so older chains read, write and hash as before
    assert Chain.from_dict(data).to_dict()["loss"] == BASE_CHAIN["loss"]


def test_integral_float_bytes_accepted(tmp_path):
    data = base_chain()
    data["input_bytes"] = 5e5
    data["stages"][0]["out_bytes"] = 1e6
    data["stages"][0]["saved_bytes"] = 2e6
    data["loss"]["tmp_bytes"] = 3.0
    path = write_text(tmp_path / "c.json", json.dumps(data))
    chain = load_chain(path)
    assert chain.input_bytes == 500000 and type(chain.input_bytes) is int
    assert chain.stages[0].out_bytes == 1000000 and type(chain.stages[0].out_bytes) is int
    assert chain.stages[0].saved_bytes == 2000000 and type(chain.stages[0].saved_bytes) is int
    assert chain.loss.tmp_bytes == 3 and type(chain.loss.tmp_bytes) is int
    # and the chain is the same problem as the one written with integers
    as_ints = base_chain()
    as_ints["input_bytes"] = 500000
    as_ints["stages"][0]["out_bytes"] = 1000000
    as_ints["stages"][0]["saved_bytes"] = 2000000
    as_ints["loss"]["tmp_bytes"] = 3
    assert Chain.from_dict(as_ints) == chain
    assert Chain.from_dict(as_ints).fingerprint() == chain.fingerprint()


def _set(*keys_and_value):
    *keys, value = keys_and_value

    def mutate(data):
        target = data
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value
    return mutate


def _delete(*keys):
    def mutate(data):
        target = data
        for key in keys[:-1]:
            target = target[key]
        del target[keys[-1]]
    return mutate


def _rename(stage, old, new):
    def mutate(data):
        data["stages"][stage][new] = data["stages"][stage].pop(old)
    return mutate


INVALID_CHAINS = [
    pytest.param(_set("stages", 1, "out_bytes", -1), ["stages[1]", "conv2", "out_bytes", "-1"],
                 id="negative-out_bytes"),
    pytest.param(_set("stages", 0, "fwd_tmp_bytes", -5), ["stages[0]", "conv1", "fwd_tmp_bytes", "-5"],
                 id="negative-fwd_tmp_bytes"),
    pytest.param(_set("stages", 2, "param_bytes", -1), ["stages[2]", "fc", "param_bytes"], id="negative-param_bytes"),
    pytest.param(_set("input_bytes", -1), ["input_bytes", "-1"], id="negative-input_bytes"),
    pytest.param(_set("stages", 2, "bwd_time", -0.5), ["stages[2]", "fc", "bwd_time", "-0.5"], id="negative-bwd_time"),
    pytest.param(_set("stages", 1, "fwd_time", float("nan")), ["stages[1]", "conv2", "fwd_time", "nan"],
                 id="nan-fwd_time"),
    pytest.param(_set("stages", 0, "bwd_time", float("inf")), ["stages[0]", "conv1", "bwd_time", "inf"],
                 id="inf-bwd_time"),
    pytest.param(_set("stages", 0, "fwd_time", float("-inf")), ["stages[0]", "conv1", "fwd_time"],
                 id="minus-inf-fwd_time"),
    pytest.param(_set("stages", 1, "out_bytes", float("nan")), ["stages[1]", "conv2", "out_bytes"], id="nan-bytes"),
    pytest.param(_set("stages", 1, "saved_bytes", float("inf")), ["stages[1]", "conv2", "saved_bytes"], id="inf-bytes"),
    pytest.param(_set("loss", "bwd_time", float("nan")), ["loss", "bwd_time"], id="nan-loss-bwd_time"),
    pytest.param(_set("loss", "tmp_bytes", -3), ["loss", "tmp_bytes", "-3"], id="negative-loss-tmp_bytes"),
    pytest.param(_set("loss", "saved_bytes", -1), ["loss", "saved_bytes", "-1"], id="negative-loss-saved_bytes"),
    pytest.param(_set("stages", 1, "saved_bytes", 1.5), ["stages[1]", "conv2", "saved_bytes", "1.5"],
                 id="fractional-bytes"),
    pytest.param(_set("input_bytes", 1000.5), ["input_bytes", "1000.5"], id="fractional-input_bytes"),
    pytest.param(_set("stages", 0, "fwd_time", True), ["stages[0]", "conv1", "fwd_time", "True"], id="bool-time"),
    pytest.param(_set("stages", 2, "out_bytes", False), ["stages[2]", "fc", "out_bytes", "False"], id="bool-bytes"),
    pytest.param(_set("loss", "tmp_bytes", True), ["loss", "tmp_bytes"], id="bool-loss-tmp_bytes"),
    pytest.param(_set("stages", 1, "bwd_time", "0.03"), ["stages[1]", "conv2", "bwd_time", "'0.03'"],
                 id="string-time"),
    pytest.param(_set("stages", 0, "saved_bytes", "5000"), ["stages[0]", "conv1", "saved_bytes", "'5000'"],
                 id="string-bytes"),
    pytest.param(_set("stages", 1, "out_bytes", None), ["stages[1]", "conv2", "out_bytes", "None"], id="null-bytes"),
    pytest.param(_set("stages", 2, "saved_bytes", 399), ["stages[2]", "fc", "saved_bytes", "out_bytes", "399", "400"],
                 id="saved-below-out"),
    pytest.param(_delete("stages", 0, "fwd_time"), ["stages[0]", "conv1", "fwd_time", "missing"],
                 id="missing-fwd_time"),
    pytest.param(_delete("stages", 1, "out_bytes"), ["stages[1]", "conv2", "out_bytes", "missing"],
                 id="missing-out_bytes"),
    pytest.param(_delete("stages", 2, "saved_bytes"), ["stages[2]", "fc", "saved_bytes", "missing"],
                 id="missing-saved_bytes"),
    pytest.param(_delete("input_bytes"), ["input_bytes", "missing"], id="missing-input_bytes"),
    pytest.param(_delete("stages"), ["stages", "missing"], id="missing-stages"),
    pytest.param(_delete("format"), ["format", "missing"], id="missing-format"),
    pytest.param(_set("stages", []), ["stages", "non-empty"], id="empty-stages"),
    pytest.param(_set("stages", {"conv1": {}}), ["stages", "list"], id="stages-not-a-list"),
    pytest.param(_set("stages", 1, [1, 2, 3]), ["stages[1]", "object"], id="stage-not-an-object"),
    pytest.param(_rename(0, "fwd_time", "fwd_tim"),
                 ["stages[0]", "fwd_tim", "known fields", "fwd_time", "bwd_time", "saved_bytes", "param_bytes"],
                 id="unknown-stage-field-typo"),
    pytest.param(_set("stage", []), ["unknown field 'stage'", "known fields", "stages", "input_bytes"],
                 id="unknown-top-level-field"),
    pytest.param(_set("loss", "tmp_byte", 3), ["loss", "tmp_byte", "known fields", "tmp_bytes", "bwd_time"],
                 id="unknown-loss-field"),
    pytest.param(_set("loss", [0.1, 2]), ["loss", "object"], id="loss-not-an-object"),
    pytest.param(_set("name", 7), ["name", "string"], id="name-not-a-string"),
    pytest.param(_set("stages", 0, "name", 3), ["stages[0]", "name", "string"], id="stage-name-not-a-string"),
    pytest.param(_set("format", "memsched.plan/1"), ["memsched.plan/1", "expected", "memsched.chain/1"],
                 id="plan-format-tag-in-a-chain"),
    pytest.param(_set("format", "memsched.chain/2"), ["memsched.chain/2", "this memsched reads", "memsched.chain/1"],
                 id="unsupported-version"),
    pytest.param(_set("format", 1), ["format", "memsched.chain/1"], id="format-not-a-string"),
]


@pytest.mark.parametrize("via", ["from_dict", "file"])
@pytest.mark.parametrize("mutate, fragments", INVALID_CHAINS)
def test_invalid_chain(tmp_path, via, mutate, fragments):
    data = base_chain()
    mutate(data)
    if via == "from_dict":
        with pytest.raises(MemschedError) as excinfo:
            Chain.from_dict(data)
    else:
        path = write_text(tmp_path / "bad.chain.json", json.dumps(data, indent=1))  # NaN / Infinity are allowed
        with pytest.raises(MemschedError) as excinfo:
            load_chain(path)
        fragments = [str(path)] + fragments  # the file is named
    assert_one_line(excinfo, *fragments)


@pytest.mark.parametrize("text, fragments", [
    pytest.param('[{"format": "memsched.chain/1"}]', ["JSON object", "list"], id="top-level-array"),
    pytest.param('"memsched.chain/1"', ["JSON object", "str"], id="top-level-string"),
    pytest.param('{"format": "memsched.chain/1",\n "input_bytes": 10,\n "stages": [}\n', ["not valid JSON", "line 3",
                                                                                        "column"], id="malformed-json"),
    pytest.param('{"format": "memsched.chain/1", "input_bytes": 10,', ["not valid JSON", "line 1", "column"],
                 id="truncated-json"),
    pytest.param("", ["not valid JSON", "line 1", "column 1"], id="empty-file"),
])
def test_unreadable_chain_file(tmp_path, text, fragments):
    path = write_text(tmp_path / "bad.chain.json", text)
    with pytest.raises(MemschedError) as excinfo:
        load_chain(path)
    assert_one_line(excinfo, str(path), *fragments)


def test_missing_chain_file(tmp_path):
    with pytest.raises(MemschedError) as excinfo:
        load_chain(tmp_path / "absent.chain.json")
    assert_one_line(excinfo, "absent.chain.json", "no such file")


def test_chain_from_dict_rejects_non_object():
    with pytest.raises(MemschedError) as excinfo:
        Chain.from_dict([BASE_CHAIN])
    assert_one_line(excinfo, "JSON object")


# --------------------------------------------------------------------------------------------------------------
# 2. Fingerprint
# --------------------------------------------------------------------------------------------------------------

FINGERPRINT = re.compile(r"^sha256:[0-9a-f]{64}$")


def test_fingerprint_format_and_stability(tmp_path):
    chain = Chain.from_dict(base_chain())
    fingerprint = chain.fingerprint()
    assert FINGERPRINT.match(fingerprint), fingerprint
    assert chain.fingerprint() == fingerprint
    assert Chain.from_dict(base_chain()).fingerprint() == fingerprint
    save_chain(chain, tmp_path / "c.json")
    assert load_chain(tmp_path / "c.json").fingerprint() == fingerprint


def _reversed_keys(value):
    if isinstance(value, dict):
        return {key: _reversed_keys(value[key]) for key in reversed(list(value))}
    if isinstance(value, list):
        return [_reversed_keys(item) for item in value]
    return value


def test_fingerprint_ignores_key_order_and_layout(tmp_path):
    chain = Chain.from_dict(base_chain())
    shuffled = _reversed_keys(base_chain())
    assert list(shuffled) != list(BASE_CHAIN)
    path = write_text(tmp_path / "c.json", json.dumps(shuffled, separators=(",", ":")))
    assert load_chain(path).fingerprint() == chain.fingerprint()
    path = write_text(tmp_path / "d.json", json.dumps(shuffled, indent=7, sort_keys=True))
    assert load_chain(path).fingerprint() == chain.fingerprint()


def test_synthetic_fingerprint_stable_across_save_and_load(tmp_path):
    chain = random_chain(8, seed=3, tmp=True, params=True)
    save_chain(chain, tmp_path / "c.json")
    assert FINGERPRINT.match(chain.fingerprint())
    assert load_chain(tmp_path / "c.json").fingerprint() == chain.fingerprint()


def _bumped(field, value):
    if field == "name":
        return value + "_x"
    if isinstance(value, float):
        return value + 0.0005
    return value + 1


FINGERPRINT_CHANGES = (
    [pytest.param(("stages", i, field), id=f"stages[{i}].{field}") for i in (0, 2) for field in STAGE_FIELDS]
    + [pytest.param(("input_bytes",), id="input_bytes"),
       pytest.param(("loss", "bwd_time"), id="loss.bwd_time"),
       pytest.param(("loss", "tmp_bytes"), id="loss.tmp_bytes")]
)


@pytest.mark.parametrize("keys", FINGERPRINT_CHANGES)
def test_fingerprint_changes_with_each_field(keys):
    original = Chain.from_dict(base_chain())
    data = base_chain()
    target = data
    for key in keys[:-1]:
        target = target[key]
    target[keys[-1]] = _bumped(keys[-1], target[keys[-1]])
    changed = Chain.from_dict(data)
    assert changed != original
    assert FINGERPRINT.match(changed.fingerprint())
    assert changed.fingerprint() != original.fingerprint()


def test_fingerprints_of_all_single_field_changes_are_distinct():
    seen = {Chain.from_dict(base_chain()).fingerprint()}
    count = 1
    for param in FINGERPRINT_CHANGES:
        keys = param.values[0]
        data = base_chain()
        target = data
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = _bumped(keys[-1], target[keys[-1]])
        seen.add(Chain.from_dict(data).fingerprint())
        count += 1
    assert len(seen) == count


# --------------------------------------------------------------------------------------------------------------
# 3. Plans
# --------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def solved():
    """A rotor plan for an 8-stage synthetic chain, halfway between the least and the store-all memory."""
    chain = random_chain(8, seed=3, tmp=True, params=True)
    budget = (minimum_budget(chain) + solvers.store_all_peak(chain)) // 2
    plan = solvers.solve(chain, budget, "rotor")
    return chain, plan


def test_plan_round_trips(solved, tmp_path):
    chain, plan = solved
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


def test_plan_json_layout(solved, tmp_path):
    chain, plan = solved
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    data = json.loads(path.read_text())
    assert set(data) == {"format", "kind", "problem", "solver", "budget_bytes", "predicted", "schedule"}
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
    pytest.param(_set("format", "memsched.plan/2"), ["memsched.plan/2", "this memsched reads", "memsched.plan/1"],
                 id="unsupported-version"),
    pytest.param(_set("format", "memsched.chain/1"), ["memsched.chain/1", "expected", "memsched.plan/1"],
                 id="chain-format-tag-in-a-plan"),
    pytest.param(_delete("format"), ["format", "missing"], id="missing-format"),
    pytest.param(_set("kind", "graph"), ["kind", "'graph'"], id="kind-graph"),
    pytest.param(_delete("kind"), ["kind", "missing"], id="missing-kind"),
    pytest.param(_set("schedule", 2, "op", "F_foo"), ["schedule[2]", "F_foo", "F_all", "B"], id="unknown-op"),
    pytest.param(_set("schedule", 0, "stage", -1), ["schedule[0]", "stage", "-1"], id="stage-negative"),
    pytest.param(_set("schedule", 0, "stage", "3"), ["schedule[0]", "stage", "'3'"], id="stage-string"),
    pytest.param(_set("schedule", 1, "stage", True), ["schedule[1]", "stage", "True"], id="stage-bool"),
    pytest.param(_set("schedule", 1, "stage", 1.0), ["schedule[1]", "stage", "1.0"], id="stage-float"),
    pytest.param(_delete("schedule", 0, "stage"), ["schedule[0]", "stage", "missing"], id="stage-missing"),
    pytest.param(_set("schedule", 0, "stge", 0), ["schedule[0]", "stge", "known fields"], id="unknown-op-field"),
    pytest.param(_set("schedule", 0, "F_all 0"), ["schedule[0]", "object"], id="op-not-an-object"),
    pytest.param(_set_loss_stage, ["Loss", "stage", _loss_stage_fragment], id="loss-with-stage"),
    pytest.param(_set("schedule", []), ["schedule", "non-empty"], id="empty-schedule"),
    pytest.param(_delete("schedule"), ["schedule", "missing"], id="missing-schedule"),
    pytest.param(_delete("predicted"), ["predicted", "missing"], id="missing-predicted"),
    pytest.param(_delete("predicted", "peak_bytes"), ["predicted", "peak_bytes", "missing"],
                 id="missing-predicted-peak_bytes"),
    pytest.param(_set("predicted", "time", float("nan")), ["predicted.time"], id="nan-predicted-time"),
    pytest.param(_set("predicted", "peek_bytes", 1), ["predicted", "peek_bytes", "known fields"],
                 id="unknown-predicted-field"),
    pytest.param(_set("solver", "optimal", "yes"), ["solver.optimal"], id="optimal-string"),
    pytest.param(_set("solver", "optimal", 1), ["solver.optimal"], id="optimal-int"),
    pytest.param(_set("solver", "params", [500]), ["solver.params"], id="params-not-an-object"),
    pytest.param(_delete("solver", "name"), ["solver", "name", "missing"], id="missing-solver-name"),
    pytest.param(_delete("problem", "fingerprint"), ["problem", "fingerprint", "missing"], id="missing-fingerprint"),
    pytest.param(_set("budget_bytes", -1), ["budget_bytes", "-1"], id="negative-budget"),
    pytest.param(_set("budget_bytes", "4GiB"), ["budget_bytes", "'4GiB'"], id="string-budget"),
    pytest.param(_set("budget", 1), ["unknown field 'budget'", "known fields", "budget_bytes"],
                 id="unknown-top-level-field"),
]


@pytest.mark.parametrize("via", ["from_dict", "file"])
@pytest.mark.parametrize("mutate, fragments", INVALID_PLANS)
def test_invalid_plan(solved, tmp_path, via, mutate, fragments):
    _, plan = solved
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
    assert_one_line(excinfo, *fragments)


def test_unreadable_plan_files(tmp_path):
    with pytest.raises(MemschedError) as excinfo:
        load_plan(tmp_path / "absent.plan.json")
    assert_one_line(excinfo, "absent.plan.json", "no such file")
    path = write_text(tmp_path / "list.plan.json", "[]")
    with pytest.raises(MemschedError) as excinfo:
        load_plan(path)
    assert_one_line(excinfo, "JSON object")
    path = write_text(tmp_path / "bad.plan.json", '{"format": "memsched.plan/1",\n  "kind": chain}')
    with pytest.raises(MemschedError) as excinfo:
        load_plan(path)
    assert_one_line(excinfo, "not valid JSON", "line 2", "column")


def _with_fwd_time_changed(chain, stage=3, delta=0.001, name=None):
    stages = list(chain.stages)
    stages[stage] = dataclasses.replace(stages[stage], fwd_time=stages[stage].fwd_time + delta)
    return dataclasses.replace(chain, stages=tuple(stages), name=name or chain.name)


def test_plan_refused_on_a_changed_chain(solved):
    chain, plan = solved
    other = _with_fwd_time_changed(chain)
    assert other.fingerprint() != chain.fingerprint()
    with pytest.raises(MemschedError) as excinfo:
        check_plan_matches(plan, other)
    assert_one_line(excinfo, f"'{chain.name}'")
    with pytest.raises(MemschedError) as excinfo:
        simulate(other, plan)
    assert_one_line(excinfo, chain.name)


def test_plan_refused_on_another_chain_names_both(solved):
    chain, plan = solved
    other = _with_fwd_time_changed(chain, name="resnet_other")
    with pytest.raises(MemschedError) as excinfo:
        check_plan_matches(plan, other)
    assert_one_line(excinfo, chain.name, "resnet_other")
    with pytest.raises(MemschedError) as excinfo:
        simulate(other, plan)
    assert_one_line(excinfo, chain.name, "resnet_other")
    # a completely different chain of the same length is refused as well
    unrelated = random_chain(8, seed=4, tmp=True, params=True)
    with pytest.raises(MemschedError) as excinfo:
        simulate(unrelated, plan)
    assert_one_line(excinfo, chain.name, unrelated.name)


def test_plan_accepted_on_its_own_chain(solved):
    chain, plan = solved
    check_plan_matches(plan, chain)
    check_plan_matches(plan, Chain.from_dict(json.loads(json.dumps(chain.to_dict()))))
    assert simulate(chain, plan).peak_bytes == plan.predicted.peak_bytes


# --------------------------------------------------------------------------------------------------------------
# 4. Atomic writes
# --------------------------------------------------------------------------------------------------------------


def test_write_replaces_existing_file_whole(solved, tmp_path):
    chain, plan = solved
    path = tmp_path / "out.json"
    path.write_text("x" * 200_000)  # longer than what replaces it: no tail may survive
    save_plan(plan, path)
    assert json.loads(path.read_text()) == json.loads(json.dumps(plan.to_dict()))
    assert sorted(os.listdir(tmp_path)) == ["out.json"]
    save_chain(chain, path)  # and once more, a different (shorter) document over it
    assert load_chain(path) == chain
    assert path.read_text().endswith("}\n")
    assert sorted(os.listdir(tmp_path)) == ["out.json"]


def test_write_json_atomic_leaves_no_temp_files(tmp_path):
    target = tmp_path / "data.json"
    for round_ in range(3):
        planner.jsonio.write_json_atomic(target, {"round": round_, "values": list(range(round_))})
        assert sorted(os.listdir(tmp_path)) == ["data.json"]
        assert json.loads(target.read_text()) == {"round": round_, "values": list(range(round_))}


def test_save_chain_and_plan_leave_no_temp_files(solved, tmp_path):
    chain, plan = solved
    save_chain(chain, tmp_path / "c.json")
    save_plan(plan, tmp_path / "p.json")
    save_plan(plan, str(tmp_path / "p.json"))
    assert sorted(os.listdir(tmp_path)) == ["c.json", "p.json"]


@pytest.mark.parametrize("error", [RuntimeError("disk full"), KeyboardInterrupt()], ids=["RuntimeError",
                                                                                         "KeyboardInterrupt"])
def test_failed_serialisation_keeps_old_file(solved, tmp_path, monkeypatch, error):
    chain, plan = solved
    path = tmp_path / "plan.json"
    save_chain(chain, path)
    before = path.read_bytes()

    def broken_dump(obj, handle, **kwargs):
        handle.write('{"format": "memsched.plan/1", "kind": "ch')
        handle.flush()
        raise error

    monkeypatch.setattr(planner.jsonio.json, "dump", broken_dump)
    with pytest.raises(type(error)):
        save_plan(plan, path)
    with pytest.raises(type(error)):
        save_chain(chain, path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert load_chain(path) == chain
    assert sorted(os.listdir(tmp_path)) == ["plan.json"]


def test_failed_first_write_leaves_nothing(solved, tmp_path, monkeypatch):
    _, plan = solved

    def broken_dump(obj, handle, **kwargs):
        handle.write("{")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(planner.jsonio.json, "dump", broken_dump)
    with pytest.raises(MemschedError) as excinfo:  # a full disk is the user's to fix: one line, no traceback
        save_plan(plan, tmp_path / "plan.json")
    assert_one_line(excinfo, "plan.json", "No space left on device")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)],
                         ids=["umask022", "umask077", "umask002"])
def test_written_file_mode_follows_umask(solved, tmp_path, umask, mode):
    chain, plan = solved
    old = os.umask(umask)
    try:
        save_plan(plan, tmp_path / "plan.json")
        save_chain(chain, tmp_path / "chain.json")
        existing = tmp_path / "existing.json"
        existing.write_text("{}")
        existing.chmod(0o600 if mode != 0o600 else 0o644)
        save_chain(chain, existing)  # a new file replaces the old: it gets the umask's mode
    finally:
        os.umask(old)
    for name in ("plan.json", "chain.json", "existing.json"):
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == mode, name


def test_missing_output_folder(solved, tmp_path):
    chain, plan = solved
    with pytest.raises(MemschedError) as excinfo:
        save_plan(plan, tmp_path / "no" / "such" / "plan.json")
    assert_one_line(excinfo, "does not exist")
    with pytest.raises(MemschedError) as excinfo:
        save_chain(chain, tmp_path / "missing" / "chain.json")
    assert_one_line(excinfo, "missing", "does not exist")
    assert os.listdir(tmp_path) == []


# --------------------------------------------------------------------------------------------------------------
# 5. Byte quantities
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, reference, expected", [
    pytest.param("123456789", None, 123456789, id="plain-bytes"),
    pytest.param("4GiB", None, 4 * 2**30, id="GiB"),
    pytest.param("512MB", None, 512 * 10**6, id="MB"),
    pytest.param("1.5 GiB", None, 3 * 2**29, id="fractional-with-space"),
    pytest.param("2 kib", None, 2048, id="lower-case-unit"),
    pytest.param("1TB", None, 10**12, id="TB"),
    pytest.param("100B", None, 100, id="B"),
    pytest.param(" 7MiB ", None, 7 * 2**20, id="surrounding-spaces"),
    pytest.param("50%", 1000, 500, id="50-percent"),
    pytest.param("100%", 123456789, 123456789, id="100-percent"),
    pytest.param("25%", 10, 2, id="percent-rounds-down"),
    pytest.param("123456789", 1000, 123456789, id="bytes-ignore-reference"),
])
def test_parse_budget(text, reference, expected):
    value = parse_budget(text, reference)
    assert value == expected
    assert type(value) is int


@pytest.mark.parametrize("text, reference, fragments", [
    pytest.param("abc", None, ["'abc'"], id="not-a-number"),
    pytest.param("4XB", None, ["'XB'", "GiB", "MB", "KiB", "%"], id="unknown-unit"),
    pytest.param("-1", None, ["'-1'"], id="negative"),
    pytest.param("0", None, ["'0'", "positive"], id="zero"),
    pytest.param("0GiB", None, ["positive"], id="zero-with-unit"),
    pytest.param("0%", 1000, ["positive"], id="zero-percent"),
    pytest.param("50%", None, ["percentage"], id="percent-without-reference"),
    pytest.param("", None, ["budget"], id="empty"),
    pytest.param("1e400", None, ["positive"], id="overflow"),
])
def test_parse_budget_errors(text, reference, fragments):
    with pytest.raises(MemschedError) as excinfo:
        parse_budget(text, reference)
    assert_one_line(excinfo, *fragments)


def test_parse_budget_names_what_is_parsed():
    with pytest.raises(MemschedError) as excinfo:
        parse_budget("lots", what="--budget")
    assert_one_line(excinfo, "--budget", "'lots'")


def test_parse_budget_percentage_is_exact():
    assert parse_budget("29%", 100) == 29


def test_parse_budget_large_counts_are_exact():
    assert parse_budget("9007199254740993") == 9007199254740993


def test_parse_budget_below_one_byte_is_refused():
    with pytest.raises(MemschedError):
        parse_budget("0.5")


def test_duplicate_keys_are_refused(tmp_path):
    path = tmp_path / "dup.json"
    path.write_text('{"format": "memsched.chain/1", "input_bytes": 1, "input_bytes": 2, "stages": []}')
    with pytest.raises(MemschedError) as excinfo:
        load_chain(path)
    assert_one_line(excinfo, "input_bytes", "twice")


def test_saving_onto_a_folder_is_a_clear_error(tmp_path):
    (tmp_path / "taken").mkdir()
    with pytest.raises(MemschedError) as excinfo:
        save_chain(random_chain(3, seed=0), tmp_path / "taken")
    assert_one_line(excinfo, "taken", "cannot write")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


@pytest.mark.parametrize("count, expected", [
    pytest.param(0, "0 B", id="zero"),
    pytest.param(512, "512 B", id="bytes"),
    pytest.param(1023, "1023 B", id="just-below-KiB"),
    pytest.param(1024, "1.0 KiB", id="KiB"),
    pytest.param(1536, "1.5 KiB", id="fractional-KiB"),
    pytest.param(5 * 2**20, "5.0 MiB", id="MiB"),
    pytest.param(4 * 2**30, "4.0 GiB", id="GiB"),
    pytest.param(2**40, "1.0 TiB", id="TiB"),
    pytest.param(2048 * 2**40, "2048.0 TiB", id="beyond-TiB"),
])
def test_format_bytes(count, expected):
    assert format_bytes(count) == expected


# --------------------------------------------------------------------------------------------------------------
# 6. Bounds (docs/formats.md, "Bounds"): the largest meaningful values are read, the next ones refused
# --------------------------------------------------------------------------------------------------------------


def test_sizes_and_times_at_their_bounds_are_read_and_beyond_them_refused():
    from planner.validate import MAX_BYTES, MAX_SECONDS

    data = base_chain()
    others = data["loss"]["tmp_bytes"] + sum(stage[field] for stage in data["stages"] for field in stage
                                             if field.endswith("_bytes")) + sum(stage["fwd_tmp_bytes"]
                                                                                for stage in data["stages"])
    data["input_bytes"], data["stages"][0]["fwd_time"] = MAX_BYTES - others, MAX_SECONDS  # nograd_tmp: fwd_tmp's
    chain = Chain.from_dict(data)
    assert chain.input_bytes == MAX_BYTES - others and chain.stages[0].fwd_time == MAX_SECONDS
    data["input_bytes"] += 1  # the sizes now add up to one byte more than 1 EiB
    with pytest.raises(MemschedError) as excinfo:
        Chain.from_dict(data)
    assert_one_line(excinfo, "add up", str(MAX_BYTES))
    for field, value, fragment in [("out_bytes", MAX_BYTES + 1, "out_bytes"),
                                   ("bwd_time", math.nextafter(MAX_SECONDS, math.inf), "more than a year")]:
        data = base_chain()
        data["stages"][1][field] = value
        with pytest.raises(MemschedError) as excinfo:
            Chain.from_dict(data)
        assert_one_line(excinfo, "stages[1]", fragment)


@pytest.mark.parametrize("bandwidth, accepted", [(0, True), (1.0, True), (2.0**60, True), (0.5, False),
                                                 (2.0**61, False)])
def test_a_chain_channel_is_no_channel_or_one_a_device_can_have(bandwidth, accepted):
    data = {**base_chain(), "transfer": {"d2h_bandwidth": bandwidth, "h2d_bandwidth": 1e9}}
    if accepted:
        assert Chain.from_dict(data).transfer.d2h_bandwidth == bandwidth
    else:
        with pytest.raises(MemschedError) as excinfo:
            Chain.from_dict(data)
        assert_one_line(excinfo, "transfer.d2h_bandwidth", "0 (no channel that way)")


def test_a_utf8_byte_order_mark_is_skipped(tmp_path):
    path = tmp_path / "bom.chain.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(base_chain()).encode())
    assert load_chain(path).name == "tiny"


def test_a_budget_of_a_million_digits_is_refused_at_once():
    import time

    started = time.perf_counter()
    for text in ("1e999999", "1e999999999", "1e999999%"):
        with pytest.raises(MemschedError) as excinfo:
            parse_budget(text, 1000)
        assert_one_line(excinfo, "positive", "1 EiB")
    assert time.perf_counter() - started < 0.1  # was 60 s for 1e999999 (an exact million-digit integer)
    assert parse_budget(str(2**60)) == 2**60
