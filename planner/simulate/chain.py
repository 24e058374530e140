"""The chain simulator: replays a chain schedule and predicts its peak bytes and seconds.

It is the judge of every chain solver; its memory and time rules (Beaumont et al., arXiv 1911.13214, with
parameter gradients) are in docs/model.md, "The chain simulator". :class:`ChainSimulator` follows the
protocol of :func:`planner.simulate.replay.run`; its :meth:`~ChainSimulator.step` is also what the
exhaustive searches and the offload simulator build on.
"""

from typing import NamedTuple

from planner.chain import Chain
from planner.ops import Op
from planner.simulate.replay import ScheduleError, SimResult, backward_peak, run


class ChainState(NamedTuple):
    """What is resident between two operations, as bit masks over activation indices 0..L."""

    standalone: int  # a_i held on its own (bit 0: the input, always)
    checkpoint: int  # standalone a_i kept by F_ck i: released only by its backward
    abar: int  # ā_i held (made by F_all i-1)
    grad: int  # δ_i held
    done: int  # bit i: backward of stage i done; bit L: loss done
    memory: int  # resident bytes
    options: tuple = ()  # per stage, the option its F_all ran with (None: the stage itself); () while none did


class ChainSimulator:
    """Replays operations on one chain; :meth:`step` is also used by exhaustive searches. ``held_bytes``: bytes
    resident from the start of the step to its end besides the input (the gradients that earlier micro-batches
    accumulated: planner/accumulate.py)."""

    def __init__(self, chain: Chain, held_bytes: int = 0):
        self.chain = chain
        self.held_bytes = held_bytes
        self.length = chain.length
        self.act = [chain.act_bytes(i) for i in range(chain.length + 1)]
        self.full_mask = (1 << (chain.length + 1)) - 1

    def initial_state(self) -> ChainState:
        """Only the input (and the held bytes) is resident."""
        return ChainState(standalone=1, checkpoint=0, abar=0, grad=0, done=0, memory=self.act[0] + self.held_bytes)

    def is_complete(self, state: ChainState) -> bool:
        """True once the loss and every backward have run."""
        return state.done == self.full_mask

    def step(self, state: ChainState, op: Op):
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
            stage = stage.running(state.options[i] if state.options else None)
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
            stage = stage.running(op.option)
            peak = state.memory + stage.saved_bytes + stage.fwd_tmp_bytes
            held = stage.own_saved_bytes if state.grad & out else stage.saved_bytes
            new = state._replace(abar=state.abar | out, memory=state.memory + held)
            if op.option is not None or state.options:
                options = list(state.options or (None,) * length)
                options[i] = op.option
                new = new._replace(options=tuple(options))
            return new, peak, stage.fwd_time
        if op.option is not None:
            raise ValueError(f"only F_all runs with an option, not {op.kind}")
        if (state.standalone | state.abar) & out:
            raise ValueError(f"a_{i + 1} is already in memory")
        peak = state.memory + stage.out_bytes + stage.nograd_tmp_bytes
        new = state._replace(standalone=state.standalone | out, memory=state.memory + stage.out_bytes)
        held_alone = i > 0 and state.standalone >> i & 1  # the input is the caller's: never released
        if op.kind == "F_ck" and held_alone:
            new = new._replace(checkpoint=new.checkpoint | 1 << i)
        elif op.kind == "F_none" and held_alone:
            if state.checkpoint >> i & 1:
                raise ValueError(f"a_{i} is a checkpoint (kept by F_ck {i}); "
                                 f"only the backward of stage {i} releases it")
            new = new._replace(standalone=new.standalone & ~(1 << i), memory=new.memory - self.act[i])
        return new, peak, stage.fwd_time

    def _need_activation(self, state: ChainState, i: int) -> None:
        if not (state.standalone | state.abar) >> i & 1:
            raise ValueError(f"a_{i} is not in memory (keep it with F_ck, or recompute it)")

    def _produce_gradient(self, state: ChainState, i: int, memory: int) -> ChainState:
        """Mark step ``i`` done and hold ``δ_i``, releasing ``a_i`` if it is a standalone checkpoint and
        shrinking ``ā_i`` to what stage i-1's backward reads."""
        bit = 1 << i
        if i > 0 and state.abar & bit:
            producer = self.chain.stages[i - 1].running(state.options[i - 1] if state.options else None)
            memory -= producer.saved_bytes - producer.own_saved_bytes
        if i > 0 and state.standalone & bit:
            standalone, checkpoint = state.standalone & ~bit, state.checkpoint & ~bit
        else:
            standalone, checkpoint = state.standalone, state.checkpoint
            memory += self.act[i]
        return ChainState(standalone=standalone, checkpoint=checkpoint, abar=state.abar, grad=state.grad | bit,
                          done=state.done | bit, memory=memory, options=state.options)

    def check_complete(self, state: ChainState) -> None:
        """Raise :class:`~planner.simulate.replay.ScheduleError` unless the loss and every backward have run."""
        if not self.is_complete(state):
            missing = next(i for i in range(self.length, -1, -1) if not state.done >> i & 1)
            what = "the loss" if missing == self.length else f"the backward of stage {missing}"
            raise ScheduleError(f"schedule ends before {what}")

    def run(self, schedule) -> SimResult:
        """Replay a whole schedule; an invalid one raises :class:`ScheduleError` naming the operation."""
        return run(self, schedule, "schedule[{index}]")[1]
