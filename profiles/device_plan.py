"""Will a model fit a device it is not on, and how fast: ``memsched plan SPEC --device-spec NAME [--batch auto]``.

:func:`plan_for_device` estimates the model on fake tensors for the target (profiles/estimate.py: sizes exact,
each block rounded as the device's allocator does; times estimated from the spec's throughput, clearly an
estimate), solves its step within what the device leaves beside the setup's resident state
(:func:`solvers.budgets.solve_for_budget`, ``--budget auto``) and predicts the optimizer step: ``accumulate``
micro-batches of the plan, then the optimizer's update, timed as the bytes it reads and writes over the spec's
memory bandwidth (an update is memory-bound: :func:`update_seconds`). ``batch="auto"`` tries micro-batches of 1,
2, 4, ... until one does not fit, each at ``global_batch / micro-batch`` micro-batches when a global batch is
given, and keeps the most samples per second: a larger batch that recomputes can beat a smaller one that does
not, which only the predicted times tell.
"""

import dataclasses
from typing import NamedTuple, Optional

from planner.errors import MemschedError
from planner.setup import TrainingSetup
from planner.setup.training import device_sizes, resident_on_device
from profiles.estimate import estimate_chain
from solvers.budgets import solve_for_budget

MAX_BATCH = 1 << 16  # the largest micro-batch --batch auto tries


class Candidate(NamedTuple):
    """One micro-batch size tried: ``batch`` samples per micro-batch, ``accumulate`` micro-batches per optimizer
    step, the plan (None when it does not fit, ``why`` saying so), the device's predicted ``peak`` (bytes: the
    resident state and the plan's step), and the optimizer step's ``seconds`` and ``samples_per_second``."""

    batch: int
    accumulate: int
    plan: Optional[object]
    peak: int = 0
    seconds: float = 0.0
    samples_per_second: float = 0.0
    why: str = ""


def update_seconds(chain, setup: TrainingSetup, device) -> float:
    """Seconds of one optimizer update on ``device`` (a :class:`planner.devices.DeviceSpec`): the parameters,
    master copy and optimizer state read and written, and the gradients read, over its memory bandwidth."""
    sizes = device_sizes(chain, setup)
    moved = 2 * (sizes["params"] + sizes["master"] + sizes["optimizer"]) + sizes["grads"]
    return moved / device.memory_bandwidth


def candidate(spec: str, batch: int, accumulate: int, device, setup: TrainingSetup, solver: str = "auto",
              device_memory: int = None) -> Candidate:
    """The :class:`Candidate` of ``spec`` at micro-batch ``batch`` over ``accumulate`` micro-batches on ``device``
    (its memory, or ``device_memory`` bytes when given)."""
    chain = estimate_chain(spec, batch, device_spec=device).chain
    batch = batch or dict(chain.measured_on.inputs)["0"].shape[0]  # the model's own: its input's first size
    trained = dataclasses.replace(setup, accumulate=accumulate)
    memory = device.memory_bytes if device_memory is None else device_memory
    try:
        plan, _ = solve_for_budget(chain, "auto", solver, trained, memory)
    except MemschedError as exc:
        return Candidate(batch, accumulate, None, why=str(exc))
    seconds = accumulate * plan.predicted.time + update_seconds(chain, trained, device)
    return Candidate(batch, accumulate, plan, resident_on_device(chain, trained) + plan.predicted.peak_bytes,
                     seconds, batch * accumulate / seconds)


def plan_for_device(spec: str, device, batch=None, setup: TrainingSetup = None, solver: str = "auto",
                    global_batch: int = None, device_memory: int = None) -> list:
    """The :class:`Candidate` s tried for ``spec`` on ``device``: one at ``batch`` (None: the model's own), or
    for ``batch="auto"`` micro-batches of 1, 2, 4, ... (dividing ``global_batch`` when given) until one does not
    fit. A one-line error when even the first does not fit, saying what sets the floor."""
    setup = setup or TrainingSetup()
    if batch != "auto":
        tried = [candidate(spec, batch, _accumulation(global_batch, batch), device, setup, solver, device_memory)]
    else:
        tried, size = [], 1
        while size <= min(MAX_BATCH, global_batch or MAX_BATCH):
            if global_batch is None or global_batch % size == 0:
                tried.append(candidate(spec, size, _accumulation(global_batch, size), device, setup, solver,
                                       device_memory))
                if tried[-1].plan is None:
                    break
            size *= 2
    if tried[0].plan is None:
        raise MemschedError(f"{spec} does not fit {device.name} at a micro-batch of {tried[0].batch}: "
                            f"{tried[0].why}")
    return tried


def best(tried: list) -> Candidate:
    """The candidate with the most samples per second (the smallest batch on a tie)."""
    return max((c for c in tried if c.plan is not None), key=lambda c: (c.samples_per_second, -c.batch))


def _accumulation(global_batch, batch) -> int:
    """Micro-batches per optimizer step: ``global_batch / batch`` (1 without a global batch)."""
    if global_batch is None or batch is None:
        return 1
    if global_batch % batch:
        raise MemschedError(f"--global-batch {global_batch} is not a multiple of the micro-batch {batch}")
    return global_batch // batch
