"""The offload simulator: a chain schedule with transfers, on the compute timeline and two copy engines.

Its rules (items, ``Offload`` / ``Release`` / ``Prefetch``, stalls, host-weight stages) are in docs/model.md,
"The offload simulator"; it keeps the chain simulator's memory rules for compute. :class:`OffloadSimulator`
follows the protocol of :func:`planner.simulate.replay.run`. The rules the offload solvers share with it are
module functions: :func:`reads` (the items an operation reads) and :func:`device_bytes` (an item's bytes on
the device).
"""

import math
from dataclasses import dataclass
from typing import NamedTuple

from planner.chain import Chain
from planner.ops import TRANSFER_OPS, Op, activation_read, host_weight_stages
from planner.simulate.chain import ChainSimulator, ChainState
from planner.simulate.replay import ScheduleError, SimResult, run
from planner.transfer import Transfer

COPYING, ON_HOST, LOADING = "copying", "on host", "loading"


class Moving(NamedTuple):
    """An item between the device and the host: its phase, when its current copy ends (s) and its bytes."""

    phase: str
    end: float
    nbytes: int


class Copy(NamedTuple):
    """One transfer on a copy engine (seconds from the step's start, bytes)."""

    op_index: int
    item: tuple  # (what, stage)
    direction: str  # "d2h" or "h2d"
    start: float
    end: float
    nbytes: int


class OffloadState(NamedTuple):
    """The chain state (its memory is the device's) with the clocks and the items that are moving or away."""

    base: ChainState
    position: int  # index of the next operation
    clock: float
    d2h_free: float
    h2d_free: float
    moving: tuple  # sorted ((what, stage), Moving) pairs
    copies: tuple  # of Copy, in issue order
    stall: float

    @property
    def memory(self) -> int:
        return self.base.memory


@dataclass(frozen=True)
class OffloadResult(SimResult):
    """:class:`SimResult` plus the stalls' total (s) and every copy made."""

    stall_time: float = 0.0
    copies: tuple = ()


