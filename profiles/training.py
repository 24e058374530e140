"""Training steps, measured: the planned model and the unmodified one, step by step (bytes and seconds).

:func:`train_and_compare` trains by a planned step and, for reference, the
unmodified model; the two are measured alternately (:func:`measure_alternately`),
so that a load on the machine that comes and goes slows both alike.

Each measured window is one forward, loss and backward, opened with gradients
set to ``None`` and the optimizer's state already created; ``optimizer.step()``
runs after it (parameters and optimizer state are outside the budget), or inside
it for a plan whose update is in the backward (planner/execute/updates.py). A plan
accumulating gradients over micro-batches (planner/accumulate.py) runs that many
windows per step, each after the gradients the ones before it left (counted). Peaks
are counted as the simulator counts them: the inputs plus everything the step
allocates, by the live-memory tracker on CPU and by CUDA's allocator
statistics on a GPU. Times are wall clock with synchronisation.
"""

import copy
import functools
import time
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_flatten

from planner.execute.chain import apply_plan
from planner.execute.records import input_specs, stage_specs
from planner.execute.stages import default_loss, named_stages, run_stages, trainable_parameters
from planner.execute.updates import state_tensors
from planner.render import say_on_stderr
from planner.setup import Run, TrainingSetup, check
from planner.simulate import micro_batch_peaks
from profiles.chain_profiler import profile_chain
from profiles.memory import memory_meter, storage_bytes
from profiles.options import DEFAULT_OPTIONS
from profiles.spec import built_model


@dataclass(frozen=True)
class StepMeasure:
    """One measured step: peak bytes, seconds, loss value."""

    peak_bytes: int
    seconds: float
    loss: float
    micro_batch_peaks: tuple = ()  # bytes, each micro-batch's peak when gradients accumulate over several


@dataclass(frozen=True)
class Comparison:
    """Steps by a plan and of the unmodified model, measured alternately: a :class:`StepMeasure` per step."""

    planned: list
    plain: list
    resident_bytes: int = 0  # the planned model's parameters and optimizer state on the device (Learner's)
    predicted_micro_batches: tuple = ()  # bytes: each micro-batch's predicted peak when gradients accumulate


def autograd_step(forward, loss_fn, inputs):
    """A step for :func:`measure_steps`: ``loss_fn(forward(*inputs)).backward()``, returning the loss."""
    def step():
        loss = loss_fn(forward(*inputs))
        loss.backward()
        return loss

    return step


class Learner:
    """How a measured step's model learns: the ``parameters`` whose gradients each step starts without, and
    either ``optimizer`` (stepped after each step) or ``updates`` (a
    :class:`planner.execute.updates.StageUpdates`: the step updates inside its backward, and a run that must not
    count as a training step is rewound). ``timed_update``: the seconds of a step include its update (the
    whole step, as an update inside the backward's do). ``max_grad_norm``: the gradients are clipped to that
    global norm before the optimizer steps, which needs every gradient first: refused with ``updates``."""

    def __init__(self, parameters, optimizer=None, updates=None, timed_update: bool = False, max_grad_norm=None):
        if updates is not None:  # (planner/setup/rules.py: clipping needs every gradient before any update)
            check(TrainingSetup(update=updates.update), Run(clipping=max_grad_norm is not None))
        self.parameters, self.optimizer, self.updates = parameters, optimizer, updates
        self.timed_update = timed_update or updates is not None
        self.max_grad_norm = max_grad_norm

    def update(self) -> None:
        """After a step: the optimizer's update (none when the step made it), the gradients clipped first."""
        if self.optimizer is not None:
            if self.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(self.parameters, self.max_grad_norm)
            self.optimizer.step()

    def resident_bytes(self) -> int:
        """Bytes of the storages of the parameters and of the optimizer state on their device (an update on the
        host keeps its state there: not counted), as they are now."""
        optimizers = [self.optimizer] if self.optimizer is not None else self.updates.device_optimizers()
        return storage_bytes(list(self.parameters) + state_tensors(optimizers))


