"""One call from an unmodified model to planned training: ``fit(model, example_inputs, budget)``.

:func:`fit` discovers the model's stages (:mod:`profiles.discover`), profiles them on the example batch
(:func:`profiles.chain_profiler.profile_chain`), solves for the budget (:func:`solvers.solve`) and returns a
:class:`FittedModel`: called as the model is called, it returns what the model returns (a Hugging Face
``ModelOutput`` with ``.loss`` and the logits), computed under the plan, the loss's backward the plan's backward;
``.plan``, ``.chain`` and ``.predicted`` say what was planned. It is ``out = fitted(**batch);
out.loss.backward(); optimizer.step()``, with ``fitted.parameters()`` and ``fitted.state_dict()`` the model's
own; in eval mode or without gradients it is the model itself; Hugging Face's ``Trainer`` takes it as it is.
"""

import contextlib
import dataclasses
import functools
import inspect
import time
import types

import torch
from torch.utils._pytree import tree_flatten

import planner.validate as validate
import solvers
from planner.accumulate import check_accumulate
from planner.devices import DeviceSpec
from planner.errors import MemschedError
from planner.execute.chain import apply_plan
from planner.execute.sharded import check_sharded_run
from planner.execute.stages import batch_resized, batch_size
from planner.interrupts import interrupts_delivered
from planner.render import say_on_stderr, seconds_since
from planner.setup import Run, TrainingSetup, check
from planner.setup.account import activation_budget
from planner.simulate import micro_batch_peaks
from planner.units import format_bytes
from profiles import fit_batch
from profiles.chain_profiler import profile_chain
from profiles.cuts import OutputNotReturned
from profiles.device_plan import target_device
from profiles.discover import discover, model_loss, returned_loss
from profiles.estimate import Estimate
from profiles.fake_build import faked_in_place
from profiles.fit_budget import budget_bytes, refuse_early
from profiles.fit_graph import fit_graph, offer_graph
from profiles.fit_ranks import (
    adopt_sharded,
    ddp_line,
    ddp_memory,
    one_plan,
    parameter_homes,
    ranks,
    refuse_resharded,
    refuse_sharded_eval,
    refuse_wrapped,
)
from profiles.fit_saving import forward_as, restore, state_to_save
from profiles.options import DEFAULT_OPTIONS
from profiles.precision import planned as planned_precision


