"""What a chain was measured on (planner/measured_on.py): recorded by the profiler, copied into plans, checked
before a plan runs, and absent (no check) in older files."""

import copy
import dataclasses
import functools
import hashlib
import json

import pytest
import torch
from torch import nn

import cli
from checks import one_error_line, one_line, run
from paths import EXAMPLE, FIXTURES
from planner import Chain, MemschedError, load_chain, load_plan, save_chain, save_plan
from planner.execute.chain import apply_plan
from planner.execute.live_memory import LiveMemoryTracker
from planner.measured_on import MeasuredOn, TensorSpec
from planner.plan import Plan
from profiles.chain_profiler import profile_chain
from profiles.memory import storage_bytes
from profiles.spec import load_model
from solvers import solve, store_all_peak

QUICK = {"warmup": 0, "repeats": 1}
SMALL = "gpt-tiny:layers=3,d=32,heads=2,seq=16,vocab=64"
REFERENCE = FIXTURES / "rotor_L20.json"



def stages_of(middle: int):
    """Three stages 16 -> 32 -> (middle) -> 32 -> 16: the same stage count and interfaces for any ``middle``."""
    torch.manual_seed(0)
    middle_stage = nn.Sequential(nn.Linear(32, middle), nn.Tanh(), nn.Linear(middle, 32))
    return [("stage0", nn.Linear(16, 32)), ("stage1", middle_stage), ("stage2", nn.Linear(32, 16))]


@pytest.fixture(scope="module")
def mlp():
    """``(stages, input, chain, store-all plan)`` of :func:`stages_of` (64) at a batch of 4."""
    stages, x = stages_of(64), torch.randn(4, 16)
    chain = profile_chain(stages, x, **QUICK)
    return stages, x, chain, solve(chain, store_all_peak(chain), "store_all")


@pytest.fixture(scope="module")
def cli_files(tmp_path_factory):
    """SMALL profiled at a batch of 4 by ``memsched profile``, and a plan solved for it."""
    folder = tmp_path_factory.mktemp("measured_on")
    chain, plan = folder / "chain.json", folder / "plan.json"
    assert cli.main(["profile", SMALL, "--batch", "4", "-o", str(chain), "--warmup", "0", "--repeats", "1"]) == 0
    assert cli.main(["solve", str(chain), "--budget", "70%", "-o", str(plan)]) == 0
    return chain, plan


# --------------------------------------------------------------------------------------------------
# Recorded, and kept through the files


def test_the_profiler_records_inputs_and_parameters(mlp):
    stages, x, chain, plan = mlp
    assert chain.measured_on.inputs == (("0", TensorSpec((4, 16), "float32")),)
    assert chain.measured_on.stages[1] == (("0.weight", TensorSpec((64, 32), "float32")),
                                           ("0.bias", TensorSpec((64,), "float32")),
                                           ("2.weight", TensorSpec((32, 64), "float32")),
                                           ("2.bias", TensorSpec((32,), "float32")))
    assert chain.to_dict()["measured_on"]["stages"][0] == {"weight": "float32[32,16]", "bias": "float32[32]"}
    assert plan.measured_on == chain.measured_on  # copied when solving


def test_measured_on_round_trips_through_the_json_files(mlp, tmp_path):
    _, _, chain, plan = mlp
    save_chain(chain, tmp_path / "chain.json")
    save_plan(plan, tmp_path / "plan.json")
    raw = json.loads((tmp_path / "chain.json").read_text())
    assert raw["measured_on"]["inputs"] == {"0": "float32[4,16]"}
    again = load_chain(tmp_path / "chain.json")
    assert again == chain and again.fingerprint() == chain.fingerprint()
    assert json.loads((tmp_path / "plan.json").read_text())["problem"]["measured_on"] == raw["measured_on"]
    assert load_plan(tmp_path / "plan.json").measured_on == chain.measured_on
    # The record is part of the problem: another one gives another fingerprint.
    other = dataclasses.replace(chain, measured_on=MeasuredOn(inputs=(("0", TensorSpec((8, 16), "float32")),),
                                                              stages=chain.measured_on.stages))
    assert other.fingerprint() != chain.fingerprint()


