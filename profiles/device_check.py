"""The estimate against the device itself, when it is here: ``memsched plan SPEC --device-spec cpu`` (or a CUDA
spec on a machine with CUDA) trains the chosen plan for a few steps and prints what was predicted from the spec
beside what was measured, so the estimate's error is known.

:func:`measured_lines` builds the real model at the chosen micro-batch, applies the plan solved on its estimated
chain (planner.execute.chain.apply_plan: the same stages, checked against what the estimate ran on) and measures
its steps as ``memsched train`` does (profiles/training.py: the peak of each step's window, the step's seconds with
the optimizer's update). On CUDA the cuBLAS workspaces are freed first, as a fresh process has none: the first
step allocates them (planner/blas_workspace.py), so its peak holds them and the prediction counts them. Only the
device the spec describes is measured: this CPU for ``cpu``; for a CUDA spec, the GPU CUDA gives, whatever its
model (the line names it).
"""

import statistics

import torch

from planner.units import describe_bytes
from profiles.cpu_rates import THIS_CPU_NAME
from profiles.spec import load_model
from profiles.training import train_chain_plan

MEASURED_STEPS = 3


def present(device) -> str:
    """Where ``device`` (a :class:`planner.devices.DeviceSpec`) is on this machine: ``"cpu"`` for this CPU's
    spec, ``"cuda"`` for a CUDA spec when CUDA is available, else ``""`` (not here: nothing to measure)."""
    if device.allocator == "cpu" and device.name == THIS_CPU_NAME:
        return "cpu"
    return "cuda" if device.allocator == "cuda" and torch.cuda.is_available() else ""


def measured_lines(spec: str, chosen, device, autocast: str = None, steps: int = MEASURED_STEPS) -> list:
    """Predicted against measured for the candidate ``chosen`` (profiles/device_plan.py) of ``spec`` on
    ``device``, trained ``steps`` steps where :func:`present` says it is: the step's peak and the optimizer
    step's seconds and samples per second, each with the measured over the predicted (its step captured under
    ``autocast``, as the estimate's was: its casts are the stages' own). The predicted peak is the
    plan's and the cuBLAS workspaces the first step allocates (:meth:`planner.devices.DeviceSpec.blas_workspace`:
    the autograd thread's from the first matmul of the backward, where a step's peak usually is)."""
    where = present(device)
    if where == "cuda":
        torch._C._cuda_clearCublasWorkspaces()  # as in a fresh process: the first measured step allocates them
    model, _ = load_model(spec, batch=chosen.batch, autocast=autocast, device_spec=device)
    comparison = train_chain_plan(model, chosen.plan, chosen.estimate.chain, steps, where, whole_step=True)
    peak = max(step.peak_bytes for step in comparison.planned)
    seconds = statistics.median(step.seconds for step in comparison.planned)
    label = torch.cuda.get_device_name() if where == "cuda" else "this CPU"
    samples = chosen.batch * chosen.accumulate / seconds
    predicted = chosen.plan.predicted.peak_bytes + device.blas_workspace().held
    return [f"measured   on {label}, micro-batch {chosen.batch} x {chosen.accumulate}, {steps} steps: "
            f"step peak {describe_bytes(peak)}, predicted {describe_bytes(predicted)} "
            f"({peak / predicted:.4f}); {seconds:.4g} s per optimizer step, predicted "
            f"{chosen.seconds:.4g} s ({seconds / chosen.seconds:.2f}); {samples:.4g} samples/s, predicted "
            f"{chosen.samples_per_second:.4g} ({samples / chosen.samples_per_second:.2f})"]
