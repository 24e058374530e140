"""The judges: torch-free simulators that replay a plan and predict its peak bytes and seconds.

:func:`simulate` is the one entry: it checks a plan against its problem and hands the schedule to the
simulator for it, chain (:mod:`.chain`), offload (:mod:`.offload`, a chain schedule with transfers), graph
(:mod:`.graph`) or pipeline (:mod:`.pipeline`). :func:`check_schedule` and :func:`check_plan_schedules`
refuse a schedule that cannot run without the problem. The rules are in docs/model.md.
"""

import dataclasses

from planner.chain import Chain, Loss, Stage, StageOption
from planner.errors import MemschedError
from planner.graph import Graph
from planner.ops import TRANSFER_OPS, host_weight_stages, planned_stages
from planner.plan import Plan, check_plan_matches
from planner.setup import lower
from planner.simulate.chain import ChainSimulator
from planner.simulate.graph import GraphSimulator
from planner.simulate.offload import OffloadSimulator
from planner.simulate.pipeline import pipeline_result, to_local
from planner.simulate.replay import ScheduleError
from planner.transfer import Transfer

__all__ = ["simulate", "check_schedule", "check_plan_schedules", "check_within_budget", "micro_batch_peaks"]

_NO_SIZES = Stage(name="", fwd_time=0.0, bwd_time=0.0, out_bytes=0, saved_bytes=0)
_NO_OPTION = StageOption(recompute=(), fwd_time=0.0, bwd_time=0.0, saved_bytes=0, own_saved_bytes=0)


def simulate(problem, plan_or_schedule, transfer: Transfer = None):
    """Peak bytes, seconds and per-operation timeline of a plan (checked against ``problem``) or a schedule.

    A chain plan is replayed on the chain lowered through its setup (:func:`planner.setup.lower`: the update in
    the backward, accumulation, a sharded step), from what the setup holds beside the step (accumulation's
    gradients for the micro-batches after the first: :func:`micro_batch_peaks` gives each one's peak; ZeRO 2's
    whole parameters).

    Args:
        problem: a :class:`planner.chain.Chain` or a :class:`planner.graph.Graph`.
        plan_or_schedule: a :class:`planner.plan.Plan` for ``problem`` (any kind), or a schedule of it (a sequence
            of chain or graph operations), replayed as given.
        transfer: the copy channel (:class:`planner.transfer.Transfer`, bytes per second each way and seconds of
            latency) a chain schedule with transfers (an offload plan) is replayed over when the plan records
            none; None: the chain's.

    Returns:
        A plan of kind ``pipeline``: a :class:`planner.simulate.pipeline.PipelineResult`; a chain schedule with
        transfers: an :class:`planner.simulate.offload.OffloadResult`; anything else: a
        :class:`planner.simulate.replay.SimResult` (``peak_bytes``, ``time`` in seconds, ``timeline``).

    Raises:
        MemschedError: a plan for another problem (its fingerprint) or of a kind this problem has not; a pipeline
            plan whose last device does not end at the chain's last stage; a schedule (a pipeline device's
            included) breaking the simulator's rules (:class:`planner.simulate.replay.ScheduleError`, naming the
            operation and the rule); a chain schedule with transfers and no copy channel (the plan's,
            ``transfer`` or the chain's); an update on the host of stages the chain lacks.
    """
    if isinstance(plan_or_schedule, Plan):
        check_plan_matches(plan_or_schedule, problem)
        if plan_or_schedule.kind == "pipeline":
            return pipeline_result(problem, plan_or_schedule.pipeline)
        schedule = plan_or_schedule.schedule
        transfer = plan_or_schedule.transfer or transfer
        lowered = lower(problem, plan_or_schedule.setup, transfer)
        if lowered.held_bytes:  # accumulation or ZeRO 2's whole parameters (no transfers: rules.py)
            return ChainSimulator(lowered.chain, lowered.held_bytes).run(schedule)
        problem = lowered.chain
    else:
        schedule = plan_or_schedule
    if isinstance(problem, Graph):
        return GraphSimulator(problem).run(schedule)
    if any(op.kind in TRANSFER_OPS for op in schedule):
        channel = transfer or problem.transfer
        if channel is None:
            raise MemschedError(f"chain '{problem.name}' has no copy channel for this offload schedule; give one "
                                "(--bandwidth 16GB/s) or profile on CUDA")
        return OffloadSimulator(problem, channel, host_weight_stages(schedule)).run(schedule)
    return ChainSimulator(problem).run(schedule)