def fit(model: torch.nn.Module, example_inputs, budget, loss_fn=None, solver: str = "auto", *,
        replan: bool = False, max_stages: int = None, warmup: int = 1, repeats: int = 3,
        stage_options: int = DEFAULT_OPTIONS, compile: bool = False, optimizer: str = None, lr: float = 1e-3,
        accumulate: int = 1, graph: bool = False, autocast=None, returns: str = "auto", progress=True,
        setup: TrainingSetup = None, device_spec=None, batch=None, global_batch: int = None,
        **options) -> "FittedModel":
    """``model`` planned to train within ``budget`` on batches laid out as ``example_inputs``.

    The model's stages are discovered, profiled and solved for as a chain (or, with ``graph=True``, its joint
    graph); the plan then runs inside the returned module's call and the caller's ``backward()``.

    Args:
        model: the ``torch.nn.Module`` to train.
        example_inputs: a tensor, a tuple of positional arguments or a dict of keyword arguments (as the model
            is called).
        budget: bytes (an int), a string with a unit (``"6GiB"``) or a percentage of the store-all peak
            (``"50%"``; with ``accumulate``, of the accumulating step's); with ``device_spec``, also ``"auto"``:
            what the device's memory leaves beside the setup's resident state.
        loss_fn: ``loss_fn(output)``, the scalar loss (default: ``output.loss`` when the model returns one, else
            the mean of its output).
        solver: as for ``memsched solve`` (``auto``: store everything when it fits, else the hierarchical solver
            over the stages' options, or rotor without them); ``options`` go to it.
        replan: a batch of other shapes, dtypes or arguments is planned for anew (the plans kept per layout)
            instead of refused in one line.
        max_stages: at most that many stages (None: as many as discovered).
        warmup: the profiler's warm-up runs per stage.
        repeats: the profiler's timed runs per stage.
        stage_options: candidates measured per distinct stage, and the selective-checkpoint policies beside them
            (profiles/options.py; 0: none).
        compile: the plan runs through ``torch.compile`` (planner/execute/chain.py).
        optimizer: the setup's optimizer, one of :data:`planner.setup.training.OPTIMIZERS` (default adam); an
            update inside the backward runs it (sgd, momentum, adam or adamw).
        lr: the learning rate of an update inside the backward.
        accumulate: ``k``: the loop adds ``k`` micro-batches' gradients before each ``optimizer.step();
            optimizer.zero_grad()``; the plan is solved for the micro-batches after the first, which start with
            every gradient held (planner/accumulate.py), and ``.micro_batch_peaks`` predicts each one's peak
            (bytes).
        graph: the joint forward+backward graph is profiled (at most ``nodes=60`` nodes), solved by a graph
            solver (``solver``: ``auto``, store-all when it fits else Checkmate's MILP then Moccasin, within
            ``time_limit=60`` seconds) and run by the graph executor (profiles/fit_graph.py): the call runs the
            whole step and returns the loss, whose ``backward()`` hands over the gradients; ``.chain`` is then the
            graph and ``.plan`` a graph plan, which counts the parameters and buffers in its budget and peak
            (``.predicted`` leaves them out, as fit's budget does).
        autocast: the mixed precision the loop runs its forward under, ``with torch.autocast(device, dtype)``
            (``torch.bfloat16``, ``torch.float16``; ``False``: none; default: the autocast state active at
            ``fit``): the step is captured, profiled and planned in it (profiles/precision.py; docs/execution.md,
            "Mixed precision (autocast)").
        returns: ``"output"``, what the model returns, which must hold the loss (``output.loss``; its other
            tensors, the logits, come back detached, planned as held by the caller to the step's end:
            :func:`held_by_caller`); ``"loss"``, the loss alone; ``"auto"`` (default), the output when it holds the
            loss and the update runs after the backward, else the loss.
        progress: planning tells what it does on stderr, a line at a time (stages discovered, each stage measured
            or shared with an identical one, each stage's options, the solve); False: nothing; a callable: each
            line to it.
        setup: all of the setup's keywords as one :class:`planner.setup.TrainingSetup` (optimizer, update, host
            stages, weights on the host, accumulation), instead of them; which parts mix: planner/setup/rules.py.
        device_spec: plan for this device (a :class:`planner.devices.DeviceSpec`, or its name or file as
            ``memsched plan --device-spec`` takes them) instead of measuring on this one: the stages are profiled
            on fake copies of their tensors (sizes exact, each block as the device's allocator rounds it; times
            estimated: docs/devices.md), the model's own tensors untouched; a budget in bytes is held to what the
            device's memory leaves when that is less.
        batch: the micro-batch planned for: None, the example's; a size, the example's tensors of its batch size
            (those whose first size is the first tensor's) given that many rows, cycled from theirs
            (:func:`planner.execute.stages.batch_resized`); ``"auto"`` (with ``device_spec``), the one that trains
            fastest there: micro-batches of 1, 2, 4, ... found and profiled on fake tensors, solved within
            ``budget`` and judged by predicted samples per second, as ``memsched plan --batch auto`` does
            (profiles/fit_batch.py); ``.searched`` holds the table, ``.micro_batch`` the size chosen (None when
            neither ``batch`` nor ``global_batch`` is given). The loop then feeds batches of that size.
        global_batch: samples per optimizer step: ``global_batch / micro-batch`` micro-batches accumulated
            (``.accumulate``), instead of ``accumulate``.
        options: the solver's parameters, and ``update="in-backward"`` (or ``"on-host"``, with a ``transfer``
            channel: planner/updates.py; ``host_stages=``: which stages' update runs on the host): the backward
            also updates the parameters, by ``optimizer`` at ``lr``, freeing each stage's gradients as it goes, and
            the loop runs no optimizer of its own; ``weights=``: stages whose parameters stay on the host.

    Returns:
        The :class:`FittedModel`: ``fitted(*args, **kwargs)`` is ``model(*args, **kwargs)`` under the plan (its
        output or its loss, as ``returns`` says). In eval mode or without gradients the call runs the model
        itself (its dropout and statistics as they are; nothing to plan). A call adding keyword arguments the
        model takes to the planned ones (Trainer's ``num_items_in_batch``) is planned for once, at the first.

    Raises:
        MemschedError: in one line, a budget that cannot be read or lies below the least feasible one, saying
            what that is, as soon as it is known: before the stages' options are measured when it is below the
            least that any options could reach (``solvers.minimum.least_budget_bound``; not with ``accumulate``,
            whose floor is the accumulating step's), naming ``graph=True`` when the step's joint graph meets it (a
            model whose blocks keep several tensors live has few cuts; not under autocast, where ``graph=True`` is
            refused); a setup whose parts do not mix, or given beside its keywords; a ``returns`` other than the
            three, or ``"output"`` where only the loss is planned; and whatever discovery, :func:`solvers.solve` and
            :func:`planner.execute.chain.apply_plan` refuse. A later call refuses a batch of another layout
            (without ``replan``), another autocast state, or some modules switched between training and eval mode
            since; moving or casting the fitted model (``.cuda()``, ``.half()``) is refused.
    """
    if not isinstance(model, torch.nn.Module):
        raise MemschedError(f"fit model: a torch.nn.Module to train, not {type(model).__name__}")
    for name, value, least in (("warmup", warmup, 0), ("repeats", repeats, 1), ("stage_options", stage_options, 0)):
        validate.count(value, f"fit {name}", least, validate.MAX_RUNS)
    quiet = not progress or ranks()[0] != 0  # in a job of several ranks, rank 0 alone plans and tells
    say = progress if callable(progress) and not quiet else say_on_stderr if not quiet else (lambda line: None)
    options = dict(options)
    setup = _fit_setup(setup, accumulate, optimizer, options)
    with interrupts_delivered():  # a Ctrl-C inside the tracker's finalizers is not lost (planner/interrupts.py)
        return FittedModel(model, example_inputs, budget, loss_fn, solver, replan=replan, max_stages=max_stages,
                           warmup=warmup, repeats=repeats, stage_options=stage_options, compile=compile,
                           setup=setup, options=dict(options, optimizer=setup.optimizer, lr=lr), graph=graph,
                           autocast=autocast, returns=returns, say=say, device_spec=_target(device_spec, budget),
                           batch=batch, global_batch=global_batch)