def test_structured_and_extra_inputs_are_recorded_by_path():
    class Pick(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(8, 8)

        def forward(self, inputs, scale):
            return self.linear(inputs["x"]) * inputs["m"] * scale

    x, m, scale = torch.randn(3, 8), torch.ones(3, 8), torch.tensor(2.0)
    chain = profile_chain([Pick()], ({"x": x, "m": m}, scale), **QUICK)
    assert chain.measured_on.to_dict()["inputs"] == {"0['x']": "float32[3,8]", "0['m']": "float32[3,8]",
                                                     "1": "float32[]"}
    chain = Chain.from_dict(json.loads(json.dumps(chain.to_dict())))
    planned = apply_plan([Pick()], solve(chain, store_all_peak(chain), "store_all"), chain)
    with pytest.raises(MemschedError) as excinfo:
        planned({"x": x, "m": torch.ones(3, 1)}, scale)
    assert one_line(excinfo).startswith("input 0['m'] is (3, 8) float32 in the chain, (3, 1) float32 here;")
    with pytest.raises(MemschedError) as excinfo:
        planned({"x": x, "m": m})
    assert one_line(excinfo).startswith("input 1 is () float32 in the chain, not given here;")
    planned({"x": x, "m": m}, scale).sum().backward()


def test_a_pipeline_plan_carries_the_record(mlp):
    from solvers.partition import partition

    _, _, chain, _ = mlp
    plan = partition(chain, 2, 1 << 40, 2)
    assert plan.measured_on == chain.measured_on
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))).measured_on == chain.measured_on


# --------------------------------------------------------------------------------------------------
# Older files: valid as they were, not checked


def _canonical_fingerprint(raw: dict) -> str:
    """The fingerprint of a chain file as its format defines it, from the file's own JSON (not the loader's)."""
    problem = {key: value for key, value in raw.items() if key != "transfer"}
    problem.setdefault("loss", {"bwd_time": 0.0, "tmp_bytes": 0})
    for stage in problem["stages"]:
        stage.setdefault("nograd_tmp_bytes", stage.get("fwd_tmp_bytes", 0))
    return "sha256:" + hashlib.sha256(json.dumps(problem, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def test_older_chain_files_load_unchanged_and_their_plans_carry_no_record(tmp_path):
    raws = [json.loads(EXAMPLE.read_text()), json.loads(REFERENCE.read_text())["chain"]]
    for raw in raws:
        chain = Chain.from_dict(copy.deepcopy(raw))
        assert chain.measured_on is None and "measured_on" not in chain.to_dict()
        assert chain.fingerprint() == _canonical_fingerprint(copy.deepcopy(raw))
        plan = solve(chain, int(0.6 * store_all_peak(chain)), "rotor")
        assert plan.measured_on is None
        save_plan(plan, tmp_path / "plan.json")
        written = json.loads((tmp_path / "plan.json").read_text())
        assert written["problem"] == {"name": chain.name, "fingerprint": chain.fingerprint()}
        assert load_plan(tmp_path / "plan.json") == plan


def test_a_chain_and_plan_without_the_record_run_unchecked(mlp):
    stages, x, chain, _ = mlp
    old = dataclasses.replace(chain, measured_on=None)  # as an older memsched wrote it
    plan = Plan.from_dict(json.loads(json.dumps(solve(old, store_all_peak(old), "store_all").to_dict())))
    assert plan.measured_on is None
    apply_plan(stages, plan)(torch.randn(8, 16)).sum().backward()  # another batch: nothing to check it against
    apply_plan(stages, plan, old)(torch.randn(8, 16)).sum().backward()


def test_train_by_an_older_chain_file_notes_it_is_not_checked(cli_files, capsys, tmp_path):
    chain, _ = cli_files
    raw = json.loads(chain.read_text())
    del raw["measured_on"]
    old = tmp_path / "old.json"
    old.write_text(json.dumps(raw))
    status, out, _ = run(capsys, "train", SMALL, "--chain", old, "--batch", "4", "--budget", "70%", "--steps", "1")
    assert status == 0
    assert f"note: the chain {old} records no input or parameter shapes" in out


# --------------------------------------------------------------------------------------------------
# Refused in one line, before any step


def test_train_at_another_batch_is_refused_naming_the_input(cli_files, capsys):
    chain, plan = cli_files
    line = one_error_line(*run(capsys, "train", SMALL, "--chain", chain, "--batch", "8", "--budget", "60%"))
    assert line == (f"memsched: error: input 0 is (4, 16) int64 in the chain {chain}, (8, 16) int64 here; "
                    "profile again at this batch or pass --batch 4")
    line = one_error_line(*run(capsys, "train", SMALL, "--plan", plan, "--batch", "8"))
    assert f"input 0 is (4, 16) int64 in the plan {plan}, (8, 16) int64 here;" in line and "--batch 4" in line
    line = one_error_line(*run(capsys, "train", SMALL.replace("seq=16", "seq=32"), "--plan", plan, "--batch", "4"))
    assert "stage 0 (embed): parameter pos.weight is (16, 32) float32 in the plan" in line  # another model


def test_train_at_the_recorded_batch_runs(cli_files, capsys):
    chain, plan = cli_files
    status, out, _ = run(capsys, "train", SMALL, "--plan", plan, "--chain", chain, "--batch", "4", "--steps", "1")
    assert status == 0 and "measured peak" in out and "note:" not in out


def test_another_models_plan_of_the_same_stage_count_is_refused(mlp):
    _, _, chain, plan = mlp
    other = stages_of(48)
    with pytest.raises(MemschedError) as excinfo:
        apply_plan(other, plan)
    assert one_line(excinfo).startswith(
        "stage 1 (stage1): parameter 0.weight is (64, 32) float32 in the plan, (48, 32) float32 in the model; ")
    with pytest.raises(MemschedError) as excinfo:
        apply_plan(other, plan, chain)
    assert "stage 1 (stage1): parameter 0.weight is (64, 32) float32 in the chain" in one_line(excinfo)
    no_bias = [other[0], ("stage1", nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 32, bias=False))),
               other[2]]
    with pytest.raises(MemschedError) as excinfo:
        apply_plan(no_bias, plan)
    assert one_line(excinfo).startswith("stage 1 (stage1): 4 parameters in the plan, 3 in the model (the first "
                                        "extra one: 2.bias (32,) float32 in the plan); ")


