"""The offload simulator: a chain schedule with transfers over the copy channel, on two timelines.

Compute runs one operation at a time, as in :mod:`planner.simulate.chain`, whose
memory rules it keeps. Beside it run the two copy engines of
:class:`planner.transfer.Transfer` (device-to-host, host-to-device), each one
transfer at a time in issue order. An *item* is ``saved i`` (``ā_{i+1}``, what
``F_all i`` keeps) or ``input i`` (``a_i`` held on its own, i >= 1).

* ``Offload i what``: the item must be on the device and not moving (one
  being prefetched is waited for first, as a read would). Its copy starts
  when the d2h engine is free (not before now) and takes ``latency + bytes /
  d2h_bandwidth``; the device copy stays (operations may still read it). No
  compute time, no memory change.
* ``Release i what``: compute waits until that copy has ended (a *stall*), then
  the device copy is freed.
* ``Prefetch i what``: the item's device memory is allocated now; the copy
  starts when the h2d engine is free and the item is on the host.
* A compute operation that reads an item being prefetched waits for the copy
  (a stall) before it starts; one that reads an item on the host is an error.
  An operation may not free an item whose offload copy is still running, and
  a schedule may not end with an activation that is moving or on the host.

Memory is the device's: bytes resident between operations, and each compute
operation's peak as in the chain simulator. The step time is compute time plus
stalls; the copies themselves overlap compute.

**Weights** (the ZeRO-Offload pattern). A stage whose ``weights i`` the
schedule moves is a *host-weight stage*: its parameters (``param_bytes``) are
on the host at the start, and every compute operation of the stage reads them.
``Prefetch i weights`` brings them in as for any item; ``Release i weights``
drops the device copy at once, with no copy back (the host copy is current;
an ``Offload`` of weights is refused). After ``B i`` the stage's gradients,
``grads i``, are copied out (``Offload``) and freed (``Release``) as any item,
and never come back: the stage's optimizer steps on the host. The schedule
must end with a host-weight stage's weights and gradients on the host. The
other stages' parameters stay on the device, outside the budget as before.

When ``δ_i`` appears while ``ā_i`` is being offloaded, the device copy shrinks to
``own_saved_bytes`` as it would on the device, and the released and prefetched
bytes are those (the part the stage's backward reads).
"""

import math
from dataclasses import dataclass
from typing import NamedTuple

