"""The chain executor: runs a chain schedule in a real training step, exactly, and nothing else.

``apply_plan(stages, plan, chain)`` checks that the plan is for these stages (and, with ``chain``, for this
chain and what it was measured on) and returns ``apply_schedule(stages, plan.schedule)``: a drop-in module whose
call runs the schedule's forward part (every operation before ``Loss``) and returns the last stage's output with
a ``grad_fn``; the caller's ``backward()`` runs the rest (recomputations, backwards, transfers) inside one custom
``autograd.Function``, in the schedule's order, holding what planner/simulate/chain.py (with transfers
planner/simulate/offload.py) counts. Stage ``k`` is called ``module(a_k, *extra)``; outputs may be tensors or
trees of tensors. Hold no reference to the returned output across ``backward()`` (write
``loss_fn(model(x)).backward()``). How it runs, fuses stages and moves data: docs/execution.md.
"""

import warnings

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from planner.errors import MemschedError
from planner.execute.compiled_option import compiles_here
from planner.execute.compiled_runs import CompiledRun, MergedStages, merged_for_compile
from planner.execute.ddp import GradientAnnouncer, active_ddp, check_ddp, known_ddp
from planner.execute.fusion import fused_positions, output_releases
from planner.execute.host_weights import prepare_host_weights, weights_on_device
from planner.execute.offload import OffloadStepRun
from planner.execute.records import find_shared, input_specs, stage_specs
from planner.execute.sharded import ShardedStepRun, check_sharded_run, shard_stages
from planner.execute.stages import named_stages
from planner.execute.steprun import StepRun
from planner.execute.updates import StageUpdates
from planner.measured_on import record_of
from planner.ops import FORWARD_OPS, TRANSFER_OPS, chosen_options, planned_stages
from planner.plan import Plan, check_plan_itself, check_plan_matches
from planner.setup import Run, TrainingSetup, check
from planner.simulate import check_schedule, check_within_budget

# What a compiled plan's prediction does not cover, said once per compiled plan (docs/execution.md, "Compiled").
COMPILED_PEAK = ("a compiled plan's predicted peak is that of its eager operations: Inductor's kernels hold memory no "
                 "chain profile sees (measured 0.96-1.35 of the prediction on this CPU), so its budget is not kept "
                 "for certain; leave headroom, or measure the compiled step (profiles.memory.ProfilerMemoryMeter)")