def test_a_wrapped_stage_matches_by_position(mlp):
    stages, x, _, plan = mlp
    wrapped = [stages[0], stages[1], ("stage2", nn.Sequential(stages[2][1], nn.Identity()))]  # names now 0.weight...
    apply_plan(wrapped, plan)(x).sum().backward()


def test_other_dtypes_are_refused(mlp):
    stages, x, _, plan = mlp
    doubled = [(name, copy.deepcopy(module).double()) for name, module in stages]
    with pytest.raises(MemschedError) as excinfo:
        apply_plan(doubled, plan)
    assert one_line(excinfo).startswith(
        "stage 0 (stage0): parameter weight is (32, 16) float32 in the plan, (32, 16) float64 in the model; ")
    planned = apply_plan(stages, plan)
    with pytest.raises(MemschedError) as excinfo:
        planned(x.double())
    assert one_line(excinfo).startswith("input 0 is (4, 16) float32 in the plan, (4, 16) float64 here; ")


def test_the_input_is_checked_at_the_first_call_with_gradients(mlp):
    stages, x, _, plan = mlp
    planned = apply_plan(stages, plan)
    with torch.no_grad():
        planned(torch.randn(8, 16))  # inference runs no schedule
    with pytest.raises(MemschedError) as excinfo:
        planned(torch.randn(8, 16))
    assert "input 0 is (4, 16) float32 in the plan, (8, 16) float32 here" in one_line(excinfo)
    for _, module in stages:
        module.zero_grad(set_to_none=True)
    planned(x).sum().backward()
    planned(torch.randn(2, 16)).sum().backward()  # later calls: a last, smaller batch runs


