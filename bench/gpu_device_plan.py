"""bench/gpu_check.py's device-plan section: what ``memsched plan --device-spec`` predicts for the GPU this runs on,
from its built-in spec (fake tensors, the caching allocator's blocks, the cuBLAS workspaces, a roofline for time),
beside what that GPU measures.

1. The cuBLAS workspace rule (planner/blas_workspace.py): the bytes one training step of a linear layer leaves
   allocated, from freed workspaces, against the rule for this GPU's compute capability.
2. ``memsched plan SPEC --device-spec NAME --batch auto`` (profiles/device_plan.py's ``memory_report``) with the
   built-in spec of this GPU (:func:`builtin_for`): its table, and its chosen plan trained on the GPU for a few
   steps (profiles/device_check.py), the peak and the step's time measured against predicted.
"""

import re

import torch
from torch import nn

from planner.blas_workspace import blas_workspace
from planner.devices import DEVICES
from planner.setup import TrainingSetup
from profiles.device_plan import memory_report

DEVICE_PLAN_SPEC = "gpt-tiny:layers=12,d=384,heads=6,seq=512,vocab=2048"


def builtin_for(name: str, total_memory: int):
    """The name of the built-in spec (planner/devices.py) of the GPU CUDA calls ``name`` with ``total_memory``
    bytes, or None when none is its model."""
    name = name.lower()
    for marker, spec in ((r"h200", "h200-141gb"), (r"4090", "rtx-4090"), (r"\bl4\b", "l4")):  # not an L40S
        if re.search(marker, name):
            return spec
    if "h100" in name:
        return "h100-pcie-80gb" if "pcie" in name else "h100-80gb"
    if "a100" in name:
        return "a100-80gb" if total_memory > 60 * 2 ** 30 else "a100-40gb"
    return None


def cublas_workspace_line(device: torch.device) -> tuple:
    """``(line, matches)``: the bytes one step of a linear layer leaves allocated from freed cuBLAS workspaces,
    against planner/blas_workspace.py's rule for ``device``'s compute capability."""
    torch.manual_seed(0)
    layer = nn.Linear(256, 256, device=device)  # with a bias: addmm, cuBLASLt's path
    x = torch.randn(64, 256, device=device, requires_grad=True)
    for tensor in (layer.weight, layer.bias, x):  # gradients made beforehand: the step only adds into them
        tensor.grad = torch.zeros_like(tensor)
    torch.cuda.synchronize(device)
    torch._C._cuda_clearCublasWorkspaces()
    before = torch.cuda.memory_allocated(device)
    layer(x).square().sum().backward()
    torch.cuda.synchronize(device)
    held = torch.cuda.memory_allocated(device) - before
    major, minor = torch.cuda.get_device_capability(device)
    rule = blas_workspace("cuda", f"{major}.{minor}")
    return (f"cuBLAS workspaces after one step: {held} bytes measured, {rule.held} predicted ({rule.why}): "
            f"{'match' if held == rule.held else 'DIFFER'}", held == rule.held)


def device_plan_lines(device: torch.device, spec: str = DEVICE_PLAN_SPEC) -> list:
    """``memsched plan SPEC --device-spec NAME --batch auto``'s lines for this GPU's built-in spec: the table and,
    the GPU being here, the chosen plan measured beside its prediction; one line when no built-in spec is its."""
    properties = torch.cuda.get_device_properties(device)
    name = builtin_for(properties.name, properties.total_memory)
    if name is None:
        return [f"no built-in spec is a {properties.name}: the device plan is not checked"]
    with torch.cuda.device(device):
        return memory_report(spec, TrainingSetup(), device=DEVICES[name], batch="auto")
