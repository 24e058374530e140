"""The pipeline simulator: per-device peak memory and the iteration time of a pipeline plan.

Device ``s`` holds the stages ``[first_s, last_s)`` of a chain profiled for one micro-batch and runs ``m``
micro-batches per iteration in the order of PyTorch's schedules (GPipe, 1F1B), as
planner/execute/pipeline.py does. Each device's schedule is replayed on its :func:`sub_chain` by the chain
simulator; :func:`device_state`, :func:`micro_batch` and :func:`step_peak` turn the replay into the device's
peak, and :func:`pipeline_time` into the iteration time. The rules and their measured accuracy are in
docs/model.md, "The pipeline simulator". The solver (solvers/partition.py) predicts with these same
functions, so a plan's figures equal :func:`pipeline_result`'s.
"""

import dataclasses
from dataclasses import dataclass

from planner.chain import Chain, Loss
from planner.errors import MemschedError
from planner.plan import PIPELINE_SCHEDULES, Pipeline
from planner.setup.training import TrainingSetup, parameters_in
from planner.simulate.chain import ChainSimulator
from planner.simulate.replay import backward_peak
from planner.units import sum_seconds


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch on a device: seconds, and bytes above what the device holds for the whole step."""

    compute: float  # the schedule's seconds
    forward_peak: int  # during its forward operations
    held: int  # between its forward and its backward
    backward_peak: int  # during its loss and backward operations, the parameter gradients existing
    first_backward_peak: int  # the same when the device's parameter gradients are made in it (included)


@dataclass(frozen=True)
class DeviceState:
    """What a device on stages ``[first, last)`` holds besides its micro-batches (bytes)."""

    resident: int  # parameters, master copy, optimizer state
    buffers: int  # m inputs, and m received gradients unless last
    stage_gradients: tuple  # the setup's parameter gradients of each stage (scaled from param_bytes, rounded up)
    input_gradient: int  # δ_first, sent back after each backward (0 on device 0: its input needs none)
    output: int  # a_last, sent forward (the model's output on the last device)
    loss_saved: int  # on the last device, what the loss's forward leaves until the backward; else 0
    still_held: tuple  # per local stage: bytes of the output the engine still holds at its backward
    is_last: bool

    @property
    def gradients(self) -> int:
        """The device's parameter gradients (bytes)."""
        return sum(self.stage_gradients)


@dataclass(frozen=True)
class DeviceResult:
    """One device of a pipeline, per micro-batch (seconds) and in bytes."""

    first: int
    last: int  # exclusive
    in_flight: int  # forwards before the first backward
    resident_bytes: int  # parameters, master copy, optimizer state
    buffer_bytes: int  # the step's m inputs and m received gradients
    gradient_bytes: int  # parameter gradients, made in the first backward
    micro: MicroBatch
    step_peak: int  # above resident and buffers: gradients and micro-batches (step_peak)
    transfer: float  # boundary sends charged to this device
    peak_bytes: int  # resident + buffers + step_peak
    sync: float = 0.0  # seconds per step summing its copies' gradients with the other devices (sync_seconds)

    @property
    def time(self) -> float:
        """Seconds per micro-batch: compute, then the sends."""
        return self.micro.compute + self.transfer


@dataclass(frozen=True)
class PipelineResult:
    """The simulator's verdict on a pipeline plan."""

    time: float  # iteration seconds
    peak_bytes: int  # the largest device peak
    devices: tuple  # of DeviceResult


def in_flight(schedule: str, micro_batches: int, devices: int, device: int) -> int:
    """Forwards device ``device`` starts before its first backward: ``m`` for GPipe, ``min(m, P - s)`` for 1F1B."""
    if schedule == "gpipe":
        return micro_batches
    if schedule == "1f1b":
        return min(micro_batches, devices - device)
    raise MemschedError(f"pipeline schedule must be one of {', '.join(PIPELINE_SCHEDULES)}, got {schedule!r}")