def micro_batch_peaks(chain: Chain, plan: Plan) -> tuple:
    """Bytes: the predicted peak of each of the ``plan.accumulate`` micro-batches of one optimizer step of a chain
    plan: the first's from no gradient (the chain's own step), every later one's :func:`simulate`'s (the plan's
    ``predicted.peak_bytes``, never below the first's)."""
    later = simulate(chain, plan).peak_bytes
    if plan.accumulate == 1:
        return (later,)
    return (ChainSimulator(chain).run(plan.schedule).peak_bytes,) + (later,) * (plan.accumulate - 1)


def check_within_budget(problem, plan: Plan, where: str = "plan") -> None:
    """Refuse in one line a plan whose schedule, replayed on ``problem`` under its setup, peaks above its budget:
    run, it would pass the budget it records (a plan edited so that its figures no longer hold: an update dropped or
    moved, accumulation added)."""
    peak = simulate(problem, plan).peak_bytes
    if peak > plan.budget_bytes:
        raise MemschedError(f"{where}: its schedule peaks at {peak} bytes on this {plan.kind} under its setup, above "
                            f"its budget_bytes {plan.budget_bytes} (it records {plan.predicted.peak_bytes}): the "
                            "plan was edited; solve again")


def check_schedule(schedule, length: int) -> None:
    """Refuse a chain schedule that no chain of ``length`` stages can run, without the chain.

    Which rule an operation breaks (an input not in memory, a backward repeated or missing, no ``Loss``, an
    item moved that is not there...) does not depend on the stages' sizes, so the simulator's own rules are
    replayed on ``length`` stages of zero bytes and seconds: a schedule with transfers by the offload
    simulator, over a channel of 1 B/s each way. The first broken rule is a :class:`ScheduleError` naming the
    operation's index and the rule, as :func:`simulate` names it; only the rules that need sizes (a host-weight
    stage's gradients left on the device where it has some) are left to :func:`simulate` with the chain.
    """
    if length < 1:
        raise ScheduleError("schedule runs no forward or backward of any stage; a chain has at least one stage")
    options = {}  # each option a schedule names, as a zero-sized one (whether the stage has it needs the chain)
    for op in schedule:
        if op.option is not None and op.stage is not None and 0 <= op.stage < length:
            options[op.stage] = max(options.get(op.stage, 0), op.option + 1)
    stages = tuple(dataclasses.replace(_NO_SIZES, options=(_NO_OPTION,) * options[i]) if i in options else _NO_SIZES
                   for i in range(length))
    chain = Chain(name="schedule check", device="none", input_bytes=0, stages=stages, loss=Loss())
    if any(op.kind in TRANSFER_OPS for op in schedule):
        OffloadSimulator(chain, Transfer(1.0, 1.0), host_weight_stages(schedule)).run(schedule)
    else:
        ChainSimulator(chain).run(schedule)


def check_plan_schedules(plan: Plan, where: str = "plan") -> None:
    """:func:`check_schedule` on a plan's schedule (kind ``chain``: as many stages as it computes) or on each
    pipeline device's (its own stages, numbered from 0 on the device); a graph plan is left to the graph
    simulator, which needs the graph. ``where`` names the plan in the error."""
    try:
        if plan.kind == "chain":
            check_schedule(plan.schedule, planned_stages(plan.schedule))
    except ScheduleError as exc:
        raise ScheduleError(f"{where}: {exc}") from None
    if plan.kind != "pipeline":
        return
    for k, device in enumerate(plan.pipeline.devices):
        try:
            check_schedule(to_local(device.schedule, device.first), device.last - device.first)
        except ScheduleError as exc:
            raise ScheduleError(f"{where}: pipeline.devices[{k}] (stages {device.first} to {device.last - 1}, "
                                f"numbered from 0 on the device): {exc}") from None