class OffloadSimulator:
    """Replays a chain schedule with transfers over ``transfer``; ``host_weights``: the stages whose weights it
    moves (:func:`planner.ops.host_weight_stages` of the schedules it runs)."""

    def __init__(self, chain: Chain, transfer: Transfer, host_weights=frozenset()):
        self.chain = chain
        self.transfer = transfer
        self.compute = ChainSimulator(chain)
        self.length = chain.length
        self.host_weights = frozenset(host_weights)

    def initial_state(self) -> OffloadState:
        """Only the input on the device, and the parameters of the host-weight stages on the host."""
        away = tuple(sorted((("weights", i), Moving(ON_HOST, 0.0, self.chain.stages[i].param_bytes))
                            for i in self.host_weights))
        return OffloadState(self.compute.initial_state(), 0, 0.0, 0.0, 0.0, away, (), 0.0)

    def run(self, schedule) -> OffloadResult:
        """Replay a whole schedule; an invalid one raises :class:`ScheduleError` naming the operation."""
        schedule = list(schedule)
        moved = host_weight_stages(schedule)
        bad = sorted(i for i in moved if not 0 <= i < self.length)
        if bad:
            raise ScheduleError(f"schedule moves the weights of stage {bad[0]}, which does not exist")
        if moved != self.host_weights:
            raise ValueError(f"the schedule moves the weights of stages {sorted(moved)}, not of "
                             f"{sorted(self.host_weights)}: build the simulator with host_weight_stages(schedule)")
        state, result = run(self, schedule, "schedule[{index}]")
        return OffloadResult(peak_bytes=result.peak_bytes, time=result.time, timeline=result.timeline,
                             stall_time=state.stall, copies=state.copies)

    def check_complete(self, state: OffloadState) -> None:
        """Raise :class:`ScheduleError` unless every activation is back on the device and still, every
        host-weight stage's weights and gradients are on the host, and the loss and every backward have run."""
        for (what, stage), moving in state.moving:
            if moving.phase == ON_HOST and what in ("weights", "grads"):
                continue
            if moving.phase == COPYING:
                raise ScheduleError(f"schedule ends while {what} {stage} is still offloaded without Release")
            raise ScheduleError(f"schedule ends with {what} {stage} {moving.phase}")
        away = dict(state.moving)
        for i in sorted(self.host_weights):
            if ("weights", i) not in away:
                raise ScheduleError(f"schedule ends with the weights of stage {i} on the device (Release them: a "
                                    "host-weight stage's parameters stay on the host, where its optimizer steps)")
            if self.chain.stages[i].param_bytes and ("grads", i) not in away:
                raise ScheduleError(f"schedule ends with the gradients of host-weight stage {i} on the device "
                                    "(Offload and Release them: its optimizer steps on the host)")
        self.compute.check_complete(state.base)

    def step(self, state: OffloadState, op: Op):
        """Apply ``op``; return ``(new_state, peak_bytes, seconds)`` or raise ``ValueError``."""
        new, peak, seconds = self._transfer(state, op) if op.kind in TRANSFER_OPS else self._compute(state, op)
        return new._replace(position=state.position + 1), peak, seconds

    def _compute(self, state: OffloadState, op: Op):
        moving = dict(state.moving)
        stall = 0.0
        for item in reads(self.chain, state.base, op, self.host_weights):
            if item in moving:
                phase, end, _ = moving[item]
                if phase == ON_HOST:
                    raise ValueError(f"{item[0]} {item[1]} is on the host (Prefetch it before this operation)")
                if phase == LOADING:
                    stall = max(stall, end - state.clock)
                    del moving[item]
        for item in _frees(self.length, op):
            if item in moving:
                raise ValueError(f"{item[0]} {item[1]} is still being offloaded (Release it before this operation "
                                 "frees it, or do not offload it)")
        base, peak, seconds = self.compute.step(state.base, op)
        self._shrink_moving(state.base, base, op, moving)
        stall = max(0.0, stall)
        new = state._replace(base=base, clock=state.clock + stall + seconds, moving=tuple(sorted(moving.items())),
                             stall=state.stall + stall)
        return new, peak, stall + seconds

    def _transfer(self, state: OffloadState, op: Op):
        item = (op.what, op.stage)
        moving = dict(state.moving)
        current = moving.get(item)
        base = state.base
        if op.what == "weights" and op.kind == "Offload":
            raise ValueError("weights are never copied to the host (the host copy is current): Release them")
        if op.what == "grads":
            if op.stage not in self.host_weights:
                raise ValueError(f"only a host-weight stage's gradients move (its optimizer steps on the host); stage "
                                 f"{op.stage}'s weights stay on the device")
            if op.kind == "Prefetch":
                raise ValueError("gradients on the host stay there (the optimizer steps on the host)")
        if op.what == "weights" and op.kind == "Release":
            return self._release_weights(state, op, current, moving)
        if op.kind == "Offload":
            stall = 0.0
            if current is not None and current.phase == LOADING:  # it must be back first: wait, as a read would
                stall = max(0.0, current.end - state.clock)
                del moving[item]
            elif current is not None:
                raise ValueError(f"{op.what} {op.stage} is already {current.phase}")
            nbytes = device_bytes(self.chain, base, item)
            clock = state.clock + stall
            start = max(clock, state.d2h_free)
            end = start + self._seconds(nbytes, "d2h")
            moving[item] = Moving(COPYING, end, nbytes)
            new = state._replace(clock=clock, d2h_free=end, moving=tuple(sorted(moving.items())),
                                 stall=state.stall + stall,
                                 copies=state.copies + (Copy(state.position, item, "d2h", start, end, nbytes),))
            return new, base.memory, stall
        if op.kind == "Release":
            if current is None or current.phase != COPYING:
                raise ValueError(f"{op.what} {op.stage} is not being offloaded (Offload it first)")
            stall = max(0.0, current.end - state.clock)
            moving[item] = Moving(ON_HOST, current.end, current.nbytes)
            new = state._replace(base=base._replace(memory=base.memory - current.nbytes), clock=state.clock + stall,
                                 moving=tuple(sorted(moving.items())), stall=state.stall + stall)
            return new, base.memory, stall
        if current is None or current.phase != ON_HOST:
            raise ValueError(f"{op.what} {op.stage} is not on the host (Offload and Release it first)")
        start = max(state.clock, state.h2d_free, current.end)
        end = start + self._seconds(current.nbytes, "h2d")
        moving[item] = Moving(LOADING, end, current.nbytes)
        memory = base.memory + current.nbytes
        new = state._replace(base=base._replace(memory=memory), h2d_free=end, moving=tuple(sorted(moving.items())),
                             copies=state.copies + (Copy(state.position, item, "h2d", start, end, current.nbytes),))
        return new, memory, 0.0

    def _release_weights(self, state: OffloadState, op: Op, current, moving: dict):
        """Drop a stage's device parameters at once (waiting for a prefetch still in flight): no copy back."""
        if current is not None and current.phase != LOADING:
            raise ValueError(f"weights {op.stage} are not on the device (Prefetch them first)")
        stall = 0.0 if current is None else max(0.0, current.end - state.clock)
        nbytes = self.chain.stages[op.stage].param_bytes
        moving[("weights", op.stage)] = Moving(ON_HOST, state.clock + stall, nbytes)
        base = state.base
        new = state._replace(base=base._replace(memory=base.memory - nbytes), clock=state.clock + stall,
                             moving=tuple(sorted(moving.items())), stall=state.stall + stall)
        return new, base.memory, stall

    def _seconds(self, nbytes: int, direction: str) -> float:
        seconds = self.transfer.seconds(nbytes, direction)
        if math.isinf(seconds):
            raise ValueError(f"the copy channel has no {direction} bandwidth (give one with --bandwidth)")
        return seconds

    def _shrink_moving(self, before: ChainState, after: ChainState, op: Op, moving: dict) -> None:
        """When ``δ_i`` appears while ``ā_i`` is being offloaded, the bytes it will release and bring back (in
        ``moving``) are the shrunk ones."""
        i = self.length if op.kind == "Loss" else op.stage if op.kind == "B" else None
        item = ("saved", i - 1) if i else None
        if item in moving and not before.grad >> i & 1 and after.grad >> i & 1:
            producer = self.chain.stages[i - 1]
            moving[item] = moving[item]._replace(nbytes=producer.own_saved_bytes)


