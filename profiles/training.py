"""Training steps, measured: the planned model and the unmodified one, step by step (bytes and seconds).

The two are measured alternately (:func:`measure_alternately`), so that a load
on the machine that comes and goes slows both alike rather than one of them.

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


def autograd_step(forward, loss_fn, inputs):
    """A step for :func:`measure_steps`: ``loss_fn(forward(*inputs)).backward()``, returning the loss."""
    def step():
        loss = loss_fn(forward(*inputs))
        loss.backward()
        return loss

    return step


def measure_steps(step, parameters, optimizer, steps: int, device, resident_bytes: int) -> list:
    """Run ``steps`` training steps, measuring each; ``step()`` runs forward, loss and backward, returns the loss.

    A peak is ``resident_bytes`` (what the prediction counts as already there: the inputs for a chain, the
    graph's ``fixed_bytes`` for a graph) plus what the step allocates. On CPU each step runs twice: once under
    the live-memory tracker for its peak, whose dispatch hook would slow it, then once timed; the optimizer
    steps on the timed run's gradients. On CUDA one run gives both.
    """
    device = torch.device(device)

    def fresh_step():
        for parameter in parameters:
            parameter.grad = None
        return float(step().detach())

    measures = []
    for _ in range(steps):
        with memory_meter(device) as meter:
            start = meter.current
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                started = time.perf_counter()
            loss = fresh_step()
            peak = meter.peak - start
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            seconds = time.perf_counter() - started
        else:
            started = time.perf_counter()
            loss = fresh_step()
            seconds = time.perf_counter() - started
        measures.append(StepMeasure(peak_bytes=peak + resident_bytes, seconds=seconds, loss=loss))
        optimizer.step()
    return measures


def measure_alternately(planned_step, plain_step, parameters, optimizer, steps: int, device,
                        resident_bytes: int) -> tuple:
    """``(planned, plain)``: ``steps`` measures of each (:class:`StepMeasure`), taken planned, plain, planned,
    plain, ... each as :func:`measure_steps` takes one (its peak in a window of its own, then its time), each
    followed by its optimizer step."""
    planned, plain = [], []
    for _ in range(steps):
        planned += measure_steps(planned_step, parameters, optimizer, 1, device, resident_bytes)
        plain += measure_steps(plain_step, parameters, optimizer, 1, device, resident_bytes)
    return planned, plain


def input_bytes(inputs) -> int:
    """Bytes of the distinct storages of the tensors in ``inputs``."""
    return storage_bytes([t for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)])
