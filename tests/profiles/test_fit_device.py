"""``fit(model, inputs, "auto", device_spec=...)``: the live model planned for a device on fake copies of its tensors
(profiles/fake_build.py ``faked_in_place``), its own tensors untouched, the plan's peak measured on the real step."""

import pytest
import torch
from torch import nn

from checks import one_line
from planner import fit
from planner.devices import DEVICES, DeviceSpec
from planner.errors import MemschedError
from planner.execute.live_memory import LiveMemoryTracker
from planner.setup import TrainingSetup
from planner.setup.account import activation_budget
from planner.setup.training import resident_on_device
from profiles.memory import storage_bytes
from solvers import store_all_peak
from solvers.minimum import minimum_budget

QUICK = dict(warmup=0, repeats=1, stage_options=0, progress=False, loss_fn=lambda out: out.square().mean())


def model_and_batch():
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 64)) for _ in range(6)]
    return nn.Sequential(*blocks), torch.randn(1024, 64)  # activations, not gradients, set the peak


def here(memory: int) -> DeviceSpec:
    """This CPU as a device of ``memory`` bytes (its figures only time the estimate)."""
    return DeviceSpec("here", memory, 1e11, 1e11, 1e10, 1e10, 1e10, allocator="cpu")


def test_a_model_fitted_for_a_device_keeps_its_tensors_and_measures_its_prediction(threads):
    model, x = model_and_batch()
    before = {name: (tensor, tensor.clone()) for name, tensor in model.state_dict(keep_vars=True).items()}
    roomy = fit(model, x, "auto", device_spec=here(1 << 30), **QUICK)
    chain = roomy.chain
    assert chain.device.startswith("here (estimated at ")  # profiled on fake tensors
    for name, (tensor, value) in before.items():  # the live tensors are back, unchanged
        assert model.state_dict(keep_vars=True)[name] is tensor and torch.equal(tensor, value), name
    # a device that leaves half-way between the least feasible step and the store-all one: the plan recomputes
    step = (minimum_budget(chain) + store_all_peak(chain)) // 2
    memory = resident_on_device(chain, TrainingSetup()) + step
    fitted = fit(model, x, "auto", device_spec=here(memory), **QUICK)
    assert fitted.plan.budget_bytes == activation_budget(fitted.chain, TrainingSetup(), memory) == step
    assert any(op.kind in ("F_ck", "F_none") for op in fitted.plan.schedule)
    inputs = fitted.discovery.chain_inputs((x,), {})
    with LiveMemoryTracker() as tracker:
        QUICK["loss_fn"](fitted._current.run(*inputs)).backward()
    model.zero_grad(set_to_none=True)
    measured = tracker.peak + storage_bytes(list(inputs))
    assert abs(measured / fitted.predicted.peak_bytes - 1) <= 0.01, (threads, measured, fitted.predicted)


def test_a_cuda_device_counts_its_allocator_blocks_and_its_cublas_workspaces(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    model, x = model_and_batch()
    fitted = fit(model, x, "auto", device_spec="h100-80gb", **QUICK)
    assert fitted.chain.device.startswith("h100-80gb (estimated at ")
    assert all(stage.out_bytes % 512 == 0 and stage.saved_bytes % 512 == 0 for stage in fitted.chain.stages)
    # the device's memory less two threads' 32 MiB cuBLAS workspaces (compute capability 9.0)
    assert fitted.plan.budget_bytes == activation_budget(fitted.chain, TrainingSetup(),
                                                         DEVICES["h100-80gb"].memory_bytes - (64 << 20))


@pytest.mark.parametrize("options, words", [
    (dict(), ["fit budget 'auto'", "device_spec="]),
    (dict(device_spec="tpu-v9"), ["no such device", "h100-80gb"]),
    (dict(device_spec="l4", graph=True), ["device_spec=", "graph=True", "drop one"]),
])
def test_fit_for_a_device_refuses_in_one_line(options, words):
    model, x = model_and_batch()
    with pytest.raises(MemschedError) as caught:
        fit(model, x, "auto", **dict(QUICK, **options))
    line = one_line(caught)
    assert all(word in line for word in words), line