def device_bytes(chain: Chain, state: ChainState, item) -> int:
    """Bytes of ``item`` (``(what, stage)``) on the device in the chain state ``state``; a ``ValueError`` if it
    is not there."""
    what, i = item
    if what == "grads":
        if not 0 <= i < chain.length or not state.done >> i & 1:
            raise ValueError(f"the gradients of stage {i} do not exist yet (B {i} makes them)")
        return chain.stages[i].param_bytes
    if what == "saved":
        if not 0 <= i < chain.length or not state.abar >> (i + 1) & 1:
            raise ValueError(f"ā_{i + 1} is not in memory (F_all {i} keeps it)")
        stage = chain.stages[i]
        return stage.own_saved_bytes if state.grad >> (i + 1) & 1 else stage.saved_bytes
    if not 1 <= i <= chain.length or not state.standalone >> i & 1:
        raise ValueError(f"a_{i} is not held on its own (the input a_0 is the caller's and is never offloaded)")
    return chain.act_bytes(i)


def reads(chain: Chain, state: ChainState, op: Op, host_weights=frozenset()) -> list:
    """The items the compute operation ``op`` reads in the chain state ``state``: ``ā_{i+1}`` for ``B i``, the
    item holding the activation it reads (:func:`planner.ops.activation_read`), and the weights of a stage in
    ``host_weights``."""
    i = activation_read(op, chain.length)
    items = [("saved", op.stage)] if op.kind == "B" else []
    if i is not None and (op.kind in ("Loss", "B") or 0 <= i < chain.length):
        items.append(_provider(state, i))
    if op.stage in host_weights:
        items.append(("weights", op.stage))
    return [item for item in items if item is not None]


def _provider(state: ChainState, i: int):
    """The item that holds ``a_i``: ``ā_i`` when it is resident, else the standalone ``a_i`` (None for the input)."""
    if i > 0 and state.abar >> i & 1:
        return ("saved", i - 1)
    return ("input", i) if i > 0 else None


def _frees(length: int, op: Op) -> list:
    """The items the compute operation ``op`` frees (a chain of ``length`` stages)."""
    if op.kind == "Loss":
        return [("input", length)]
    if op.kind == "B":
        return [("saved", op.stage), ("input", op.stage)]
    return [("input", op.stage)] if op.kind == "F_none" else []