def apply_schedule(stages, schedule, fuse: bool = True, measured_on=None, source: str = "plan",
                   recomputes=None, compile: bool = False, update: tuple = None, zero: int = None,
                   setup: TrainingSetup = None) -> "PlannedChain":
    """A module running ``stages`` by the chain ``schedule``, once its stage count, the simulator's rules and the
    setup's combinations with this run are checked (nothing run).

    Args:
        stages: an ``nn.Sequential``, an ``nn.ModuleList``, a list of modules or of ``(name, module)`` pairs, or a
            dict of them; stage ``k`` is called ``module(a_k, *extra)``.
        schedule: the chain schedule, a sequence of :class:`planner.ops.Op`, for as many stages.
        fuse: False runs every stage's backward as its own autograd call, never one for several stages: each
            stage's parameter gradients are then added into ``.grad`` before the next stage's are made, as the
            chain model's ``B`` counts them. A fused graph makes all its stages' gradients first, which costs
            nothing more when ``.grad`` is empty (they become it) but holds them beside ``.grad`` when gradients
            accumulate over several backwards (a pipeline's micro-batches). Schedules with transfers always fuse
            as their executor decides.
        measured_on: the :class:`planner.measured_on.MeasuredOn` the inputs of the first call with gradients are
            checked against (None: unchecked); ``source`` (``"plan"`` or ``"chain"``) names it in the message.
        source: see ``measured_on``.
        recomputes: for each stage whose ``F_all`` runs with an option, the option's ``recompute`` positions
            (:class:`planner.chain.StageOption`).
        compile: every stage call goes through ``torch.compile`` (see :class:`PlannedChain`).
        update: ``(update, optimizer, lr, host_stages)`` for an optimizer update inside the backward
            (planner/execute/updates.py; ``lr`` the learning rate); each stage's backward then runs on its own
            (``fuse=False``), its gradients updated and freed after it (eagerly: a compiled run would make several
            stages' gradients at once). None: the caller updates after the backward.
        zero: the ZeRO stage, 2 or 3, when the stages are sharded by planner/execute/sharded.py: its
            :class:`planner.execute.sharded.ShardedStepRun` runs them (eagerly, each stage's backward on its own).
        setup: the :class:`planner.setup.TrainingSetup` the schedule was solved for, whose combinations with this
            run (transfers, ``compile``, options, a sharded step) :func:`planner.setup.check` refuses; default:
            the one ``update`` implies (its update and host stages).

    Returns:
        The :class:`PlannedChain`, a drop-in ``torch.nn.Module``.

    Raises:
        MemschedError: ``stages`` of another type; a schedule for another number of stages, or breaking the
            simulator's rules (:class:`planner.simulate.replay.ScheduleError`, naming the operation); a stage run
            with an option missing from ``recomputes``; a setup that does not mix with the run; weights on the
            host of a stage the model lacks, or tied to another stage; an optimizer that cannot update inside the
            backward.
    """
    pairs = named_stages(stages)
    planned = _stage_count(schedule, pairs)
    check_schedule(schedule, planned)  # the simulator's rules, before anything runs
    recomputes = dict(recomputes or {})
    missing = sorted(set(chosen_options(schedule)) - set(recomputes))
    if missing:
        raise MemschedError(f"the schedule runs stage {missing[0]} with one of its options, whose kept results "
                            "only its chain knows; apply the plan with its chain (--chain)")
    if setup is None:
        setup = TrainingSetup() if update is None else TrainingSetup(update=update[0], host_stages=update[3])
    check(setup, Run(transfers=any(op.kind in TRANSFER_OPS for op in schedule), compile=compile,
                     options=bool(recomputes), sharded=zero is not None))
    if compile:  # the stages the schedule always runs together: one compiled call (planner/execute/compiled_runs.py)
        warnings.warn(COMPILED_PEAK, stacklevel=2)
        pairs, schedule, recomputes = merged_for_compile(pairs, tuple(schedule), recomputes)
    return PlannedChain(pairs, tuple(schedule), fuse and update is None and zero is None, measured_on, source,
                        recomputes, compile, update, zero, accumulates=setup.accumulate > 1)


