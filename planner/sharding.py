"""A chain's step on one rank of FSDP2 data parallelism, each stage a ``fully_shard`` unit (no torch).

Over ``dp`` ranks each stage's parameters are cut along their first dimension, padded to a multiple of ``dp``
(:class:`ShardUnit` gives the bytes). A rank keeps its shards (``shard`` bytes per stage), the optimizer state
of them, and the sharded gradients its backward reduce-scatters. What the step adds, as FSDP2 allocates it
(planner/execute/sharded.py runs it; measured on CPU with gloo, docs/model.md "Sharded data parallelism"):

- **ZeRO 3** all-gathers a stage's parameters at each of its operations, into a buffer of the padded whole
  parameters that lives through a forward beside the parameters themselves: a forward's temporaries grow by
  ``2 * gathered``, a backward's by ``gathered`` (the buffer is freed before it computes, and before the
  input's gradient exists: ``2 * gathered`` at its start). Once it has made its gradients the stage is
  resharded and the gradients are copied into a reduce-scatter input (``gathered`` bytes), then freed:
  ``param_bytes + gathered - own_saved - out`` above the backward's start and input gradient at that moment.
  The stage then keeps ``shard`` bytes of gradients instead of its ``gradients``.
- **ZeRO 2** all-gathers every stage once at the step's start and frees them at its end (``sum(gathered)``
  through the step: :func:`step_constant`), so forwards all-gather nothing; the backward reduce-scatters as
  in ZeRO 3.

Parameters shared by stages (tied embeddings) are not sharded: every rank keeps them whole, their gradients
are summed across ranks after the backward, and the chain counts them as on one device. :func:`sharded_chain`
gives the chain the solvers and the simulator see on one rank; :func:`rank_resident` what exists before its
step. A stage's options (profiles/options.py) are dropped: their recomputation inside the backward would
all-gather again, which the model above does not count.
"""

import dataclasses
from dataclasses import dataclass

from planner.errors import MemschedError
from planner.training_setup import TrainingSetup

SHARDED_ZERO = (2, 3)  # fully_shard always reduce-scatters gradients: ZeRO 2 or 3, never 1


@dataclass(frozen=True)
class ShardUnit:
    """The sharded parameters of one stage, in bytes: ``gathered``, all of them padded and whole (the
    all-gather and reduce-scatter buffers, and the whole parameters themselves); ``shard``, one rank's padded
    shards, ``gathered / dp``; ``gradients``, the whole gradients of those needing them (unpadded)."""

    gathered: int = 0
    shard: int = 0
    gradients: int = 0


def check_sharding(zero, dp) -> None:
    """Refuse, in one line, a ZeRO stage fully_shard does not run or fewer than 2 ranks."""
    if zero not in SHARDED_ZERO:
        raise MemschedError(f"--zero {zero}: FSDP2's fully_shard always shards the gradients (ZeRO 2) and may shard "
                            "the parameters (ZeRO 3); use --zero 2, which keeps the parameters whole as ZeRO 1 does, "
                            "or --zero 3")
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 2:
        raise MemschedError(f"--dp: sharded data parallelism needs at least 2 ranks, got {dp!r}")


def sharded_chain(chain, zero: int, units):
    """``chain`` as one rank's step allocates it under ZeRO ``zero`` (2 or 3), ``units[i]`` the
    :class:`ShardUnit` of stage ``i``; without options (see the module docstring). Add :func:`step_constant` to
    its peak for ZeRO 2."""
    if zero not in SHARDED_ZERO:
        check_sharding(zero, 2)
    if len(units) != chain.length:
        raise MemschedError(f"sharding: {len(units)} units for a chain of {chain.length} stages")
    stages = []
    for i, (stage, unit) in enumerate(zip(chain.stages, units)):
        gathered = unit.gathered if zero == 3 else 0  # what an operation of the stage all-gathers
        # A backward's temporaries count from its start plus δ_i (planner/simulate/replay.py): the all-gather
        # comes before δ_i exists, the reduce-scatter once the stage's saved tensors and output are freed.
        gathering = 2 * gathered - chain.act_bytes(i)
        reducing = stage.param_bytes + unit.gathered - stage.own_saved_bytes - stage.out_bytes
        stages.append(dataclasses.replace(
            stage, options=(), held_bwd_tmp_bytes=None,
            fwd_tmp_bytes=stage.fwd_tmp_bytes + 2 * gathered, nograd_tmp_bytes=stage.nograd_tmp_bytes + 2 * gathered,
            bwd_tmp_bytes=max(stage.bwd_tmp_bytes + gathered, gathering, reducing),
            param_bytes=stage.param_bytes - unit.gradients + unit.shard))
    return dataclasses.replace(chain, stages=tuple(stages))


def step_constant(zero: int, units) -> int:
    """Bytes a rank's step holds throughout besides the chain: ZeRO 2's whole parameters, else none."""
    return sum(unit.gathered for unit in units) if zero == 2 else 0


def rank_resident(units, replicated: int, optimizer: str = "adam") -> int:
    """At most what a rank keeps between steps: its shards and the ``replicated`` bytes of parameters kept whole
    (fp32), and ``optimizer``'s state of both (a shard's state counted at its padded size)."""
    setup = TrainingSetup(optimizer=optimizer)
    parameters = -(-(sum(unit.shard for unit in units) + replicated) // 4)
    return setup.resident_bytes(parameters)
