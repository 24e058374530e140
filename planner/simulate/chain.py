"""The chain simulator: replays a schedule and predicts its peak memory and time.

It is the judge of every solver. The memory model is that of Beaumont et al.
(arXiv 1911.13214), extended with parameter gradients. What is resident:

* the input ``a_0``, from start to end (the caller holds it);
* each activation ``a_i`` held *standalone* (a checkpoint, made by ``F_ck`` /
  ``F_none`` of stage i-1): ``out_bytes`` of stage i-1;
* each ``ā_{i+1}`` made by ``F_all i``: ``saved_bytes`` of stage i (it contains
  ``a_{i+1}``, which is then available without being held standalone), and
  ``own_saved_bytes`` once ``δ_{i+1}`` exists (no operation reads ``a_{i+1}``
  any more, so an output the stage's backward does not read is freed);
* each gradient ``δ_i``: the size of ``a_i``;
* the parameter gradients of every stage whose backward has run.

Operations (sizes of stage i: x = out_bytes, x̄ = saved_bytes):

* ``F_all i`` needs ``a_i``; peak = resident + x̄ + fwd_tmp; then ``ā_{i+1}`` is resident
  (``own_saved_bytes`` of it if ``δ_{i+1}`` exists already).
* ``F_ck i`` needs ``a_i``; peak = resident + x + nograd_tmp; then ``a_{i+1}`` is resident.
* ``F_none i`` as ``F_ck i``, then frees ``a_i`` if it was held standalone (never the input,
  never a checkpoint: see below).
* ``Loss`` needs ``a_L``; peak = resident + size(δ_L) + loss.tmp_bytes; produces ``δ_L``.
* ``B i`` needs ``ā_{i+1}``, ``δ_{i+1}`` and ``a_i``; peak = resident + size(δ_i) +
  bwd_tmp (bwd_tmp covers the parameter gradients made so far, since autograd
  frees ``ā_{i+1}`` while it makes them), and at least the memory after it;
  frees ``ā_{i+1}`` and ``δ_{i+1}``, keeps ``δ_i`` and the parameter gradients
  (param_bytes) until the step ends; ``ā_i``, if held, shrinks to stage i-1's
  ``own_saved_bytes`` (as after ``Loss`` for ``ā_L``).

Once ``δ_i`` exists, a standalone checkpoint ``a_i`` is released (so ``δ_i``
takes its place); an ``a_i`` inside ``ā_i`` stays until ``B i-1`` frees ``ā_i``,
and the input is never released. This is the model of the published Rotor
implementation, and its class of *persistent* schedules: an activation kept by
``F_ck`` is a checkpoint and stays until the backward that produces its
gradient, so a later ``F_none`` may not release it. Times add up: the step time is the sum of the scheduled
operations' times.
"""

from dataclasses import dataclass
from typing import NamedTuple

from planner.chain import Chain, Loss, Stage
from planner.errors import MemschedError
from planner.ops import TRANSFER_OPS, Op
from planner.plan import Plan, check_plan_matches
from planner.transfer import Transfer


class ScheduleError(MemschedError):
    """A schedule that cannot run: an operation's inputs are missing, or a backward is missing or repeated."""


class State(NamedTuple):
    """What is resident between two operations, as bit masks over activation indices 0..L."""

    standalone: int  # a_i held on its own (bit 0: the input, always)
    checkpoint: int  # standalone a_i kept by F_ck i: released only by its backward
    abar: int  # ā_i held (made by F_all i-1)
    grad: int  # δ_i held
    done: int  # bit i: backward of stage i done; bit L: loss done
    memory: int  # resident bytes


class Step(NamedTuple):
    """One replayed operation: when it ran and the memory around it (bytes, seconds)."""

    index: int
    op: Op
    start: float
    end: float
    memory_before: int
    peak: int
    memory_after: int


@dataclass(frozen=True)
class SimResult:
    """The simulator's verdict on a schedule."""

    peak_bytes: int
    time: float
    timeline: tuple  # of Step