def _target(device_spec, budget):
    """The :class:`planner.devices.DeviceSpec` :func:`fit` plans for (None: this device, measured), refusing
    ``budget="auto"`` without one in one line (what does not mix with one: planner/setup/rules.py)."""
    if device_spec is None:
        if budget == "auto":
            raise MemschedError("fit budget 'auto' is what a device's memory leaves: give device_spec= (a "
                                "planner.devices.DeviceSpec or a name such as 'h100-80gb'), or a budget in bytes")
        return None
    return device_spec if isinstance(device_spec, DeviceSpec) else target_device(device_spec)


def _fit_setup(setup, accumulate, optimizer, options: dict) -> TrainingSetup:
    """The training setup :func:`fit` plans for: ``setup``, else the one its keywords give (``update=``,
    ``host_stages=``, ``weights=``, taken out of ``options``, ``accumulate=`` and ``optimizer=``, default adam);
    both at once is one line."""
    given = {key: options.pop(key) for key in ("update", "host_stages", "weights") if key in options}
    if optimizer is not None:
        given["optimizer"] = optimizer
    if setup is None:
        fields = {"host_weights" if key == "weights" else key: value for key, value in given.items()}
        return TrainingSetup(accumulate=check_accumulate(accumulate, "fit accumulate"), **fields)
    if not isinstance(setup, TrainingSetup):
        raise MemschedError(f"fit setup: a planner.setup.TrainingSetup, not {type(setup).__name__}")
    if given or accumulate != 1:
        raise MemschedError(f"fit: {next(iter(given), 'accumulate')}= is a field of the setup given: give it there "
                            "(dataclasses.replace(setup, ...)), not beside it")
    return setup


