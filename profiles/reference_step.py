"""One plain training step of the unmodified model: the measurement a profile is checked against.

Every stage runs with autograd in order, then the loss and one backward
through everything: exactly what the store-all schedule models. Used by the
fidelity tests and ``bench/profile_fidelity.py``.
"""

import statistics
import time

import torch
from torch.utils._pytree import tree_flatten

from planner.execute.stages import default_loss, run_stages
from profiles.memory import memory_meter, storage_bytes


def _run(model) -> None:
    """``loss_fn(model(x)).backward()``: as usual, nothing but autograd holds the model's output."""
    (model.loss_fn or default_loss)(run_stages(model.stages, model.example_inputs)).backward()


def _parameters(model) -> list:
    return [p for _, m in model.stages if isinstance(m, torch.nn.Module) for p in m.parameters()]


def measured_peak(model, device="cpu") -> int:
    """Peak bytes of one step, counted as the simulator counts: the inputs plus everything the step allocates.

    Gradients start as ``None``; parameters and optimizer state are outside (resident before the step).
    """
    for parameter in _parameters(model):
        parameter.grad = None
    inputs = [t for t in tree_flatten(model.example_inputs)[0] if isinstance(t, torch.Tensor)]
    with memory_meter(device) as meter:
        start = meter.current
        _run(model)
        peak = meter.peak - start
    for parameter in _parameters(model):
        parameter.grad = None
    return peak + storage_bytes(inputs)


def measured_step_time(model, device="cpu", warmup=2, repeats=5, statistic=statistics.median) -> float:
    """Median (or another ``statistic``) seconds of one step (forward, loss, backward) after ``warmup`` steps."""
    samples = []
    for run in range(warmup + repeats):
        for parameter in _parameters(model):
            parameter.grad = None
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        _run(model)
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
        if run >= warmup:
            samples.append(time.perf_counter() - started)
    for parameter in _parameters(model):
        parameter.grad = None
    return statistic(samples)
