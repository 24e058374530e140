"""Sizes, the exact half of a plan for a device (issue 31): a model estimated on fake tensors for this CPU as a
device (``--device-spec cpu``: profiles/cpu_rates.py's measured spec, storages as they are), solved at a budget
halfway between its least and its store-all peak (so that it recomputes), then that plan's first training step
run on the real model by the chain executor: the measured peak is the predicted one within 1%, for the built-in
models and the Hugging Face tiny GPT-2, Llama and BERT, at the machine's thread count and at one thread."""

import pytest

from discovery_models import MODELS
from paths import ROOT
from planner.execute.chain import apply_plan
from planner.execute.live_memory import LiveMemoryTracker
from profiles.estimate import estimate_chain
from profiles.memory import storage_bytes
from profiles.spec import load_model
from solvers import solve, store_all_peak
from solvers.minimum import minimum_budget

ZOO = ["mlp:layers=4,width=64,batch=512", "gpt-tiny:layers=2,d=32,heads=2,seq=16,vocab=64,batch=4",
       "resnet-tiny:blocks=2,channels=8,size=16,batch=4"]
HF = [f"{ROOT / 'tests' / 'discovery_models.py'}:{name}" for name in ("gpt2", "llama", "bert")]


@pytest.fixture(scope="module")
def this_cpu():
    from profiles.cpu_rates import cpu_device_spec

    return cpu_device_spec(2 << 30, repeats=1)


@pytest.mark.slow
@pytest.mark.parametrize("spec", ZOO + HF, ids=lambda spec: spec.split(":")[-1 if spec in HF else 0])
def test_a_plan_estimated_for_this_cpu_measures_its_predicted_peak(spec, this_cpu, threads):
    if spec in HF:
        pytest.importorskip("transformers")
        assert spec.rsplit(":", 1)[1] in MODELS
    chain = estimate_chain(spec, device_spec=this_cpu).chain
    assert chain.device.startswith("this-cpu (estimated at ")
    low, high = minimum_budget(chain), store_all_peak(chain)
    plan = solve(chain, (low + high) // 2)
    assert plan.recomputed_forwards > 0, (spec, low, high)
    model, _ = load_model(spec)  # the real model, built anew: its first step
    planned = apply_plan(model.stages, plan, chain)
    with LiveMemoryTracker() as tracker:
        model.loss_fn(planned(*model.example_inputs)).backward()
    measured = tracker.peak + storage_bytes(list(model.example_inputs))
    ratio = measured / plan.predicted.peak_bytes
    print(f"{spec}, {threads} threads: {len(chain.stages)} stages, least {low} B, store-all {high} B, {plan.solver} "
          f"predicted {plan.predicted.peak_bytes} B, measured {measured} B (ratio {ratio:.4f})")
    assert abs(ratio - 1) <= 0.01, (spec, threads, measured, plan.predicted.peak_bytes, ratio)