def apply_plan(stages, plan: Plan, chain=None, fuse: bool = True, compile: bool = False, optimizer: str = "adam",
               lr: float = 1e-3) -> "PlannedChain":
    """:func:`apply_schedule` of ``plan``'s schedule, once the plan is checked: of kind chain, a channel recorded
    when it moves data, for as many stages; with ``chain``, its fingerprint and stage names; what it was measured
    on; its setup against this run (:func:`planner.setup.check`, once).

    A plan whose optimizer updates inside the backward (``plan.update``) runs ``optimizer`` at ``lr`` there
    (planner/execute/updates.py): its call then trains, and the caller runs no ``optimizer.step()``. A plan
    accumulating gradients over micro-batches (``plan.accumulate``, planner/accumulate.py) runs every stage's
    backward on its own (``fuse=False``), each stage's gradients added into ``.grad`` before the next stage's are
    made, as its chain counts them; it runs eagerly (``compile`` refused).

    Args:
        stages: the model's stages, as :func:`apply_schedule` takes them.
        plan: a :class:`planner.plan.Plan` of kind ``chain``.
        chain: the :class:`planner.chain.Chain` the plan was solved for; needed when the plan runs stages with
            options (their ``recompute`` positions are the chain's). None: the fingerprint and names unchecked.
        fuse: as :func:`apply_schedule` takes it (False whenever the plan accumulates).
        compile: every stage call goes through ``torch.compile``.
        optimizer: the update inside the backward's optimizer (sgd, momentum, adam, adamw); unused otherwise.
        lr: its learning rate.

    Returns:
        The :class:`PlannedChain`, a drop-in ``torch.nn.Module``. What the chain was measured on
        (``chain.measured_on``, else the plan's copy of it), when recorded, is checked now against each stage's
        parameters, and at the module's first call with gradients against its inputs.

    Raises:
        MemschedError: a plan of another kind; one moving data without a copy channel (``transfer``); a plan for
            another number of stages, another chain (its fingerprint) or other stage names; a plan contradicting
            itself (a budget of 0, a predicted peak above its budget: :func:`planner.plan.check_plan_itself`) or,
            with ``chain``, whose schedule replayed under its setup peaks above its budget (an edited plan:
            :func:`planner.simulate.check_within_budget`); stages whose
            parameters differ from those it was measured on (planner/measured_on.py: naming the difference); a
            setup that does not mix with this run (``compile``, transfers, options); and whatever
            :func:`apply_schedule` refuses.
    """
    pairs = named_stages(stages)
    if plan.kind != "chain":
        raise MemschedError(f"apply_plan runs plans of kind 'chain', not of kind '{plan.kind}' (a graph plan runs "
                            "with planner.execute.graph.GraphExecutor, a pipeline plan with "
                            "planner.execute.pipeline.run_pipeline)")
    if plan.setup.sharded:
        check_sharded_run(plan.setup)
    if plan.moves_data and plan.transfer is None:
        raise MemschedError("the plan moves data between device and host but records no copy channel "
                            "('transfer'); solve it again with a channel (--bandwidth 16GB/s)")
    _stage_count(plan.schedule, pairs)
    check_plan_itself(plan)
    if chain is not None:
        check_plan_matches(plan, chain, kind="chain")
        check_within_budget(chain, plan)
        names, expected = [name for name, _ in pairs], [stage.name for stage in chain.stages]
        if names != expected:
            mismatch = next(k for k, (a, b) in enumerate(zip(names, expected)) if a != b)
            raise MemschedError(f"stage {mismatch} is named {names[mismatch]!r} but the plan's chain calls it "
                                f"{expected[mismatch]!r}; apply the plan to the model it was solved for")
    measured, source = record_of(chain, plan)
    if measured is not None:
        measured.check_stages(stage_specs(pairs), source)
    recomputes = None if chain is None else {stage: chain.stages[stage].running_option(option).recompute
                                        for stage, option in chosen_options(plan.schedule).items()}
    update = None if plan.update == "after" else (plan.update, optimizer, lr, plan.host_stages)
    zero = None
    if plan.setup.sharded:  # each stage its own fully_shard unit, in place (planner/execute/sharded.py)
        zero = plan.setup.zero
        shard_stages(pairs, zero, plan.setup.dp)
    return apply_schedule(pairs, plan.schedule, fuse and plan.accumulate == 1, measured, source, recomputes, compile,
                          update, zero, setup=plan.setup)  # which checks the setup's rules


def _stage_count(schedule, pairs) -> int:
    planned = planned_stages(schedule)
    if planned != len(pairs):
        raise MemschedError(f"the plan schedules {planned} stages but {len(pairs)} were given; solve again for "
                            "this model")
    return planned


# The step loop of a plan: (its schedule moves data, its stages are sharded) -> the run of one step.
_STEP_RUNS = {(False, False): StepRun, (True, False): OffloadStepRun, (False, True): ShardedStepRun}