def test_run_pipeline_refuses_another_micro_batch_before_starting(mlp):
    from planner.execute.pipeline import run_pipeline
    from profiles.memory import memory_meter
    from profiles.spec import built_model
    from solvers.partition import partition

    spec = "mlp:layers=4,width=16"
    model, _ = load_model(spec, batch=2)
    chain = profile_chain(model.stages, model.example_inputs, loss_fn=model.loss_fn, **QUICK)
    plan = partition(chain, 2, 1 << 40, 2)
    with pytest.raises(MemschedError) as excinfo:
        run_pipeline(functools.partial(built_model, spec, batch=8), plan, 1, meter=memory_meter)
    assert one_line(excinfo) == ("input 0 is (2, 16) float32 in the plan, (4, 16) float32 here; the batch splits "
                                 "into micro-batches of 4: pass --batch 4, or profile at a batch of 4")


# --------------------------------------------------------------------------------------------------
# Malformed records


@pytest.mark.parametrize(("change", "words"), [
    (lambda m: m["stages"].pop(), "measured_on.stages describes 2 stages but the chain has 3"),
    (lambda m: m["inputs"].update({"0": "float32[4,x]"}), "measured_on.inputs['0'] must be a tensor's dtype and sizes"),
    (lambda m: m["stages"][0].update({"weight": [32, 16]}), "measured_on.stages[0]['weight'] must be"),
    (lambda m: m.update({"buffers": {}}), "measured_on: unknown field 'buffers'"),
    (lambda m: m.pop("inputs"), "measured_on: missing field 'inputs'"),
])
def test_a_malformed_record_is_refused_in_one_line(mlp, change, words):
    _, _, chain, plan = mlp
    raw = chain.to_dict()
    change(raw["measured_on"])
    with pytest.raises(MemschedError) as excinfo:
        Chain.from_dict(raw, "c.json")
    assert words in one_line(excinfo)
    raw = plan.to_dict()
    change(raw["problem"]["measured_on"])
    if "describes" not in words:  # a plan's stage count is checked against the model, not here
        with pytest.raises(MemschedError) as excinfo:
            Plan.from_dict(raw, "p.json")
        assert "p.json: problem.measured_on" in one_line(excinfo)


# --------------------------------------------------------------------------------------------------
# The good case: checked, then measured as predicted


@pytest.fixture(scope="module")
def gpt():
    model, _ = load_model("gpt-tiny:layers=4,d=32,heads=2,seq=32,vocab=64,batch=4,dropout=0")
    chain = profile_chain(model.stages, model.example_inputs, loss_fn=model.loss_fn, **QUICK)
    return model, chain


@pytest.mark.parametrize("threads", [None, 1])
def test_a_matching_plan_runs_and_peaks_as_predicted(gpt, threads):
    model, chain = gpt
    plan = Plan.from_dict(json.loads(json.dumps(solve(chain, int(0.5 * store_all_peak(chain)), "rotor").to_dict())))
    assert plan.recomputed_forwards > 0 and plan.measured_on == chain.measured_on
    planned = apply_plan(model.stages, plan)  # no chain: the plan's record is checked
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        with LiveMemoryTracker() as tracker:
            model.loss_fn(planned(*model.example_inputs)).backward()
    finally:
        torch.set_num_threads(before)
        for _, module in model.stages:
            module.zero_grad(set_to_none=True)
    measured = tracker.peak + storage_bytes([t for t in model.example_inputs if isinstance(t, torch.Tensor)])
    assert abs(measured / plan.predicted.peak_bytes - 1) <= 0.05, (measured, plan.predicted.peak_bytes)


def test_a_graph_plan_is_refused_by_the_chain_executor(mlp, capsys, tmp_path):
    from planner.ops import GraphOp
    from planner.plan import Predicted

    stages, _, _, _ = mlp
    graph_plan = Plan(problem_name="g", fingerprint="sha256:0", solver="checkmate", budget_bytes=1,
                      predicted=Predicted(peak_bytes=1, time=0.0, baseline_time=0.0),
                      schedule=(GraphOp("compute", 0),), kind="graph")
    with pytest.raises(MemschedError) as excinfo:
        apply_plan(stages, graph_plan)
    assert "apply_plan runs plans of kind 'chain', not of kind 'graph'" in one_line(excinfo)
    save_plan(graph_plan, tmp_path / "graph-plan.json")
    line = one_error_line(*run(capsys, "train", SMALL, "--plan", tmp_path / "graph-plan.json"))
    assert "is a graph plan: train by it with --graph GRAPH.json" in line