class ChainSimulator:
    """Replays operations on one chain; :meth:`step` is also used by exhaustive searches."""

    def __init__(self, chain: Chain):
        self.chain = chain
        self.length = chain.length
        self.act = [chain.act_bytes(i) for i in range(chain.length + 1)]
        self.full_mask = (1 << (chain.length + 1)) - 1

    def initial_state(self) -> State:
        """Only the input is resident."""
        return State(standalone=1, checkpoint=0, abar=0, grad=0, done=0, memory=self.act[0])

    def is_complete(self, state: State) -> bool:
        """True once the loss and every backward have run."""
        return state.done == self.full_mask

    def step(self, state: State, op: Op):
        """Apply ``op`` to ``state``; return ``(new_state, peak_bytes, seconds)`` or raise ``ValueError``."""
        length = self.length
        if op.kind == "Loss":
            if state.done >> length & 1:
                raise ValueError("the loss has already been computed")
            self._need_activation(state, length)
            peak = state.memory + self.act[length] + self.chain.loss.tmp_bytes
            return self._produce_gradient(state, length, state.memory), peak, self.chain.loss.bwd_time
        i = op.stage
        if i is None or not 0 <= i < length:
            raise ValueError(f"stage must be between 0 and {length - 1}")
        stage = self.chain.stages[i]
        if op.kind == "B":
            if state.done >> i & 1:
                raise ValueError(f"the backward of stage {i} has already run")
            if not state.abar >> (i + 1) & 1:
                raise ValueError(f"ā_{i + 1} is not in memory (run F_all {i} first)")
            if not state.grad >> (i + 1) & 1:
                source = "the loss" if i + 1 == length else f"the backward of stage {i + 1}"
                raise ValueError(f"δ_{i + 1} is not in memory (run {source} first)")
            self._need_activation(state, i)
            bit = ~(1 << (i + 1))
            freed = state._replace(abar=state.abar & bit, grad=state.grad & bit)
            memory = state.memory - stage.own_saved_bytes - stage.out_bytes + stage.param_bytes
            new = self._produce_gradient(freed, i, memory)
            return new, backward_peak(state.memory, self.act[i], stage.bwd_tmp_bytes, new.memory), stage.bwd_time
        if op.kind not in ("F_all", "F_ck", "F_none"):
            raise ValueError(f"unknown operation {op.kind!r}")
        if state.done >> i & 1:
            raise ValueError(f"the backward of stage {i} has already run")
        self._need_activation(state, i)
        out = 1 << (i + 1)
        if op.kind == "F_all":
            if state.abar & out:
                raise ValueError(f"ā_{i + 1} is already in memory")
            peak = state.memory + stage.saved_bytes + stage.fwd_tmp_bytes
            held = stage.own_saved_bytes if state.grad & out else stage.saved_bytes
            new = state._replace(abar=state.abar | out, memory=state.memory + held)
            return new, peak, stage.fwd_time
        if (state.standalone | state.abar) & out:
            raise ValueError(f"a_{i + 1} is already in memory")
        peak = state.memory + stage.out_bytes + stage.nograd_tmp_bytes
        new = state._replace(standalone=state.standalone | out, memory=state.memory + stage.out_bytes)
        held_alone = i > 0 and state.standalone >> i & 1  # the input is the caller's: never released
        if op.kind == "F_ck" and held_alone:
            new = new._replace(checkpoint=new.checkpoint | 1 << i)
        elif op.kind == "F_none" and held_alone:
            if state.checkpoint >> i & 1:
                raise ValueError(f"a_{i} is a checkpoint (kept by F_ck {i}); only the backward of stage {i} releases it")
            new = new._replace(standalone=new.standalone & ~(1 << i), memory=new.memory - self.act[i])
        return new, peak, stage.fwd_time

    def _need_activation(self, state: State, i: int) -> None:
        if not (state.standalone | state.abar) >> i & 1:
            raise ValueError(f"a_{i} is not in memory (keep it with F_ck, or recompute it)")

    def _produce_gradient(self, state: State, i: int, memory: int) -> State:
        """Mark step ``i`` done and hold ``δ_i``, releasing ``a_i`` if it is a standalone checkpoint and
        shrinking ``ā_i`` to what stage i-1's backward reads."""
        bit = 1 << i
        if i > 0 and state.abar & bit:
            producer = self.chain.stages[i - 1]
            memory -= producer.saved_bytes - producer.own_saved_bytes
        if i > 0 and state.standalone & bit:
            standalone, checkpoint = state.standalone & ~bit, state.checkpoint & ~bit
        else:
            standalone, checkpoint = state.standalone, state.checkpoint
            memory += self.act[i]
        return State(standalone=standalone, checkpoint=checkpoint, abar=state.abar, grad=state.grad | bit,
                     done=state.done | bit, memory=memory)

    def run(self, schedule) -> SimResult:
        """Replay a whole schedule; an invalid one raises :class:`ScheduleError` naming the operation."""
        state, result = replay(self.initial_state(), self.step, schedule, "schedule[{index}]")
        if not self.is_complete(state):
            missing = next(i for i in range(self.length, -1, -1) if not state.done >> i & 1)
            what = "the loss" if missing == self.length else f"the backward of stage {missing}"
            raise ScheduleError(f"schedule ends before {what}")
        return result


