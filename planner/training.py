"""Training steps, measured: the planned model and the unmodified one, step by step (bytes and seconds).

Each measured window is one forward, loss and backward, opened with gradients
set to ``None`` and the optimizer's state already created; ``optimizer.step()``
runs after it (parameters and optimizer state are outside the budget). Peaks
are counted as the simulator counts them: the inputs plus everything the step
allocates, by the live-memory tracker on CPU and by CUDA's allocator
statistics on a GPU. Times are wall clock with synchronisation.
"""

import time
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_flatten

from profiles.memory import memory_meter, storage_bytes


@dataclass(frozen=True)
class StepMeasure:
    """One measured step: peak bytes, seconds, loss value."""

    peak_bytes: int
    seconds: float
    loss: float


def plain_forward(stages, inputs):
    """The unmodified model: every stage in order, with autograd."""
    activation, extra = inputs[0], inputs[1:]
    for _, module in stages:
        activation = module(activation, *extra)
    return activation


def measure_steps(forward, loss_fn, inputs, parameters, optimizer, steps: int, device) -> list:
    """Run ``steps`` training steps of ``loss_fn(forward(*inputs))``, measuring each.

    On CPU each step runs twice: once under the live-memory tracker for its peak, whose dispatch hook would
    slow it, then once timed; the optimizer steps on the timed run's gradients. On CUDA one run gives both.
    """
    device = torch.device(device)
    input_bytes = storage_bytes([t for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)])

    def step():
        for parameter in parameters:
            parameter.grad = None
        loss = loss_fn(forward(*inputs))
        loss.backward()
        return float(loss.detach())

    measures = []
    for _ in range(steps):
        with memory_meter(device) as meter:
            start = meter.current
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                started = time.perf_counter()
            loss = step()
            peak = meter.peak - start
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            seconds = time.perf_counter() - started
        else:
            started = time.perf_counter()
            loss = step()
            seconds = time.perf_counter() - started
        measures.append(StepMeasure(peak_bytes=peak + input_bytes, seconds=seconds, loss=loss))
        optimizer.step()
    return measures