class PlannedChain(torch.nn.Module):
    """The stages, run by a schedule. ``forward(a_0, *extra)`` returns the last stage's output.

    ``measured_on`` (a :class:`planner.measured_on.MeasuredOn` from the ``source``, ``chain`` or ``plan``): the
    inputs of the first call with gradients must be its inputs (later calls are not checked: a last, smaller
    batch runs). Building it puts the parameters of the schedule's host-weight stages on the host, and those an
    earlier schedule put there and this one does not back on their device (planner/execute/host_weights.py).
    With ``compile`` the stages the schedule always runs together are one stage run by one compiled call
    (planner/execute/compiled_runs.py), any other stage call goes through ``torch.compile``, a stage with an
    option as one compiled selective checkpoint (planner/execute/compiled_option.py); the chain model's bytes
    are then those of the eager operations, which compiled code fuses and frees otherwise: measure compiled
    steps (torch.profiler on CPU). With ``update`` (see :func:`apply_schedule`) its backward updates the
    parameters (:attr:`updates`, a :class:`planner.execute.updates.StageUpdates`).
    """

    def __init__(self, pairs, schedule, fuse: bool = True, measured_on=None, source: str = "plan", recomputes=None,
                 compile: bool = False, update: tuple = None, zero: int = None, accumulates: bool = False):
        super().__init__()
        self.accumulates = accumulates  # solved for micro-batches that start with every gradient held
        self.told_unplanned_gradients = False
        self.compiled = compile
        self.told_uncompiled = False
        self._compiled_stages = {}
        self.recomputes = dict(recomputes or {})  # stage -> what its F_all recomputes (planner/execute/selective.py)
        self.unchecked_inputs = None if measured_on is None else (measured_on, source)
        self.stage_names = [name for name, _ in pairs]
        self.stages = torch.nn.ModuleList([module for _, module in pairs])
        self.schedule = schedule
        self.loss_position = next(p for p, op in enumerate(schedule) if op.kind == "Loss")
        self.releases = output_releases(schedule, len(pairs))
        moves_data = any(op.kind in TRANSFER_OPS for op in schedule)
        # Transfers run through planner/execute/offload.py, which always fuses as the transfers allow.
        self.continued, self.absorbed, self.kept_outputs = (fused_positions(schedule) if fuse or moves_data
                                                            else (set(), set(), set()))
        self.run_type = _STEP_RUNS[moves_data, zero is not None]  # (planner/setup/rules.py: never both)
        self.zero = zero
        self.host_weights = prepare_host_weights([module for _, module in pairs], schedule)
        # An absorbed B of a stage whose F_all continued a graph has nothing left to do (no standalone input):
        # the loops below skip it, so a fused graph costs one operation's bookkeeping, as in a plain step.
        continued_stages = {schedule[position].stage for position in self.continued}
        idle = {position for position in self.absorbed if schedule[position].stage in continued_stages}
        self.backward_positions = [position for position in range(self.loss_position + 1, len(schedule))
                                   if position not in idle]
        counts = {}
        for op in schedule:
            if op.kind in FORWARD_OPS:
                counts[op.stage] = counts.get(op.stage, 0) + 1
        self.recomputed = {stage for stage, count in counts.items() if count > 1}
        # Looked up at every operation: a plain list, and each fused graph's parameters (shared ones once),
        # taken when the module is built, as an optimizer takes them.
        self.modules_in_order = list(self.stages)
        self._graph_parameters = {}
        # A tied parameter's gradient is summed over its stages before it is added into .grad (TiedGradients).
        self.first_readers = {id(parameter): entry.stages[0] for entry, parameter in find_shared(pairs)}
        self.updates = None if update is None else StageUpdates(self.modules_in_order, *update)
        self.ddp_settings = None  # planner.execute.ddp.DDPSettings of the DDP the last step ran in
        # what DistributedDataParallel cannot wrap (planner/execute/ddp.py), None when it can
        self.not_for_ddp = ("that updates inside the backward" if update is not None else
                            "that moves data to the host" if moves_data else
                            "on sharded stages" if zero is not None else None)

    def compiled_stage(self, i):
        """Stage ``i`` through ``torch.compile`` (made on first use; without and with gradients it compiles
        twice, as any module run both ways)."""
        if i not in self._compiled_stages:
            module = self.modules_in_order[i]
            merged = isinstance(module, MergedStages)
            self._compiled_stages[i] = CompiledRun(module) if merged else torch.compile(module, dynamic=False)
        return self._compiled_stages[i]

    def check_gradients_planned(self) -> None:
        """Before a backward: say once, in one line, that gradients are already in ``.grad`` when the plan was solved
        for a step that starts without them (accumulation it was not told about: they are held from the step's
        start, which its peak does not count)."""
        if self.accumulates or self.told_unplanned_gradients:
            return
        if any(p.grad is not None for p in self.graph_parameters(tuple(range(len(self.stages))))):
            self.told_unplanned_gradients = True
            warnings.warn("gradients are in .grad before the planned backward, which the plan does not count (it "
                          "was solved for a step that starts without them): its peak can pass the budget; plan the "
                          "accumulation (fit(..., accumulate=K), memsched solve --accumulate K) or set the gradients "
                          "to None before each step (optimizer.zero_grad())", stacklevel=2)

    def graph_parameters(self, stages) -> list:
        """The parameters of ``stages`` (a fused graph's), each once."""
        if stages not in self._graph_parameters:
            self._graph_parameters[stages] = list({id(p): p for k in stages
                                                   for p in self.modules_in_order[k].parameters()}.values())
        return self._graph_parameters[stages]

    def forward(self, first, *extra):
        if not torch.is_grad_enabled():  # inference: no schedule needed
            activation = first
            for k, module in enumerate(self.stages):
                if k in self.host_weights:  # parameters on the host: a device copy for the call (CUDA)
                    with weights_on_device(self.host_weights[k]):
                        activation = module(activation, *extra)
                else:
                    activation = module(activation, *extra)
            return activation
        if self.compiled and not self.told_uncompiled and not compiles_here():
            self.told_uncompiled = True
            warnings.warn("a compiled plan ran under a TorchDispatchMode (or with torch.compile disabled), where "
                          "torch.compile compiles nothing: its stages ran their eager operations, whose peak the plan "
                          "predicts; measure compiled code outside any dispatch mode "
                          "(profiles.memory.ProfilerMemoryMeter)", stacklevel=2)
        if self.unchecked_inputs is not None:
            measured, source = self.unchecked_inputs
            measured.check_inputs(input_specs((first, *extra)), source)
            self.unchecked_inputs = None
        run = self.run_type(self, first, extra)
        ddp = active_ddp(self)
        if ddp is not None:  # its reducer averages each gradient once announced (planner/execute/ddp.py)
            check_ddp(ddp, self.not_for_ddp)
            order, self.ddp_settings = known_ddp(ddp)
            run.announcer = GradientAnnouncer(self.first_readers, order)
        anchor = torch.empty(0, requires_grad=True)  # makes the output differentiable even when the input is data
        flat_inputs = [t for t in tree_flatten((first, extra))[0] if isinstance(t, torch.Tensor)]
        outputs = _Capture.apply(run, *_Schedule.apply(run, anchor, *flat_inputs))
        return tree_unflatten(list(outputs), run.output_spec)