def backward_peak(memory_before: int, input_gradient: int, bwd_tmp: int, memory_after: int) -> int:
    """The peak of ``B i``: the resident bytes, ``δ_i`` and the stage's backward temporaries, and at least the
    memory after it."""
    return max(memory_before + input_gradient + bwd_tmp, memory_after)


def replay(state, step, schedule, label: str) -> tuple:
    """``(final state, SimResult)``: ``step(state, op) -> (new state, peak bytes, seconds)`` applied to every
    operation in turn (the state has a ``memory`` field in bytes). A ``ValueError`` from ``step`` becomes a
    :class:`ScheduleError` prefixed by ``label`` (formatted with ``index``) and the operation."""
    clock, peak, timeline = 0.0, state.memory, []
    for index, op in enumerate(schedule):
        try:
            new, op_peak, seconds = step(state, op)
        except ValueError as exc:
            raise ScheduleError(f"{label.format(index=index)} ({op}): {exc}") from None
        timeline.append(Step(index, op, clock, clock + seconds, state.memory, op_peak, new.memory))
        clock += seconds
        peak = max(peak, op_peak)
        state = new
    return state, SimResult(peak_bytes=peak, time=clock, timeline=tuple(timeline))


def planned_stages(schedule) -> int:
    """The number of stages a chain schedule runs: one more than the highest stage it computes (0 if none)."""
    return 1 + max((op.stage for op in schedule if op.stage is not None and op.kind not in TRANSFER_OPS), default=-1)


_NO_SIZES = Stage(name="", fwd_time=0.0, bwd_time=0.0, out_bytes=0, saved_bytes=0)


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
    chain = Chain(name="schedule check", device="none", input_bytes=0, stages=(_NO_SIZES,) * length, loss=Loss())
    if any(op.kind in TRANSFER_OPS for op in schedule):
        from planner.simulate.offload import OffloadSimulator

        OffloadSimulator(chain, Transfer(1.0, 1.0)).run(schedule)
    else:
        ChainSimulator(chain).run(schedule)


def check_plan_schedules(plan: Plan, where: str = "plan") -> None:
    """:func:`check_schedule` on a plan's schedule (kind ``chain``: as many stages as it computes) or on each
    pipeline device's (its own stages, numbered from 0 on the device); a graph plan is left to the graph
    simulator, which needs the graph."""
    try:
        if plan.kind == "chain":
            check_schedule(plan.schedule, planned_stages(plan.schedule))
    except ScheduleError as exc:
        raise ScheduleError(f"{where}: {exc}") from None
    if plan.kind != "pipeline":
        return
    for k, device in enumerate(plan.pipeline.devices):
        local = tuple(op if op.stage is None else op._replace(stage=op.stage - device.first) for op in device.schedule)
        try:
            check_schedule(local, device.last - device.first)
        except ScheduleError as exc:
            raise ScheduleError(f"{where}: pipeline.devices[{k}] (stages {device.first} to {device.last - 1}, "
                                f"numbered from 0 on the device): {exc}") from None


def simulate(chain: Chain, plan_or_schedule, transfer=None) -> SimResult:
    """Peak bytes, total seconds and per-operation timeline of a plan (checked against ``chain``) or a schedule.

    A schedule with transfers (an offload plan) is replayed by :mod:`planner.simulate.offload` over the copy
    channel ``transfer``: the plan's own, else the one given, else the chain's."""
    if isinstance(plan_or_schedule, Plan):
        check_plan_matches(plan_or_schedule, chain)
        schedule = plan_or_schedule.schedule
        transfer = plan_or_schedule.transfer or transfer
    else:
        schedule = plan_or_schedule
    if any(op.kind in TRANSFER_OPS for op in schedule):
        from planner.simulate.offload import simulate_offload

        channel = transfer or chain.transfer
        if channel is None:
            raise MemschedError(f"chain '{chain.name}' has no copy channel for this offload schedule; give one "
                                "(--bandwidth 16GB/s) or profile on CUDA")
        return simulate_offload(chain, schedule, channel)
    return ChainSimulator(chain).run(schedule)