def measure_steps(step, learner: Learner, steps: int, device, resident_bytes: int, compiled: bool = False,
                  accumulate: int = 1) -> list:
    """Run ``steps`` training steps of ``learner`` (:class:`Learner`), measuring each; ``step()`` runs forward,
    loss and backward, returns the loss.

    A peak is ``resident_bytes`` (what the prediction counts as already there: the inputs for a chain, the
    graph's ``fixed_bytes`` for a graph) plus what the step allocates. On CPU each step runs twice: once under
    the live-memory tracker for its peak (``compiled`` code: torch.profiler's memory events, which see inside
    it), whose hooks would slow it, then once timed; the update uses the timed run's gradients (an update inside
    the backward made by the tracked run is undone first). On CUDA one run gives both. ``accumulate``: a step is
    that many micro-batches whose gradients add up before the update, each measured in a window of its own with
    the gradients the ones before it left counted (``micro_batch_peaks``); its peak is their largest, its seconds
    theirs together, its loss their mean.
    """
    device = torch.device(device)

    def fresh_step(first: bool = True):
        for parameter in learner.parameters if first else ():
            parameter.grad = None
        return float(step().detach())

    measures = []
    for _ in range(steps):
        saved = learner.updates.saved() if learner.updates is not None and device.type != "cuda" else None
        peaks, losses = [], []
        for micro_batch in range(accumulate):
            held = storage_bytes([p.grad for p in learner.parameters if p.grad is not None]) if micro_batch else 0
            with memory_meter(device, compiled) as meter:
                start = meter.current
                if device.type == "cuda" and not micro_batch:
                    torch.cuda.synchronize(device)
                    started = time.perf_counter()
                losses.append(fresh_step(not micro_batch))
            peaks.append(meter.peak - start + held + resident_bytes)
        if device.type == "cuda":
            if learner.timed_update:
                learner.update()
            torch.cuda.synchronize(device)
            seconds = time.perf_counter() - started
        else:
            if saved is not None:
                learner.updates.restore(saved)
                del saved
            started = time.perf_counter()
            losses = [fresh_step(not micro_batch) for micro_batch in range(accumulate)]
            if learner.timed_update:
                learner.update()
            seconds = time.perf_counter() - started
        measures.append(StepMeasure(peak_bytes=max(peaks), seconds=seconds, loss=sum(losses) / accumulate,
                                    micro_batch_peaks=tuple(peaks) if accumulate > 1 else ()))
        if not learner.timed_update:
            learner.update()
    return measures


def measure_alternately(planned_step, plain_step, planned: Learner, plain: Learner, steps: int, device,
                        resident_bytes: int, compiled: bool = False, accumulate: int = 1) -> tuple:
    """``(planned, plain)``: ``steps`` measures of each (:class:`StepMeasure`), taken planned, plain, planned,
    plain, ... each as :func:`measure_steps` takes one (its peak in a window of its own, then its time; over
    ``accumulate`` micro-batches), each followed by its update (the two :class:`Learner` s may be one)."""
    planned_measures, plain_measures = [], []
    for _ in range(steps):
        planned_measures += measure_steps(planned_step, planned, 1, device, resident_bytes, compiled, accumulate)
        plain_measures += measure_steps(plain_step, plain, 1, device, resident_bytes, compiled, accumulate)
    return planned_measures, plain_measures


def input_bytes(inputs) -> int:
    """Bytes of the distinct storages of the tensors in ``inputs``."""
    return storage_bytes([t for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)])


def on_device(stages, inputs, device) -> tuple:
    """``(stages, inputs)`` on ``device``: the stages as ``(name, module)`` pairs moved there, the tensor inputs
    copied there (other inputs as they are)."""
    moved = tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in inputs)
    return [(name, module.to(device)) for name, module in named_stages(stages)], moved