@dataclasses.dataclass
class _Planned:
    """A plan for one layout of inputs: the discovery, its chain, the plan and the module that runs it."""

    discovery: object
    chain: object
    plan: object
    run: torch.nn.Module
    modes: tuple  # the training flag of each of the model's modules when planned
    predicted: object = None  # the prediction on fit's footing when it is not the plan's (a graph plan's)


class FittedModel(torch.nn.Module):
    """The model of :func:`fit`: ``fitted(*args, **kwargs)`` is ``model(*args, **kwargs)`` under the plan (its
    output, or its loss: :func:`fit`'s ``returns``). Its parameters, state dict and forward's signature are the
    model's (``model`` is its submodule), and so is any attribute it lacks (``config``)."""

    def __init__(self, model, example_inputs, budget, loss_fn, solver, *, replan, max_stages, warmup, repeats,
                 stage_options, compile, setup, options, say, graph=False, autocast=None, returns="auto",
                 device_spec=None, batch=None, global_batch=None):
        super().__init__()
        refuse_wrapped(model)
        if setup.sharded:  # one rank's sharded step runs on its ranks alone: refused before any profiling
            check_sharded_run(setup)
        if graph and ranks()[1] > 1:
            raise MemschedError("fit graph=True plans one process's step; in a job of several ranks fit the chain "
                                "of stages (drop graph=True), which every rank then runs")
        if budget != "auto":
            budget_bytes(budget, None)  # an unreadable budget fails before any profiling, and so does a bad setup
        fit_batch.checked(batch, global_batch)
        self.model = model
        self.precision = planned_precision(autocast, model, type(model).__name__).for_target(device_spec)
        check(setup, Run(compile=compile, graph=graph, target=device_spec is not None,
                         autocast=self.precision.dtype is not None, batch_search=batch == "auto",
                         global_batch=global_batch is not None), interface="fit")
        self.returns = _returns(returns, setup, graph, global_batch)
        self._settings = dict(budget=budget, loss_fn=loss_fn, solver=solver, max_stages=max_stages,
                              warmup=warmup, repeats=repeats, stage_options=stage_options, compile=compile,
                              setup=setup, options=options, graph=graph, device_spec=device_spec,
                              offer_graph=self.precision.dtype is None)
        self._say = say
        self._told_ddp = None  # the line said at the first step inside DistributedDataParallel
        self.replan = replan
        self._plans = []
        chosen = self._batching(example_inputs, batch, global_batch)
        self._settings["setup"], self.micro_batch, self.searched = chosen.setup, chosen.size, chosen.searched
        if batch is None:
            self._current = self._planned(example_inputs)
        else:
            with fit_batch.resized_failures(chosen.size, loss_fn):
                self._current = self._planned(batch_resized(example_inputs, chosen.size))
        # the model's signature: Trainer reads it (the columns it keeps, whether it passes num_items_in_batch)
        self.forward = types.MethodType(forward_as(model), self)

    def _planned(self, example_inputs, estimated=False) -> _Planned:
        """Discover, profile and solve for inputs laid out as ``example_inputs``; ``estimated``: profiled on fake
        tensors (a replanning call, inside the user's step: see :meth:`_solved`)."""
        s, say, started = self._settings, self._say, time.perf_counter()
        name, target, adopters = type(self.model).__name__, s["device_spec"], []
        say(f"fit: discovering {name}'s stages...")
        # for a device, found and profiled on fake copies of the model's tensors (nothing runs at the batch's size),
        # the stages handed the model's own tensors back afterwards
        with (faked_in_place([self.model], example_inputs, adopters) if target is not None else
              contextlib.nullcontext(example_inputs)) as inputs:
            with self.precision.capturing():
                discovery = self._discover(inputs)
            adopters.extend([discovery.prelude, *(module for _, module in discovery.staged.stages)])
            staged = discovery.staged
            say(f"{name}: {len(staged.stages)} stages discovered in {seconds_since(started)}; "
                f"{'profiling' if target is None else 'estimating'} them...")
            if s["graph"]:  # (never for a device: planner/setup/rules.py)
                with self.precision.profiling():
                    graph, plan, run, predicted = fit_graph(staged, s["budget"], s["solver"], s["options"],
                                                            warmup=s["warmup"], repeats=s["repeats"], say=say)
                planned = _Planned(discovery, graph, plan, run, _modes(self.model), predicted)
                discovery.staged = dataclasses.replace(staged, example_inputs=None)
                self._plans.append(planned)
                return planned
            chain, plan = one_plan(lambda: self._solved(discovery, started, s["options"], estimated))
        return self._run_by(discovery, chain, plan)

    def _run_by(self, discovery, chain, plan) -> _Planned:
        """The module that runs ``discovery``'s stages by ``plan``, kept as the plan of its layout."""
        s, staged = self._settings, discovery.staged
        # the example batch is not kept: it would sit in memory beside every step
        discovery.staged = dataclasses.replace(staged, example_inputs=None)
        homes = parameter_homes(self.model, staged.stages) if plan.setup.sharded else ()
        run = apply_plan(staged.stages, plan, chain, compile=s["compile"], optimizer=s["options"]["optimizer"],
                         lr=s["options"]["lr"])
        adopt_sharded(homes)  # apply_plan sharded the stages with fully_shard: the model takes their parameters
        planned = _Planned(discovery, chain, plan, run, _modes(self.model))
        self._plans.append(planned)
        return planned

    def _solved(self, discovery, started, options, estimated=False) -> tuple:
        """``(chain, plan)`` for ``discovery``'s stages: profiled (refusing the budget as soon as it is known to lie
        below the floor), then solved for the budget. ``estimated``: profiled on fake tensors, its seconds from
        counted FLOPs, as for a target device: a replanning call runs inside the user's step, where measuring the
        stages at the new shape (their inputs kept for the options) would itself pass the budget (5.6× it for an
        MLP called at 4× its batch)."""
        s, say, staged, ordered = self._settings, self._say, discovery.staged, []
        name = type(self.model).__name__
        options = {key: value for key, value in options.items() if key not in ("optimizer", "lr")}

        def check(so_far, pending):  # the budget against the floor as soon as it is known
            return refuse_early(staged, held_by_caller(so_far, discovery.returned_bytes), pending, s, say, ordered)

        target = s["device_spec"]  # (its stages were found on fake tensors: _planned)
        with (faked_in_place([module for _, module in staged.stages], staged.example_inputs) if estimated else
              contextlib.nullcontext(staged.example_inputs)) as inputs:
            chain = self._profiled(discovery, inputs, lambda line: say(f"  {line}"),
                                   None if estimated or target else check, estimated=estimated)
        budget = None if s["budget"] == "auto" else budget_bytes(s["budget"], chain, s["setup"])
        if target:  # never more than the target's memory leaves beside the resident state
            left = activation_budget(chain, s["setup"], target.step_memory_bytes())
            budget = left if budget is None else min(budget, left)
        elif s["offer_graph"]:
            offer_graph(staged, chain, budget, s["solver"], s["setup"])
        say(f"{name}: discovered and profiled in {seconds_since(started)}; solving for {format_bytes(budget)}...")
        solving = time.perf_counter()
        plan = solvers.solve(chain, budget, s["solver"], s["setup"], **options)
        say(f"{name}: planned in {seconds_since(solving)} ({plan.solver}): predicted peak "
            f"{format_bytes(plan.predicted.peak_bytes)}, {plan.predicted.overhead:.1%} slower than storing everything")
        return chain, plan

    def _batching(self, example_inputs, batch, global_batch) -> fit_batch.Batching:
        """The micro-batch and setup planned for (profiles/fit_batch.py), ``batch="auto"`` searched on fake tensors
        (:meth:`_estimate_at`)."""
        s = self._settings
        params = {key: value for key, value in s["options"].items() if key not in ("optimizer", "lr")}
        example = None if batch is not None or global_batch is None else batch_size(
            tree_flatten(example_inputs)[0], "fit global_batch= divides")  # only read when it is needed
        return fit_batch.batching(example, batch, global_batch, s["setup"],
                                  functools.partial(self._estimate_at, example_inputs), s["device_spec"],
                                  s["budget"], s["solver"], type(self.model).__name__, self._say, **params)

    def _estimate_at(self, example_inputs, size: int) -> Estimate:
        """The model's :class:`profiles.estimate.Estimate` at a micro-batch of ``size`` on the target device: its
        stages found and profiled on fake copies of its tensors and of ``example_inputs`` made ``size`` rows long
        (nothing allocated; its own tensors back afterwards)."""
        s = self._settings
        with fit_batch.resized_failures(size, s["loss_fn"]), faked_in_place([self.model], example_inputs) as fakes:
            with self.precision.capturing():
                discovery = self._discover(batch_resized(fakes, size))
            chain = self._profiled(discovery, discovery.staged.example_inputs, lambda line: None)
        trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        return Estimate(discovery.staged.name, trainable, chain)

    def _profiled(self, discovery, inputs, say, check=None, estimated=False):
        """The chain of ``discovery``'s stages profiled on ``inputs`` (fake ones for a target device, or
        ``estimated``: estimated once, its figures the same on every run), what the call returns beside the loss
        held by the caller."""
        s, target, staged = self._settings, self._settings["device_spec"], discovery.staged
        estimated = estimated or target is not None
        with self.precision.profiling():
            chain = profile_chain(staged.stages, inputs, loss_fn=returned_loss, warmup=0 if estimated else s["warmup"],
                                  repeats=1 if estimated else s["repeats"], name=staged.name,
                                  options=s["stage_options"], say=say, check=check, estimate=estimated,
                                  device_spec=target)
        return held_by_caller(chain, discovery.returned_bytes)

    def _discover(self, example_inputs):
        """The model's stages on ``example_inputs``, the last returning what the call returns (``auto``: the
        output when it holds the loss, from then on)."""
        s = self._settings
        call = functools.partial(discover, self.model, example_inputs, s["loss_fn"], name=type(self.model).__name__,
                                 max_stages=s["max_stages"])
        if self.returns != "auto":
            return call(returns=self.returns == "output")
        try:
            discovery, self.returns = call(returns=True), "output"
        except OutputNotReturned:
            discovery, self.returns = call(), "loss"
        return discovery

    @property
    def plan(self):
        """The plan the next call runs by (:class:`planner.plan.Plan`)."""
        return self._current.plan

    @property
    def accumulate(self) -> int:
        """Micro-batches per optimizer step the plan is made for (``accumulate``, or ``global_batch`` over the
        micro-batch)."""
        return self._settings["setup"].accumulate

    @property
    def micro_batch_peaks(self) -> tuple:
        """Bytes: the predicted peak of each micro-batch of an optimizer step (one without ``accumulate``), the
        first's from no gradient (:func:`planner.simulate.micro_batch_peaks`; a graph plan's step is one)."""
        if self._current.predicted is not None:  # a graph plan, on fit's footing
            return (self._current.predicted.peak_bytes,)
        return micro_batch_peaks(self._current.chain, self._current.plan)

    @property
    def chain(self):
        """The profiled chain (:class:`planner.chain.Chain`) the plan was solved for (with ``graph=True``, the
        :class:`planner.graph.Graph`)."""
        return self._current.chain

    @property
    def predicted(self):
        """The simulator's prediction for the plan: ``.peak_bytes`` and ``.time`` (seconds)."""
        return self._current.predicted or self._current.plan.predicted

    @property
    def ddp(self):
        """Once a step ran inside ``DistributedDataParallel``: this rank's bytes there
        (:class:`planner.simulate.ddp.DDPRank`: DDP's buckets and its hook's state beside the parameters, the
        step's peak, the bytes sent each step with and without the hook); None before."""
        settings = getattr(self._current.run, "ddp_settings", None)  # (a graph plan's run has none)
        if settings is None:
            return None
        return ddp_memory(self._current.chain, self._current.plan, settings,
                          self._current.discovery.returned_bytes)

    @property
    def discovery(self):
        """The stages found (:class:`profiles.discover.Discovery`; ``describe()`` gives lines for people)."""
        return self._current.discovery

    def __getstate__(self):
        """What ``torch.save(fitted)`` keeps (profiles/fit_saving.py: each plan's run is made again on load)."""
        return state_to_save(self)

    def __setstate__(self, state):
        restore(self, state)

    def __getattr__(self, name):
        """What the fitted model lacks, the model's (``config``, ``loss_type``: what Trainer reads)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "model" or "model" not in self._modules:
                raise
            return getattr(self._modules["model"], name)

    def _apply(self, fn, *args, **kwargs):
        """``.cuda()``, ``.half()`` and the like are refused: the plan was measured on the model as it was
        (device, dtypes), and its stages hold the model's buffers as they were then."""
        raise MemschedError("a fitted model is planned for the device and dtypes it was fitted on: move or cast "
                            "the model and its batch first, then call fit")

    def to(self, *args, **kwargs):
        """``self`` when it moves nothing (to the device and dtype the model has: Trainer's ``model.to(device)``),
        else refused as :meth:`_apply` says."""
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        tensors = list(self.model.parameters()) + list(self.model.buffers())
        if all(_same_device(t.device, device) and (dtype is None or not t.is_floating_point() or t.dtype == dtype)
               for t in tensors):
            return self
        return self._apply(None)

    def state_dict(self, *args, **kwargs):
        """The model's state dict, with its own keys (an unmodified model loads it)."""
        return self.model.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """The model's ``load_state_dict``, copying the values into the tensors the plan's stages hold;
        ``assign=True``, which would put in tensors the stages do not hold, is refused in one line."""
        if assign:
            raise MemschedError("load_state_dict(assign=True) would swap in tensors the plan's stages do not hold: "
                                "load without assign (it copies the values), or load into the model before fit")
        return self.model.load_state_dict(state_dict, strict=strict)

    def _forward(self, *args, **kwargs):
        """``model(*args, **kwargs)`` under the plan (the output or the loss, as ``returns`` says); in eval mode or
        without gradients, the model itself."""
        if not torch.is_grad_enabled() or not self._training_as_planned():
            refuse_sharded_eval(self._current.plan)
            output = self.model(*args, **kwargs)
            return output if self.returns == "output" else (self._settings["loss_fn"] or model_loss)(output)
        return self._planned_step(args, kwargs)

    @torch.compiler.disable
    def _planned_step(self, args, kwargs):
        """The call under the plan. ``torch.compile(fitted)`` runs it eagerly (the eval call is compiled): the
        executor is a loop over the plan's schedule, each operation a Python call Dynamo would guard on and compile
        again (8 recompilations and the limit's warnings in four GPT-2 steps); ``fit(compile=True)`` compiles the
        stages themselves."""
        self.precision.check_call(type(self.model).__name__)
        refuse_resharded(self, self._current.plan)
        planned = self._plan_for(args, kwargs)
        output = planned.run(*planned.discovery.chain_inputs(args, kwargs))
        settings = getattr(planned.run, "ddp_settings", None)  # (a graph plan's run has none)
        if self._told_ddp is None and settings is not None:  # the first step inside DDP
            self._told_ddp = ddp_line(settings, lambda: self.ddp)
            self._say(self._told_ddp)
        return planned.discovery.output(output) if self.returns == "output" else output

    def _training_as_planned(self) -> bool:
        """True when the model's modules train as when planned, False when none trains (eval mode); a mix of
        the two is refused in one line."""
        modes, planned = _modes(self.model), self._current.modes
        if modes == planned or not any(modes):
            return modes == planned
        names = [name or "the model" for name, _ in self.model.named_modules()]
        changed, now = next((n, m) for n, m, p in zip(names, modes, planned) if m != p)
        raise MemschedError(f"{changed} is in {'training' if now else 'eval'} mode, which the plan was not made "
                            f"for: call fit once the modes are set, or evaluate in eval mode (fitted.eval())")

    def _plan_for(self, args, kwargs) -> _Planned:
        """The plan for this batch: the current one, a kept one or a new one (``replan``, or keyword arguments
        the model takes added to the planned ones); else the mismatch in one line."""
        try:
            self._current.discovery.check_batch(args, kwargs)
        except MemschedError:
            if not (self.replan or self._only_added_keywords(args, kwargs)):
                raise
            self._current = self._matching(args, kwargs) or self._planned(_example(args, kwargs), estimated=True)
        return self._current

    def _only_added_keywords(self, args, kwargs) -> bool:
        """Whether the batch is laid out as planned but for keyword arguments the model's forward takes."""
        planned = self._current.discovery.keywords
        added = [key for key in kwargs if key not in planned]
        if not added or not all(_takes(self.model, key) for key in added):
            return False
        try:
            self._current.discovery.check_batch(args, {k: v for k, v in kwargs.items() if k in planned})
        except MemschedError:
            return False
        return True

    def _matching(self, args, kwargs):
        """The plan already made for inputs laid out as these, if any."""
        for planned in self._plans:
            try:
                planned.discovery.check_batch(args, kwargs)
            except MemschedError:
                continue
            return planned
        return None


