"""The pipeline simulator: per-device peak memory and the iteration time of a pipeline plan.

A pipeline runs a chain on ``P`` devices; device ``s`` (0-based) holds the contiguous stages ``[first_s,
last_s)`` and every device processes ``m`` micro-batches per iteration. The chain profile describes **one
micro-batch**. The model (docs/formats.md, "Pipelines"):

**The device's sub-chain.** Device ``s`` runs a standalone chain (:func:`sub_chain`): its input is the
activation it receives, ``a_first`` (for device 0 the model's input), its stages are the chain's
``[first, last)`` with ``param_bytes`` set to 0, and its loss is the chain's on the last device; on the
others it is a zero-time, zero-temporary "loss" whose gradient is ``δ_last`` received from the next device
(the ``Loss`` operation of a non-last device's schedule *is* that arrival). Its schedule (store-all or a
Rotor schedule) is replayed by the chain simulator (planner/simulator.py), which gives per micro-batch:

* ``compute``: the schedule's seconds (forwards, recomputations, backwards, the loss on the last device);
* ``single_peak``: the peak bytes of one micro-batch (its input, activations, gradients, temporaries);
* ``held``: the bytes resident just before its ``Loss`` operation: what one micro-batch keeps on the device
  between the end of its forward pass and the start of its backward pass (for store-all: the input plus
  every stage's ``saved_bytes``; for a Rotor schedule its checkpoints and the last stage's ``ā``).

**Static memory.** Parameters, the fp32 master copy, the optimizer state and the parameter gradients (which
accumulate over the micro-batches and live for the whole iteration) are resident: ``static =
setup.resident_bytes(n) + setup.gradient_bytes(n)`` with ``n`` = parameters of the device's stages
(``sum(param_bytes) / 4`` rounded up: planner.step_memory.parameters_of). This is why the sub-chain's
``param_bytes`` are 0: they are counted here, once. (A stage's ``bwd_tmp_bytes`` covers the gradients it
makes; those are then counted twice, a conservative over-count of at most one stage's gradients.)

**In-flight micro-batches.** ``k_s = m`` for GPipe (all forwards, then all backwards) and
``k_s = min(m, P - s)`` for 1F1B (PipeDream-Flush: device ``s`` starts ``P - s`` forwards before its first
backward, then alternates). A device's peak is then::

    peak_s = static_s + (k_s - 1) * held_s + single_peak_s

the most micro-batches it holds between forward and backward at once, while one of them runs the step's
peak. Received gradients are counted from their ``Loss`` (arrival) on; a send buffer is not modelled (the
activation sent is part of the sending stage's ``saved_bytes`` anyway).

**Time.** Per micro-batch, device ``s`` takes ``t_s = compute_s + send_s`` where ``send_s`` charges every
boundary transfer to its *sender*: ``a_last`` forward to device ``s + 1`` (not on the last device) and
``δ_first`` back to device ``s - 1`` (not on device 0), each ``bytes / bandwidth + latency`` seconds (no
bandwidth: transfers are free). Transfers do not overlap the sender's compute. The iteration time of both
schedules (GPipe and 1F1B have the same bubble) is::

    T = (m - 1) * max_s t_s + sum_s t_s

the time for the bottleneck device to process ``m`` micro-batches plus the fill and drain of the pipeline
through the others; with balanced stages it is the familiar ``(m + P - 1) * t`` (Huang et al., GPipe,
NeurIPS 2019; Narayanan et al., PipeDream-2BW / Megatron-LM, SC 2021: bubble fraction ``(P - 1) / m``). It
assumes each device's forward and backward of a micro-batch run back to back on the critical path (exact
for balanced stages, an approximation for unbalanced ones, where the bottleneck device sets the steady
state and the others add their fill/drain once).

The solver (solvers/partition.py) predicts with these same functions, so a plan's figures equal
:func:`simulate_pipeline`'s.
"""

import dataclasses
from dataclasses import dataclass

from planner.chain import Chain, Loss
from planner.errors import MemschedError
from planner.plan import PIPELINE_SCHEDULES, Plan
from planner.simulator import ChainSimulator
from planner.step_memory import TrainingSetup, parameters_of


@dataclass(frozen=True)
class DeviceResult:
    """One device of a pipeline, per micro-batch (seconds) and in bytes."""

    first: int
    last: int  # exclusive
    in_flight: int  # micro-batches held at once
    static_bytes: int  # parameters, master copy, optimizer state, gradients
    held_bytes: int  # one micro-batch between its forward and its backward
    single_peak: int  # one micro-batch's step peak (its sub-chain's simulated peak)
    compute: float  # the schedule's seconds
    transfer: float  # boundary sends charged to this device
    peak_bytes: int  # static + (in_flight - 1) * held + single_peak

    @property
    def time(self) -> float:
        """Seconds per micro-batch: compute, then the sends."""
        return self.compute + self.transfer


@dataclass(frozen=True)
class PipelineResult:
    """The simulator's verdict on a pipeline plan."""

    time: float  # iteration seconds
    peak_bytes: int  # the largest device peak
    devices: tuple  # of DeviceResult


def in_flight(schedule: str, micro_batches: int, devices: int, device: int) -> int:
    """Micro-batches device ``device`` holds at once: ``m`` for GPipe, ``min(m, P - s)`` for 1F1B."""
    if schedule == "gpipe":
        return micro_batches
    if schedule == "1f1b":
        return min(micro_batches, devices - device)
    raise MemschedError(f"pipeline schedule must be one of {', '.join(PIPELINE_SCHEDULES)}, got {schedule!r}")