def phase_runs(k: int, micro_batches: int) -> tuple:
    """A device's phases in PyTorch's order, ``F`` (a micro-batch's forward) and ``B`` (its loss and backward),
    micro-batches in order: ``k`` forwards, then one backward and one forward while forwards remain, then the
    remaining backwards (GPipe is ``k = m``). As runs ``(phase, count, held, held_step, done, done_step)``:
    ``count`` phases of one kind, the ``i``-th of which runs with ``held + i * held_step`` micro-batches held
    besides its own (for a backward: once its own is taken off) and ``done + i * done_step`` backwards done
    before it. The steady phase's backwards and forwards alternate; they are two runs here."""
    m = micro_batches
    return (("F", k, 0, 1, 0, 0), ("B", m - k, k - 1, 0, 0, 1), ("F", m - k, k - 1, 0, 1, 1),
            ("B", k, k - 1, -1, m - k, 1))


def step_peak(micro: MicroBatch, schedule: str, k: int, micro_batches: int, state: DeviceState) -> int:
    """The device's highest point above its resident state and buffers over one step (docs/model.md, "The
    pipeline simulator").

    Within a run (:func:`phase_runs`) a phase's height is affine in its index, except where the backwards done
    cross 1 (the gradients exist), ``k - 1`` or ``m - k + 1`` (what :func:`retained` holds), so the highest is
    at a run's ends or beside a crossing: those phases alone are evaluated, a few per run whatever ``m``."""
    crossings = (1, k - 1, micro_batches - k + 1)
    peak = 0
    for phase, count, held, held_step, done, done_step in phase_runs(k, micro_batches):
        for i in _ends_and_crossings(count, done, done_step, crossings):
            peak = max(peak, phase_peak(micro, schedule, phase, k, micro_batches, held + i * held_step,
                                        done + i * done_step, state))
    return peak


def phase_peak(micro: MicroBatch, schedule: str, phase: str, k: int, micro_batches: int, held: int, done: int,
               state: DeviceState) -> int:
    """The height of one phase above resident state and buffers: what the engine retains of finished
    micro-batches, ``held`` micro-batches between their forward and backward, the parameter gradients once
    made, and the running micro-batch's peak (its first backward makes the gradients)."""
    base = retained(schedule, phase, k, micro_batches, done, state) + held * micro.held
    if phase == "F":
        return base + micro.forward_peak + (state.gradients if done else 0)
    return base + (micro.backward_peak + state.gradients if done else micro.first_backward_peak)


def _ends_and_crossings(count: int, done: int, done_step: int, crossings) -> list:
    """Indices in a run of ``count`` phases: its first and last, and where ``done`` moves, those on each side of
    every crossing."""
    picked = {0, count - 1}
    if done_step:
        for crossing in crossings:
            picked.update((crossing - 1 - done, crossing - done))
    return sorted(i for i in picked if 0 <= i < count)


def device_peak(micro: MicroBatch, schedule: str, k: int, micro_batches: int, state: DeviceState) -> int:
    """The device's peak bytes: its resident state, its buffers and :func:`step_peak`."""
    return state.resident + state.buffers + step_peak(micro, schedule, k, micro_batches, state)


def pipeline_time(times, micro_batches: int, syncs=()) -> float:
    """``(m - 1) * max(times) + sum(times)``, the sum taken left to right from device 0, plus the devices'
    gradient sums of shared parameters (``syncs``, seconds per step, :func:`sync_seconds`)."""
    return (micro_batches - 1) * max(times) + sum_seconds([*times, *syncs])


def transfer_seconds(nbytes: int, bandwidth, latency: float) -> float:
    """``bytes / bandwidth + latency``; 0 without a bandwidth."""
    if bandwidth is None:
        return 0.0
    return nbytes / bandwidth + latency