def held_by_caller(chain, held: int):
    """``chain`` with ``held`` bytes of its last stage's output (what the call returns beside the loss) held by the
    caller to the step's end, in the chain model's terms: no gradient comes back for them (``out_bytes``, which
    is ``δ_L``'s size, less ``held``), the loss releases nothing but itself (``own_saved_bytes``, the stage's and
    each option's, is all it keeps but the loss: an option counts none of its outputs as kept by its backward,
    the stage those no backward saved) and its backward leaves them (``param_bytes``, what a backward leaves to
    the step's end, gains them all). The loss itself is taken to be saved by nothing (a scalar)."""
    if not held:
        return chain
    last = chain.stages[-1]
    loss_bytes = last.out_bytes - held

    def holding(figures):
        return dataclasses.replace(figures, own_saved_bytes=max(figures.own_saved_bytes,
                                                                figures.saved_bytes - loss_bytes))

    stage = dataclasses.replace(holding(last), out_bytes=loss_bytes, param_bytes=last.param_bytes + held,
                                options=tuple(holding(option) for option in last.options))
    return dataclasses.replace(chain, stages=chain.stages[:-1] + (stage,))


def _returns(returns, setup: TrainingSetup, graph: bool, global_batch: int = None) -> str:
    """:func:`fit`'s ``returns`` checked: ``"auto"`` is ``"loss"`` when the update runs inside the backward, when
    gradients accumulate over micro-batches (or may: ``global_batch``), and on the graph path, which plan no
    output held by the caller."""
    if returns not in ("auto", "output", "loss"):
        raise MemschedError(f"fit returns: 'auto', 'output' or 'loss', not {returns!r}")
    update, accumulate = setup.update, setup.accumulate
    reason = (f"update={update!r} (a step that frees each stage's gradients)" if update != "after" else
              f"accumulate={accumulate} (micro-batches after the first)" if accumulate != 1 else
              f"global_batch={global_batch} (micro-batches accumulated)" if global_batch is not None else
              "graph=True (the graph executor's step)" if graph else None)
    if reason is None:
        return returns
    if returns == "output":
        raise MemschedError(f"fit(..., {reason.split(' (')[0]}) returns the loss: {reason} is not planned with the "
                            "logits held; pass returns='loss'")
    return "loss"


def _modes(model) -> tuple:
    return tuple(module.training for module in model.modules())


def _same_device(have, want) -> bool:
    """Whether a tensor on ``have`` is already on ``want`` (None: any): ``cpu`` and ``cpu:0`` are one device (what
    Accelerate moves a model to), and ``cuda`` is the current CUDA device."""
    if want is None or have.type != want.type or want.index is None or have.type == "cpu":
        return want is None or have.type == want.type
    return have.index == want.index


def _takes(model, key: str) -> bool:
    """Whether ``model``'s forward takes the keyword argument ``key`` (by name, or as ``**kwargs``)."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return key in parameters or any(p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def _example(args: tuple, kwargs: dict):
    """A batch as :func:`fit` takes example inputs: the keywords, else the positional arguments."""
    if args and kwargs:
        raise MemschedError("fit(..., replan=True) plans again for positional or keyword inputs, not both at once")
    return kwargs or args