class _Schedule(torch.autograd.Function):
    """Forward: the schedule's operations before ``Loss``. Backward: the operations after it."""

    @staticmethod
    def forward(ctx, run, anchor, *flat_inputs):
        planned = run.planned
        with torch.enable_grad():  # F_all builds graphs; F_ck and F_none turn it off
            for position in range(planned.loss_position):
                run.run(position)
        last = run.activation(len(planned.stages))
        leaves, run.output_spec = tree_flatten(last)
        outputs = tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in leaves)
        tensors = [t for t in outputs if isinstance(t, torch.Tensor)]
        # an output the last stage made without a graph (a value it hands back, detached) gets no gradient
        graph = run.graphs.get(len(planned.stages) - 1)
        edges = graph.edges if graph is not None else [True] * len(tensors)
        constant = [t for t, edge in zip(tensors, edges) if not t.is_floating_point() or edge is None]
        del graph
        del last, leaves
        run.acts.pop(len(planned.stages), None)  # the loss holds what it needs of a_L; δ_L takes its place
        run.release(planned.loss_position)
        ctx.run = run
        ctx.set_materialize_grads(False)  # no zeros made for an output the loss does not read
        ctx.mark_non_differentiable(*constant)
        return outputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *placeholders):
        run = ctx.run
        del ctx.run
        planned = run.planned
        if planned.updates is not None:
            planned.updates.check_no_gradients()
        else:
            planned.check_gradients_planned()
        with torch.enable_grad():
            for position in planned.backward_positions:
                run.run(position)
        run.finish()
        grads = list(run.grads.pop(0)) + run.extra_grads
        return (None, None, *grads)


class _Capture(torch.autograd.Function):
    """Identity on the last output; its backward takes ``δ_L`` into the run and passes on placeholders.

    The gradients a custom Function's backward receives stay alive until it returns; taking ``δ_L`` here
    and running the schedule in the next node lets the schedule free ``δ_L`` after ``B L-1``, as planned.
    """

    @staticmethod
    def forward(ctx, run, *tensors):
        ctx.run = run
        ctx.set_materialize_grads(False)
        outputs = tuple(t.detach() for t in tensors)  # not views: a caller may scale the loss in place (Trainer)
        ctx.mark_non_differentiable(*[o for t, o in zip(tensors, outputs) if not t.is_floating_point()
                                      or not t.requires_grad])
        return outputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        ctx.run.grads[len(ctx.run.planned.stages)] = list(grads)
        del ctx.run
        return (None, *[None if g is None else torch.zeros((), dtype=g.dtype, device=g.device).expand(g.shape)
                        for g in grads])