def pipeline_time(times, micro_batches: int) -> float:
    """``(m - 1) * max(times) + sum(times)``, the sum taken left to right from device 0."""
    total = 0.0
    for seconds in times:
        total += seconds
    return (micro_batches - 1) * max(times) + total


def transfer_seconds(nbytes: int, bandwidth, latency: float) -> float:
    """``bytes / bandwidth + latency``; 0 without a bandwidth."""
    if bandwidth is None:
        return 0.0
    return nbytes / bandwidth + latency


def sub_chain(chain: Chain, first: int, last: int) -> Chain:
    """Stages ``[first, last)`` as a standalone chain: input ``a_first``, ``param_bytes`` 0, and the chain's loss
    when ``last`` is the chain's end, else a zero loss (its "gradient" is ``δ_last``, received)."""
    if not 0 <= first < last <= chain.length:
        raise MemschedError(f"stage range [{first}, {last}) is not a non-empty range of chain '{chain.name}' "
                            f"({chain.length} stages)")
    stages = tuple(dataclasses.replace(stage, param_bytes=0) for stage in chain.stages[first:last])
    loss = chain.loss if last == chain.length else Loss(0.0, 0)
    return Chain(name=f"{chain.name}[{first}:{last}]", device=chain.device, input_bytes=chain.act_bytes(first),
                 stages=stages, loss=loss)


def range_parameters(chain: Chain, first: int, last: int) -> int:
    """Trainable parameters of stages ``[first, last)``: their ``param_bytes`` / 4, rounded up."""
    return parameters_of(dataclasses.replace(chain, stages=chain.stages[first:last]))


def static_bytes(chain: Chain, first: int, last: int, setup: TrainingSetup) -> int:
    """Resident bytes of stages ``[first, last)``: parameters, master copy, optimizer state and gradients."""
    parameters = range_parameters(chain, first, last)
    return setup.resident_bytes(parameters) + setup.gradient_bytes(parameters)


def sends(chain: Chain, first: int, last: int, bandwidth, latency: float) -> float:
    """Seconds of the transfers a device on ``[first, last)`` sends per micro-batch: ``a_last`` forward (unless
    last), then ``δ_first`` back (unless first)."""
    seconds = 0.0
    if last < chain.length:
        seconds += transfer_seconds(chain.act_bytes(last), bandwidth, latency)
    if first > 0:
        seconds += transfer_seconds(chain.act_bytes(first), bandwidth, latency)
    return seconds


def replay_local(sub: Chain, local_schedule) -> tuple:
    """``(compute seconds, single peak, held bytes)`` of a sub-chain schedule (local stage indices)."""
    result = ChainSimulator(sub).run(local_schedule)
    held = next(step.memory_before for step in result.timeline if step.op.kind == "Loss")
    return result.time, result.peak_bytes, held


def device_peak(static: int, k: int, held: int, single_peak: int) -> int:
    """A device's peak bytes: its static bytes, ``k - 1`` micro-batches held between forward and backward, and
    one micro-batch's step peak."""
    return static + (k - 1) * held + single_peak


def device_result(chain: Chain, first: int, last: int, local_schedule, k: int, setup: TrainingSetup,
                  bandwidth, latency: float, figures=None, static=None) -> DeviceResult:
    """A device's figures; ``figures`` (``replay_local``'s triple) and ``static`` when already known."""
    compute, single, held = figures if figures is not None else replay_local(sub_chain(chain, first, last),
                                                                            local_schedule)
    static = static_bytes(chain, first, last, setup) if static is None else static
    return DeviceResult(first=first, last=last, in_flight=k, static_bytes=static, held_bytes=held,
                        single_peak=single, compute=compute, transfer=sends(chain, first, last, bandwidth, latency),
                        peak_bytes=device_peak(static, k, held, single))


def to_local(schedule, first: int) -> tuple:
    """Global stage indices to the sub-chain's."""
    return tuple(op if op.stage is None else op._replace(stage=op.stage - first) for op in schedule)


def to_global(schedule, first: int) -> tuple:
    """The sub-chain's stage indices to the chain's."""
    return tuple(op if op.stage is None else op._replace(stage=op.stage + first) for op in schedule)


def simulate_pipeline(chain: Chain, plan: Plan, setup: TrainingSetup = None) -> PipelineResult:
    """Re-predict a plan of kind ``pipeline`` from ``chain`` (``setup``: the plan's own when not given)."""
    from planner.plan import check_pipeline_plan_matches

    check_pipeline_plan_matches(plan, chain)
    pipe = plan.pipeline
    setup = setup or TrainingSetup(**pipe.setup)
    if pipe.devices[-1].last != chain.length:
        raise MemschedError(f"pipeline plan: its last device ends at stage {pipe.devices[-1].last}, but chain "
                            f"'{chain.name}' has {chain.length} stages")
    results = []
    for s, device in enumerate(pipe.devices):
        k = in_flight(pipe.schedule, pipe.micro_batches, len(pipe.devices), s)
        local = to_local(device.schedule, device.first)
        try:
            results.append(device_result(chain, device.first, device.last, local, k, setup, pipe.bandwidth,
                                         pipe.latency))
        except MemschedError as exc:
            raise MemschedError(f"pipeline plan: devices[{s}] (stages {device.first} to {device.last - 1}): {exc} "
                                f"(stages numbered from the device's first, {device.first})") from None
    return PipelineResult(time=pipeline_time([r.time for r in results], pipe.micro_batches),
                          peak_bytes=max(r.peak_bytes for r in results), devices=tuple(results))