def sub_chain(chain: Chain, first: int, last: int) -> Chain:
    """Stages ``[first, last)`` as a standalone chain: input ``a_first``, ``param_bytes`` 0 (the device's
    gradients are counted by :func:`step_peak`), the last stage keeping its whole ``ā_last`` until its backward,
    the chain's loss when ``last`` is the chain's end, else a zero loss (its "gradient" is ``δ_last``,
    received)."""
    if not 0 <= first < last <= chain.length:
        raise MemschedError(f"stage range [{first}, {last}) is not a non-empty range of chain '{chain.name}' "
                            f"({chain.length} stages)")
    stages = [dataclasses.replace(stage, param_bytes=0) for stage in chain.stages[first:last]]
    # The engine holds the last stage's output through its backward: its temporaries as measured so.
    stages[-1] = dataclasses.replace(stages[-1], own_saved_bytes=stages[-1].saved_bytes,
                                     bwd_tmp_bytes=stages[-1].held_bwd_tmp, held_bwd_tmp_bytes=None)
    loss = chain.loss if last == chain.length else Loss(0.0, 0)
    return Chain(name=f"{chain.name}[{first}:{last}]", device=chain.device, input_bytes=chain.act_bytes(first),
                 stages=tuple(stages), loss=loss)


def _scaled(param_bytes, gradients: int) -> tuple:
    """Each stage's parameter bytes scaled to ``gradients`` bytes in all, rounded up (0 without parameters)."""
    total = sum(param_bytes)
    return tuple(-(-nbytes * gradients // total) if total else 0 for nbytes in param_bytes)


def copies(chain: Chain, first: int, last: int) -> tuple:
    """The shared parameters (planner/shared.py) a device on stages ``[first, last)`` holds a copy of: read by one
    of its stages, owned (counted in ``param_bytes``) by a stage of a later device."""
    return tuple(entry for entry in chain.shared
                 if entry.owner >= last and any(first <= stage < last for stage in entry.stages))


def device_param_bytes(chain: Chain, first: int, last: int) -> tuple:
    """Per stage of ``[first, last)``, the parameter bytes the device holds for it: its ``param_bytes``, and at
    the device's last reader of each copy (:func:`copies`) the copy's bytes (its backward runs first and makes
    the copy's gradient). A parameter shared within the device stays counted once, by its owner."""
    extra = [0] * (last - first)
    for entry in copies(chain, first, last):
        extra[max(stage for stage in entry.stages if stage < last) - first] += entry.bytes
    return tuple(stage.param_bytes + more for stage, more in zip(chain.stages[first:last], extra))


def range_parameters(chain: Chain, first: int, last: int) -> int:
    """Trainable parameters a device on stages ``[first, last)`` holds: :func:`device_param_bytes` over the chain's
    gradient element size, rounded up (as planner.setup.training.parameters_of counts a chain)."""
    return parameters_in(chain, sum(device_param_bytes(chain, first, last)))


def sync_seconds(chain: Chain, first: int, last: int, setup: TrainingSetup, bandwidth, latency: float) -> float:
    """Seconds per step a device on ``[first, last)`` spends summing its copies' gradients with the other devices
    holding them, after its last backward: one exchange of each copy's gradient (the setup's size),
    ``bytes / bandwidth + latency``; 0 without a bandwidth."""
    return sum(transfer_seconds(setup.gradient_bytes(parameters_in(chain, entry.bytes)), bandwidth, latency)
               for entry in copies(chain, first, last))


def device_state(chain: Chain, first: int, last: int, setup: TrainingSetup, micro_batches: int) -> DeviceState:
    """The step-long memory of a device on stages ``[first, last)`` (docs/model.md, "The pipeline simulator")."""
    parameters = range_parameters(chain, first, last)
    is_last = last == chain.length
    output = chain.act_bytes(last)
    # NOTE [the engine holds a device's output]
    # The engine keeps the device's output a_last until the micro-batch's whole backward has run, where the replay
    # frees it with the last stage's backward: every earlier stage's backward holds it too. (An earlier stage's
    # own output, saved by its last operation, dies first thing in its backward, as the profiler measures it.)
    still_held = (output,) * (last - 1 - first) + (0,)
    return DeviceState(resident=setup.resident_bytes(parameters),
                       buffers=micro_batches * (chain.act_bytes(first) + (0 if is_last else output)),
                       stage_gradients=_scaled(device_param_bytes(chain, first, last),
                                               setup.gradient_bytes(parameters)),
                       input_gradient=chain.act_bytes(first) if first > 0 else 0, output=output,
                       loss_saved=chain.loss.saved_bytes if is_last else 0, still_held=still_held, is_last=is_last)


def retained(schedule: str, phase: str, k: int, micro_batches: int, done: int, state: DeviceState) -> int:
    """Bytes of finished micro-batches the engine still references at a phase, ``done`` backwards in: GPipe
    keeps every send's tensor until the step ends (``δ_first``, and ``a_last`` unless last); 1F1B keeps the
    latest finished micro-batch's ``δ_first`` until the next backward ends, on the last device its output
    until the next forward ends, and before the last device micro-batch ``k - 2``'s ``a_last`` (its warm-up
    send) from its backward to the end of the steady phase (backward ``m - k``)."""
    if schedule == "gpipe":
        return done * (state.input_gradient + (0 if state.is_last else state.output))
    if not done:
        return 0
    kept = state.input_gradient
    if state.is_last and phase == "F":
        kept += state.output
    if not state.is_last and k - 1 <= done <= micro_batches - k:
        kept += state.output
    return kept


def sends(chain: Chain, first: int, last: int, bandwidth, latency: float) -> float:
    """Seconds of the transfers a device on ``[first, last)`` sends per micro-batch: ``a_last`` forward (unless
    last), then ``δ_first`` back (unless first)."""
    seconds = 0.0
    if last < chain.length:
        seconds += transfer_seconds(chain.act_bytes(last), bandwidth, latency)
    if first > 0:
        seconds += transfer_seconds(chain.act_bytes(first), bandwidth, latency)
    return seconds


def _phases(timeline, input_bytes: int, at_loss: int, still_held: tuple) -> tuple:
    """``(forward peak, held, backward peak)`` of a replayed sub-chain as the engine runs it: less its input
    (always resident in the replay; in the device's buffers); ``at_loss`` more at ``Loss`` (:func:`micro_batch`);
    ``still_held[i]`` more at the backward of local stage ``i`` (:func:`device_state`). (On device 0 the replay's
    ``δ_0`` at the backward of stage 0 stands for nothing the engine makes, but the profile measured that
    backward's temporaries less it, so the two offset.)"""
    forward_peak = backward_peak = held = 0
    backward = False
    for step in timeline:
        peak = step.peak - input_bytes
        if step.op.kind == "Loss":
            held, backward = step.memory_before - input_bytes, True
            peak += at_loss
        elif step.op.kind == "B":
            peak += still_held[step.op.stage]
        if backward:
            backward_peak = max(backward_peak, peak)
        else:
            forward_peak = max(forward_peak, peak)
    return forward_peak, held, backward_peak


def _with_gradients(timeline, sub: Chain, stage_gradients) -> list:
    """The replay's steps as the same replay with each stage's ``B`` also making its parameter gradients
    (``stage_gradients``, kept to the end) gives them: every later operation higher by the gradients made."""
    made, steps = 0, []
    for step in timeline:
        before, after, peak = step.memory_before + made, step.memory_after + made, step.peak + made
        if step.op.kind == "B":
            i = step.op.stage
            after += stage_gradients[i]
            peak = backward_peak(before, sub.act_bytes(i), sub.stages[i].bwd_tmp_bytes, after)
            made += stage_gradients[i]
        steps.append(step._replace(memory_before=before, peak=peak, memory_after=after))
    return steps


def micro_batch(chain: Chain, first: int, last: int, local_schedule, state: DeviceState, sub=None) -> MicroBatch:
    """One micro-batch of a device's schedule (local stage indices) on stages ``[first, last)``; ``sub``: its
    :func:`sub_chain` when already built."""
    input_bytes = chain.act_bytes(first)
    sub = sub or sub_chain(chain, first, last)
    warm = ChainSimulator(sub).run(local_schedule)
    fresh = _with_gradients(warm.timeline, sub, state.stage_gradients)
    # NOTE [a device's Loss]
    # At Loss: a received gradient is in its buffer; the chain's loss was profiled with the last stage's output
    # freed once read (unless the stage saved it), which the engine keeps until the backward.
    last_stage = chain.stages[last - 1]
    at_loss = (last_stage.saved_bytes - last_stage.own_saved_bytes if state.is_last
               else -chain.act_bytes(last))
    engine = (input_bytes, at_loss, state.still_held)
    forward_peak, held, backward_peak = _phases(warm.timeline, *engine)
    first_backward_peak = _phases(fresh, *engine)[2]
    held += state.loss_saved  # the engine runs the loss's forward at the end of the last device's forward phase
    forward_peak = max(forward_peak, held)
    return MicroBatch(compute=warm.time, forward_peak=forward_peak, held=held, backward_peak=backward_peak,
                      first_backward_peak=first_backward_peak)


def device_result(chain: Chain, first: int, last: int, local_schedule, schedule: str, k: int, micro_batches: int,
                  setup: TrainingSetup, bandwidth, latency: float, micro: MicroBatch = None,
                  state: DeviceState = None) -> DeviceResult:
    """A device's figures under pipeline ``schedule``; ``micro`` and ``state`` when already known."""
    state = device_state(chain, first, last, setup, micro_batches) if state is None else state
    micro = micro_batch(chain, first, last, local_schedule, state) if micro is None else micro
    peak = device_peak(micro, schedule, k, micro_batches, state)
    return DeviceResult(first=first, last=last, in_flight=k, resident_bytes=state.resident,
                        buffer_bytes=state.buffers, gradient_bytes=state.gradients, micro=micro,
                        step_peak=peak - state.resident - state.buffers,
                        transfer=sends(chain, first, last, bandwidth, latency), peak_bytes=peak,
                        sync=sync_seconds(chain, first, last, setup, bandwidth, latency))


def to_local(schedule, first: int) -> tuple:
    """Global stage indices to the sub-chain's."""
    return tuple(op if op.stage is None else op._replace(stage=op.stage - first) for op in schedule)


def to_global(schedule, first: int) -> tuple:
    """The sub-chain's stage indices to the chain's."""
    return tuple(op if op.stage is None else op._replace(stage=op.stage + first) for op in schedule)


def pipeline_result(chain: Chain, pipe: Pipeline) -> PipelineResult:
    """Re-predict the devices of a pipeline plan (``plan.pipeline``) from ``chain``, under the plan's training
    setup; :func:`planner.simulate.simulate` first checks that the plan is for ``chain``."""
    setup = TrainingSetup(**pipe.setup)
    if pipe.devices[-1].last != chain.length:
        raise MemschedError(f"pipeline plan: its last device ends at stage {pipe.devices[-1].last}, but chain "
                            f"'{chain.name}' has {chain.length} stages")
    results = []
    for s, device in enumerate(pipe.devices):
        k = in_flight(pipe.schedule, pipe.micro_batches, len(pipe.devices), s)
        local = to_local(device.schedule, device.first)
        try:
            results.append(device_result(chain, device.first, device.last, local, pipe.schedule, k,
                                         pipe.micro_batches, setup, pipe.bandwidth, pipe.latency))
        except MemschedError as exc:
            raise MemschedError(f"pipeline plan: devices[{s}] (stages {device.first} to {device.last - 1}): {exc} "
                                f"(stages numbered from the device's first, {device.first})") from None
    return PipelineResult(time=pipeline_time([r.time for r in results], pipe.micro_batches, [r.sync for r in results]),
                          peak_bytes=max(r.peak_bytes for r in results), devices=tuple(results))
