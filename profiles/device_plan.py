"""Will a model fit a device it is not on, and how fast: ``memsched plan SPEC --device-spec NAME [--batch auto]``.

:func:`plan_for_device` estimates the model on fake tensors for the target (profiles/estimate.py: sizes exact,
each block rounded as the device's allocator does; times a roofline at the spec's rates, clearly an estimate),
solves its step within what the device leaves beside the setup's resident state
(:func:`solvers.budgets.solve_for_budget`, ``--budget auto``) and predicts the optimizer step: ``accumulate``
micro-batches of the plan, then the optimizer's update, timed as the bytes it reads and writes over the spec's
memory bandwidth (an update is memory-bound: :func:`update_seconds`). ``batch="auto"`` tries micro-batches of 1,
2, 4, ... (each at ``global_batch / micro-batch`` micro-batches when a global batch is given) until one does not
fit or two doublings in a row gain less than 1% of samples per second each, and keeps the smallest micro-batch
within 1% of the most (:func:`best`; a larger one buys almost nothing for its memory): a larger batch that
recomputes can beat a smaller one that does not, which only the predicted times tell.
:func:`target_device` reads ``--device-spec``: a built-in name, a file, or "cpu", this machine measured.
"""

import dataclasses
import os
from typing import NamedTuple, Optional

from planner import render_memory
from planner.chain import load_chain
from planner.devices import device_spec
from planner.errors import MemschedError
from planner.setup import TrainingSetup, account
from planner.setup.training import device_sizes, parameters_of, resident_on_device
from planner.units import describe_bytes, parse_budget
from solvers.budgets import budget_of, device_budget_report, least_budget, solve_within, whole_step_floors

THIS_CPU = "cpu"  # the --device-spec name of this machine's CPU, its rates measured (profiles/cpu_rates.py)
MAX_BATCH = 1 << 16  # the largest micro-batch --batch auto tries
FLAT = 0.01  # a doubling that gains less than this fraction of samples/s gains nothing worth its memory


class Candidate(NamedTuple):
    """One micro-batch size tried: ``batch`` samples per micro-batch, ``accumulate`` micro-batches per optimizer
    step, the model's :class:`profiles.estimate.Estimate` at that batch, the plan (None when it does not fit,
    ``why`` saying so), the device's predicted ``peak`` (bytes: the resident state and the plan's step), and the
    optimizer step's ``seconds`` and ``samples_per_second``."""

    batch: int
    accumulate: int
    estimate: tuple  # profiles.estimate.Estimate: name, parameters, chain
    plan: Optional[object]
    peak: int = 0
    seconds: float = 0.0
    samples_per_second: float = 0.0
    why: str = ""