from planner.chain import Chain
from planner.ops import TRANSFER_OPS, Op
from planner.simulate.chain import ChainSimulator, ScheduleError, SimResult, State, replay
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

    base: State
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
    """Replays a chain schedule with transfers (see the module docstring)."""

    def __init__(self, chain: Chain, transfer: Transfer, host_weights=()):
        self.chain = chain
        self.transfer = transfer
        self.compute = ChainSimulator(chain)
        self.length = chain.length
        self.host_weights = frozenset(host_weights)

    def initial_state(self) -> OffloadState:
        """Only the input on the device, and the parameters of the host-weight stages on the host."""
        away = tuple(sorted((("weights", i), Moving(ON_HOST, 0.0, self.chain.stages[i].param_bytes))
                            for i in self.host_weights))
        return OffloadState(self.compute.initial_state(), 0.0, 0.0, 0.0, away, (), 0.0)

    def run(self, schedule) -> OffloadResult:
        """Replay a whole schedule (its host-weight stages are those whose weights it moves); an invalid one
        raises :class:`ScheduleError` naming the operation."""
        schedule = list(schedule)
        host_weights = host_weight_stages(schedule)
        bad = sorted(i for i in host_weights if not 0 <= i < self.length)
        if bad:
            raise ScheduleError(f"schedule moves the weights of stage {bad[0]}, which does not exist")
        if host_weights != self.host_weights:
            return OffloadSimulator(self.chain, self.transfer, host_weights).run(schedule)
        self._index = 0
        state, result = replay(self.initial_state(), self._counted_step, schedule, "schedule[{index}]")
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
        if not self.compute.is_complete(state.base):
            self.compute.run([op for op in schedule if op.kind not in TRANSFER_OPS])  # raises the missing step
        return OffloadResult(peak_bytes=result.peak_bytes, time=result.time, timeline=result.timeline,
                             stall_time=state.stall, copies=state.copies)

    def _counted_step(self, state, op):
        try:
            return self.step(state, op, self._index)
        finally:
            self._index += 1

    def step(self, state: OffloadState, op: Op, index: int = 0):
        """Apply ``op``; return ``(new_state, peak_bytes, seconds)`` or raise ``ValueError``."""
        if op.kind in TRANSFER_OPS:
            return self._transfer(state, op, index)
        moving = dict(state.moving)
        stall = 0.0
        for item in self.reads(state.base, op):
            if item in moving:
                phase, end, _ = moving[item]
                if phase == ON_HOST:
                    raise ValueError(f"{item[0]} {item[1]} is on the host (Prefetch it before this operation)")
                if phase == LOADING:
                    stall = max(stall, end - state.clock)
                    del moving[item]
        for item in self._frees(state.base, op):
            if item in moving:
                raise ValueError(f"{item[0]} {item[1]} is still being offloaded (Release it before this operation "
                                 "frees it, or do not offload it)")
        base, peak, seconds = self.compute.step(state.base, op)
        self._shrink_moving(state.base, base, op, moving)
        stall = max(0.0, stall)
        new = state._replace(base=base, clock=state.clock + stall + seconds, moving=tuple(sorted(moving.items())),
                             stall=state.stall + stall)
        return new, peak, stall + seconds

    def _transfer(self, state: OffloadState, op: Op, index: int):
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
            nbytes = self.device_bytes(base, item)
            clock = state.clock + stall
            start = max(clock, state.d2h_free)
            end = start + self._seconds(nbytes, "d2h")
            moving[item] = Moving(COPYING, end, nbytes)
            new = state._replace(clock=clock, d2h_free=end, moving=tuple(sorted(moving.items())), stall=state.stall + stall,
                                 copies=state.copies + (Copy(index, item, "d2h", start, end, nbytes),))
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
                             copies=state.copies + (Copy(index, item, "h2d", start, end, current.nbytes),))
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

    def device_bytes(self, base: State, item) -> int:
        """Bytes of an item on the device; a ``ValueError`` if it is not there."""
        what, i = item
        if what == "grads":
            if not 0 <= i < self.length or not base.done >> i & 1:
                raise ValueError(f"the gradients of stage {i} do not exist yet (B {i} makes them)")
            return self.chain.stages[i].param_bytes
        if what == "saved":
            if not 0 <= i < self.length or not base.abar >> (i + 1) & 1:
                raise ValueError(f"ā_{i + 1} is not in memory (F_all {i} keeps it)")
            stage = self.chain.stages[i]
            return stage.own_saved_bytes if base.grad >> (i + 1) & 1 else stage.saved_bytes
        if not 1 <= i <= self.length or not base.standalone >> i & 1:
            raise ValueError(f"a_{i} is not held on its own (the input a_0 is the caller's and is never offloaded)")
        return self.compute.act[i]

    def _provider(self, base: State, i: int):
        """The item that holds ``a_i``: ``ā_i`` when it is resident, else the standalone ``a_i`` (None for the input)."""
        if i > 0 and base.abar >> i & 1:
            return ("saved", i - 1)
        return ("input", i) if i > 0 else None

    def reads(self, base: State, op: Op) -> list:
        """The items ``op`` reads (the solvers use this rule too)."""
        if op.kind == "Loss":
            items = [self._provider(base, self.length)]
        elif op.kind == "B":
            items = [("saved", op.stage), self._provider(base, op.stage)]
        else:
            items = [self._provider(base, op.stage)] if op.stage is not None and 0 <= op.stage < self.length else []
        if op.stage in self.host_weights:
            items.append(("weights", op.stage))
        return [item for item in items if item is not None]

    def _frees(self, base: State, op: Op) -> list:
        if op.kind == "Loss":
            return [("input", self.length)]
        if op.kind == "B":
            return [("saved", op.stage), ("input", op.stage)]
        return [("input", op.stage)] if op.kind == "F_none" else []

    def _shrink_moving(self, before: State, after: State, op: Op, moving: dict) -> None:
        """When ``δ_i`` appears while ``ā_i`` is being offloaded, the bytes it will release and bring back (in
        ``moving``) are the shrunk ones."""
        i = self.length if op.kind == "Loss" else op.stage if op.kind == "B" else None
        item = ("saved", i - 1) if i else None
        if item in moving and not before.grad >> i & 1 and after.grad >> i & 1:
            producer = self.chain.stages[i - 1]
            moving[item] = moving[item]._replace(nbytes=producer.own_saved_bytes)


def host_weight_stages(schedule) -> frozenset:
    """The stages whose parameters live on the host: those whose ``weights`` the schedule moves."""
    return frozenset(op.stage for op in schedule if op.what == "weights")


def simulate_offload(chain: Chain, schedule, transfer: Transfer) -> OffloadResult:
    """Peak device bytes, step seconds (stalls included) and the copies of a schedule with transfers."""
    return OffloadSimulator(chain, transfer).run(schedule)