def train_and_compare(planned_step, stages, inputs, steps: int, device, resident_bytes: int, *, loss_fn=None,
                      lr: float = 1e-3, compiled: bool = False, updates=None, reference=None,
                      whole_step: bool = False, max_grad_norm: float = None, accumulate: int = 1,
                      predicted_micro_batches: tuple = ()) -> Comparison:
    """Train by ``planned_step`` (forward, loss and backward by a plan, returning the loss) and, for reference,
    by the unmodified ``stages`` (``(name, module)`` pairs) on ``inputs`` with ``loss_fn`` (default:
    :func:`planner.execute.stages.default_loss`), their steps alternating (:func:`measure_alternately`).

    One Adam optimizer at ``lr`` updates the trainable parameters after every step; its state is created before
    the first measured step, as in steady state. ``resident_bytes`` is what the plan's prediction counts as
    already allocated (the inputs for a chain, ``fixed_bytes`` for a graph): both runs' peaks count it.
    ``compiled``: the planned step runs compiled code, and so does the reference (each stage through
    ``torch.compile``); both are measured by torch.profiler's memory events. ``updates`` (a
    :class:`planner.execute.updates.StageUpdates`): the planned step updates ``stages`` inside its backward; the
    reference then trains ``reference``, an untouched copy of them, with its own Adam, and both step times
    include the update (``whole_step``: also without ``updates``). ``max_grad_norm``: see :class:`Learner`.
    ``accumulate``: both add that many micro-batches' gradients before each update (``predicted_micro_batches``:
    each one's predicted peak, kept in the comparison).
    """
    def learner(parameters, **given):
        given.setdefault("max_grad_norm", max_grad_norm)
        optimizer = torch.optim.Adam(parameters, lr=lr)
        for parameter in parameters:
            parameter.grad = torch.zeros_like(parameter)
        optimizer.step()  # its state made, as in steady state (and as StageUpdates.warm_up makes the planned's)
        return Learner(parameters, optimizer, **given)

    if updates is None:
        planned = plain = learner(trainable_parameters(stages), timed_update=whole_step)
        reference = stages
    else:
        planned = Learner(trainable_parameters(stages), updates=updates, max_grad_norm=max_grad_norm)
        updates.warm_up()
        plain = learner(trainable_parameters(reference), timed_update=True)
    reference = [(name, torch.compile(module, dynamic=False)) for name, module in reference] if compiled else reference
    plain_step = autograd_step(lambda *xs: run_stages(reference, xs), loss_fn or default_loss, inputs)
    planned_measures, plain_measures = measure_alternately(planned_step, plain_step, planned, plain, steps, device,
                                                           resident_bytes, compiled, accumulate)
    return Comparison(planned=planned_measures, plain=plain_measures, resident_bytes=planned.resident_bytes(),
                      predicted_micro_batches=tuple(predicted_micro_batches))


def train_chain_plan(model, plan, chain, steps: int, device="cpu", lr: float = 1e-3,
                     compile: bool = False, whole_step: bool = False, max_grad_norm: float = None) -> Comparison:
    """:func:`train_and_compare` for a chain ``plan`` run by :func:`planner.execute.chain.apply_plan` on
    ``device`` (``model``: a staged model, its stages and inputs moved there; ``chain``: the plan's, or None),
    through ``torch.compile`` with ``compile``; a plan updating inside the backward runs Adam at ``lr`` there.
    ``whole_step``: the step times include the optimizer update whatever the plan's; ``max_grad_norm``: the
    gradients clipped to that global norm (after the backward only). A plan accumulating gradients over
    micro-batches runs them per step, each micro-batch's peak measured against its own prediction (without
    ``chain``, the plan's for all: the first's bound)."""
    stages, inputs = on_device(model.stages, model.example_inputs, device)
    reference = copy.deepcopy(stages) if plan.update != "after" else None
    planned = apply_plan(stages, plan, chain, compile=compile, optimizer="adam", lr=lr)
    step = autograd_step(planned, model.loss_fn or default_loss, inputs)
    return train_and_compare(step, stages, inputs, steps, device, input_bytes(inputs), loss_fn=model.loss_fn, lr=lr,
                             compiled=compile, updates=planned.updates, reference=reference, whole_step=whole_step,
                             max_grad_norm=max_grad_norm, accumulate=plan.accumulate,
                             predicted_micro_batches=(micro_batch_peaks(chain, plan) if chain is not None else
                                                      (plan.predicted.peak_bytes,) * plan.accumulate))