def target_device(name_or_path, memory_bytes: int = None):
    """The :class:`planner.devices.DeviceSpec` that ``--device-spec`` names: "cpu" is this CPU, its rates measured
    now (:func:`profiles.cpu_rates.cpu_device_spec`) with ``memory_bytes`` bytes (default: the machine's
    physical memory); any other name or file is :func:`planner.devices.device_spec`'s."""
    if str(name_or_path).lower() != THIS_CPU:
        return device_spec(name_or_path)
    from profiles.cpu_rates import cpu_device_spec  # torch: measured only when asked for

    return cpu_device_spec(memory_bytes or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def update_seconds(chain, setup: TrainingSetup, device) -> float:
    """Seconds of one optimizer update on ``device`` (a :class:`planner.devices.DeviceSpec`): the parameters,
    master copy and optimizer state read and written, and the gradients read, over its memory bandwidth."""
    sizes = device_sizes(chain, setup)
    moved = 2 * (sizes["params"] + sizes["master"] + sizes["optimizer"]) + sizes["grads"]
    return moved / device.memory_bandwidth


def candidate(spec: str, batch: int, accumulate: int, device, setup: TrainingSetup, solver: str = "auto",
              device_memory: int = None, budget: str = "auto", autocast: str = None) -> Candidate:
    """The :class:`Candidate` of ``spec`` at micro-batch ``batch`` over ``accumulate`` micro-batches on ``device``
    (its memory, or ``device_memory`` bytes when given), the step within ``budget`` (:func:`judged`)."""
    from profiles.estimate import estimate_chain  # torch: not for memory_report of a chain profile

    estimate = estimate_chain(spec, batch, device_spec=device, autocast=autocast)
    batch = batch or dict(estimate.chain.measured_on.inputs)["0"].shape[0]  # the model's own: its input's first size
    return judged(estimate, batch, accumulate, device, setup, solver, device_memory, budget)


def judged(estimate, batch: int, accumulate: int, device, setup: TrainingSetup, solver: str = "auto",
           device_memory: int = None, budget: str = "auto", **params) -> Candidate:
    """The :class:`Candidate` of a model's ``estimate`` (:class:`profiles.estimate.Estimate`, its chain profiled at
    micro-batch ``batch``) over ``accumulate`` micro-batches on ``device`` (``device_memory`` bytes when given, else
    its memory; less the cuBLAS workspaces it holds, which its peak counts), solved within ``budget``
    (:func:`_solved`; ``params``, the solver's)."""
    chain = estimate.chain
    trained = dataclasses.replace(setup, accumulate=accumulate)
    memory = device.step_memory_bytes(device_memory)
    try:
        plan = _solved(chain, budget, solver, trained, memory, **params)
    except MemschedError as exc:
        return Candidate(batch, accumulate, estimate, None,
                         why=_short(exc, chain, trained, device) if budget == "auto" else str(exc))
    seconds = accumulate * plan.predicted.time + update_seconds(chain, trained, device)
    peak = account(chain, trained, device, plan.predicted.peak_bytes).total
    return Candidate(batch, accumulate, estimate, plan, peak, seconds, batch * accumulate / seconds)


def _solved(chain, budget: str, solver: str, setup: TrainingSetup, memory: int, **params):
    """The plan of ``chain``'s step within what ``memory`` bytes leave beside the setup's resident state
    (``budget="auto"``), or within ``budget`` (bytes, ``"4GiB"``, or a percentage of the store-all step) when that is
    less."""
    left, how = budget_of(chain, "auto", setup, memory)
    cap = left if budget == "auto" else budget_of(chain, budget, setup)[0]
    return solve_within(chain, min(cap, left), solver, setup, how if left <= cap else None, **params)


def plan_for_device(spec: str, device, batch=None, setup: TrainingSetup = None, solver: str = "auto",
                    global_batch: int = None, device_memory: int = None, budget: str = "auto",
                    autocast: str = None) -> list:
    """The :class:`Candidate` s tried for ``spec`` on ``device`` (:func:`tried_batches`; None: the model's own
    batch), each step within ``budget``."""
    setup = setup or TrainingSetup()
    if budget != "auto":
        parse_budget(budget, 100, what="--budget")  # unreadable is one line before any estimate (a % reads as one)
    return tried_batches(lambda size, accumulate: candidate(spec, size, accumulate, device, setup, solver,
                                                            device_memory, budget, autocast),
                         batch, global_batch, spec, device, device_memory)


def tried_batches(at, batch, global_batch: int, what: str, device, device_memory: int = None) -> list:
    """The :class:`Candidate` s ``at(micro-batch, accumulate)`` gives: one at ``batch``, or for ``batch="auto"``
    micro-batches of 1, 2, 4, ... (dividing ``global_batch`` when given, its quotient the micro-batches
    accumulated) until one does not fit or the samples per second stop growing (:func:`_saturated`). A one-line
    error when even the first does not fit ``device``, saying how much device memory ``what`` needs."""
    if batch != "auto":
        tried = [at(batch, _accumulation(global_batch, batch))]
    else:
        tried, size = [], 1
        while size <= min(MAX_BATCH, global_batch or MAX_BATCH):
            if global_batch is None or global_batch % size == 0:
                tried.append(at(size, _accumulation(global_batch, size)))
                if tried[-1].plan is None or _saturated(tried):
                    break
            size *= 2
    if tried[0].plan is None:
        raise MemschedError(f"{what} does not fit {device.name} at a micro-batch of {tried[0].batch} ({tried[0].why}); "
                            f"the device has {describe_bytes(device_memory or device.memory_bytes)}")
    return tried


def best(tried: list) -> Candidate:
    """The smallest micro-batch within :data:`FLAT` of the most samples per second among those that fit."""
    fits = [c for c in tried if c.plan is not None]
    most = max(c.samples_per_second for c in fits)
    return min((c for c in fits if c.samples_per_second >= (1 - FLAT) * most), key=lambda c: c.batch)


def _saturated(tried: list) -> bool:
    """True when each of the last two doublings gained less than :data:`FLAT` of samples per second."""
    rates = [c.samples_per_second for c in tried[-3:]]
    return len(rates) == 3 and all(later < (1 + FLAT) * earlier for earlier, later in zip(rates, rates[1:]))


def _short(exc: MemschedError, chain, setup: TrainingSetup, device) -> str:
    """Why a candidate does not fit, short: the least device memory its setup needs on ``device`` (the cuBLAS
    workspaces it holds included), else the error."""
    try:
        least = account(chain, setup, device, least_budget(chain, setup)).total
        return f"needs {describe_bytes(least)} of device memory"
    except MemschedError:
        return str(exc)


def _accumulation(global_batch, batch) -> int:
    """Micro-batches per optimizer step: ``global_batch / batch`` (1 without a global batch)."""
    if global_batch is None or batch is None:
        return 1
    if global_batch % batch:
        raise MemschedError(f"--global-batch {global_batch} is not a multiple of the micro-batch {batch}")
    return global_batch // batch


def memory_report(model: str, setup: TrainingSetup, device_memory: int = None, device=None, batch=None,
                  global_batch: int = None, budget: str = "auto", autocast: str = None) -> list:
    """``memsched plan|memory``'s lines for ``model`` (a chain profile's path, or a SPEC estimated on fake
    tensors) under ``setup``: what is resident per device, the budget ``device_memory`` bytes leave for the step
    (default: the ``device`` spec's memory) and what sets the floor; with a target ``device``, the micro-batches
    tried (:func:`plan_for_device`) and the chosen one, whose estimate the rest describes, and when the device is
    this machine's, the chosen plan trained on it, measured beside the prediction (profiles/device_check.py). Each
    step is planned within ``budget`` (``"auto"``: what the device leaves; bytes: no more for the step); a SPEC's
    step runs under ``autocast`` (``"bf16"``, ``"fp16"``; None: none), as the device casts."""
    memory = device_memory or (device and device.memory_bytes)
    flags = (["--global-batch"] if global_batch else []) + (["--batch auto"] if batch == "auto" else []) + (
        [f"--budget {budget}"] if budget != "auto" else [])
    if autocast is not None and model.endswith(".json"):
        raise MemschedError("--autocast captures a SPEC's step under autocast; a chain profile was profiled "
                            "already: profile it with --autocast, or give the SPEC")
    for flag in flags:
        if device is None:
            raise MemschedError(f"{flag} plans the step for a device: give --device-spec")
    tried = None
    if model.endswith(".json"):  # a SPEC names a .py file or a built-in model
        if batch is not None or device is not None:
            raise MemschedError(f"--{'batch' if batch is not None else 'device-spec'} builds a SPEC; a chain profile "
                                "has its batch and its device already")
        chain = load_chain(model)
        parameters = parameters_of(chain)
        lines = [f"chain      {chain.name}: {parameters} trainable parameters (its param_bytes over its parameters' "
                 "element size)"]
    else:
        from profiles.estimate import estimate_chain  # torch: not for a chain profile

        tried = device and plan_for_device(model, device, batch, setup, global_batch=global_batch,
                                           device_memory=device_memory, budget=budget, autocast=autocast)
        chosen = tried and best(tried)
        name, parameters, chain = chosen.estimate if tried else estimate_chain(model, batch, autocast=autocast)
        lines = [f"model      {name}: {parameters} trainable parameters (counted from its modules)"]
    workspace = render_memory.workspace_lines(device, memory) if device else []  # held beside the step
    memory = device.step_memory_bytes(device_memory) if device else memory
    budget = (["give --device-memory (e.g. 80GiB) for the activation budget a device leaves"] if memory is None
              else workspace + device_budget_report(chain, setup, memory, parameters))
    lines += (render_memory.setup_lines(setup, parameters, device_sizes(chain, setup),
                                         resident_on_device(chain, setup)) + budget
              + render_memory.floor_lines(whole_step_floors(chain, setup)))
    if not tried:
        return lines
    from profiles.device_check import measured_lines, present  # torch: trains on the device when it is here

    return (lines + ["", *render_memory.device_plan_lines(device, tried, chosen)]
            + (measured_lines(model, chosen, device, autocast) if present(device) else []))