def train_graph_plan(model, plan, graph, steps: int, device="cpu", lr: float = 1e-3) -> Comparison:
    """:func:`train_and_compare` for a graph ``plan`` of ``graph`` run by
    :class:`planner.execute.graph.GraphExecutor` (``model``: a staged model already on ``device``)."""
    from planner.execute.graph import GraphExecutor  # the graph runtime, loaded for graph plans only

    step = GraphExecutor(model, plan, graph).step
    return train_and_compare(step, named_stages(model.stages), model.example_inputs, steps, device,
                             graph.fixed_bytes, loss_fn=model.loss_fn, lr=lr)


def train_pipeline(spec: str, batch, plan, steps: int, device="cpu", lr: float = 1e-3, chain=None,
                   progress_timeout: float = None) -> list:
    """Train the model ``spec`` names (:func:`profiles.spec.built_model` at ``batch``) by a pipeline ``plan``,
    one process per device (:func:`planner.execute.pipeline.run_pipeline`; ``progress_timeout`` seconds without a
    finished step stop it, default :data:`DEFAULT_PROGRESS_TIMEOUT`); the lines of the run: per rank, the last
    step's measured peak against the plan's device peak minus its resident state. Under torchrun (as many ranks
    as the plan has devices, each running this) rank 0 returns the lines, the others none."""
    pipe = plan.pipeline
    from planner.execute.pipeline import DEFAULT_PROGRESS_TIMEOUT, run_pipeline, summary_lines  # pipelines only
    from planner.execute.torchrun import torchrun_rank

    timeout = DEFAULT_PROGRESS_TIMEOUT if progress_timeout is None else progress_timeout
    world = len(pipe.devices)
    with torchrun_rank(world, f"the pipeline plan ({world} devices)", "partition the chain for --devices {world}",
                       device, timeout, "pipeline") as here:
        results = run_pipeline(functools.partial(built_model, spec, batch=batch), plan, steps, meter=memory_meter,
                               device=device, lr=lr, chain=chain, progress_timeout=timeout, here=here)
    if results is None:  # a rank torchrun started, not the first
        return []
    return [f"pipeline: {len(pipe.devices)} devices, {pipe.schedule}, {pipe.micro_batches} micro-batches, "
            f"{steps} steps on {device}"] + summary_lines(results)


def profiled_for_training(model, device, nodes: int = None, say=say_on_stderr, **options):
    """``model`` profiled on ``device`` into a chain (its stages' options measured: profiles/options.py), or with
    ``nodes`` (and ``options`` for :func:`profiles.graph_profiler.profile_graph`) its training step into a graph
    of at most that many nodes; ``say(line)`` tells what is being done (each stage and its options as measured)."""
    if nodes is None:
        say("\n".join([*model.report, f"profiling {model.name} on {device} ({len(model.stages)} stages)..."]))
        return profile_chain(model.stages, model.example_inputs, loss_fn=model.loss_fn, device=device,
                             name=model.name, options=DEFAULT_OPTIONS, say=lambda line: say(f"  {line}"))
    say(f"capturing and profiling {model.name}'s training step as a graph of at most {nodes} nodes...")
    from profiles.graph_profiler import profile_graph  # the graph capture, loaded for graph profiles only

    return profile_graph(model.stages, model.example_inputs, model.loss_fn, nodes=nodes, device=device,
                         name=model.name, **options)


def check_measured_on(model, problem, source: str):
    """Refuse, as a one-line :class:`planner.errors.MemschedError`, a ``problem`` (chain or plan, named by
    ``source``) measured on other parameters or inputs than the staged ``model``'s; return a note when it
    records none (a file from an older memsched), else None."""
    if problem.measured_on is None:
        return (f"note: the {source} records no input or parameter shapes (an older file): not checked against "
                f"{model.name}")
    problem.measured_on.check_stages(stage_specs(named_stages(model.stages)), source)
    inputs = input_specs(model.example_inputs)
    batch = problem.measured_on.recorded_batch(inputs)
    problem.measured_on.check_inputs(inputs, source,
                                     None if batch is None else f"profile again at this batch or pass --batch {batch}")
    return None
