"""A chain's step on one rank of data parallelism with ZeRO 1, 2 or 3 on PyTorch's engines (no torch).

Over ``dp`` ranks, each with its part of the batch (planner/execute/data_parallel.py runs them; measured on CPU
with gloo, docs/model.md "Sharded data parallelism"):

- **ZeRO 1** (``torch.distributed.optim.ZeroRedundancyOptimizer``): every rank keeps the whole parameters and
  makes the whole gradients, averaged across ranks in place after the backward; the optimizer state is split by
  whole parameters, the largest first to the least-loaded rank (:func:`zero1_partition`, ZeroRedundancyOptimizer's
  own rule), so ranks may hold different amounts. The step is the chain's own.

With ZeRO 2 and 3 each stage is a ``fully_shard`` unit (FSDP2): its parameters are cut along their first
dimension, padded to a multiple of ``dp`` (:class:`ShardUnit` gives the bytes); a rank keeps its shards
(``shard`` bytes per stage), the optimizer state of them, and the sharded gradients its backward
reduce-scatters. What the step adds, as FSDP2 allocates it (planner/execute/sharded.py):

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
are averaged across ranks after the backward, and the chain counts them as on one device. :func:`sharded_chain`
gives the chain the solvers and the simulator see on one rank; :func:`rank_residents` what exists before each
rank's step. A stage's options (profiles/options.py) are dropped: their recomputation inside the backward would
all-gather again, which the model above does not count (and ZeRO 1 runs the same schedules).
"""

import dataclasses
import math
from dataclasses import dataclass

from planner.errors import MemschedError
from planner.layout import shared_bytes, trainable_sizes

ZERO_STAGES = (1, 2, 3)  # 1: ZeroRedundancyOptimizer; 2, 3: FSDP2's fully_shard
ADAM_STATE_PER_BYTE = 2  # Adam's two fp32 moments: 8 bytes per 4-byte fp32 parameter


@dataclass(frozen=True)
class ShardUnit:
    """The sharded parameters of one stage, in bytes: ``gathered``, all of them padded and whole (the
    all-gather and reduce-scatter buffers, and the whole parameters themselves); ``shard``, one rank's padded
    shards, ``gathered / dp``; ``gradients``, the whole gradients of those needing them (unpadded)."""

    gathered: int = 0
    shard: int = 0
    gradients: int = 0


def check_sharding(zero, dp) -> None:
    """Refuse, in one line, a ZeRO stage that is not 1, 2 or 3, or fewer than 2 ranks."""
    if isinstance(zero, bool) or zero not in ZERO_STAGES:
        raise MemschedError(f"--zero {zero}: data parallelism runs ZeRO 1 (optimizer state split), 2 (and the "
                            "gradients) or 3 (and the parameters)")
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 2:
        raise MemschedError(f"--dp: data parallelism needs at least 2 ranks, got {dp!r}")


def sharded_chain(chain, zero: int, units):
    """``chain`` as one rank's step allocates it under ZeRO ``zero``, ``units[i]`` the :class:`ShardUnit` of stage
    ``i``; without options (see the module docstring). Add :func:`step_constant` to its peak for ZeRO 2."""
    check_sharding(zero, 2)
    if len(units) != chain.length:
        raise MemschedError(f"sharding: {len(units)} units for a chain of {chain.length} stages")
    if zero == 1:
        return dataclasses.replace(chain, stages=tuple(dataclasses.replace(stage, options=(), held_bwd_tmp_bytes=None)
                                                       for stage in chain.stages))
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


def zero1_partition(sizes, dp: int) -> list:
    """The rank whose optimizer state holds each parameter of ``sizes`` (bytes, in the optimizer's order) under
    ZeRO 1: the largest first (ties in order), each to the rank holding least so far (the lowest such rank), as
    ``ZeroRedundancyOptimizer`` partitions them."""
    loads, owners = [0] * dp, [0] * len(sizes)
    for k in sorted(range(len(sizes)), key=lambda k: -sizes[k]):
        owners[k] = loads.index(min(loads))
        loads[owners[k]] += sizes[k]
    return owners


def shard_units(layout: tuple, dp: int) -> list:
    """A :class:`ShardUnit` per stage of ``layout`` (planner/layout.py) as ``fully_shard`` cuts it over ``dp``
    ranks: each parameter cut along its rows, padded to a multiple of ``dp``; shared parameters are not sharded."""
    units = []
    for stage in layout:
        own = [parameter for parameter in stage if parameter.kind != "shared"]
        per_rank = [-(-parameter.rows // dp) * parameter.row_bytes for parameter in own]
        units.append(ShardUnit(gathered=dp * sum(per_rank), shard=sum(per_rank),
                               gradients=sum(parameter.bytes for parameter in own if parameter.kind == "trainable")))
    return units


def rank_parts(zero: int, dp: int, layout: tuple, per_byte: dict) -> list:
    """Per rank, ``{"params", "grads", "master", "optimizer"}``: the bytes of the parameters of ``layout`` (as the
    model holds them) it keeps between steps, and of the gradients its step leaves, each item's bytes per byte of
    the model's parameters given by ``per_byte`` (fp32 Adam: ``{"params": 1, "grads": 1, "master": 0,
    "optimizer": 2}``; :meth:`planner.setup.TrainingSetup.per_parameter_byte`), rounded
    up to whole bytes. ZeRO 1 keeps the whole parameters and gradients and the state (master copy, optimizer) of
    its part (:func:`zero1_partition`); ZeRO 2 and 3 their padded shards (:func:`shard_units`) and the shared
    parameters, kept whole, with the gradients and state of those needing gradients (a shard's counted at its
    padded size: at most a row per parameter more). Adam's step counters (4 bytes per tensor) are left out."""
    sizes = trainable_sizes(layout)
    if zero == 1:
        loads = [0] * dp
        for size, owner in zip(sizes, zero1_partition(sizes, dp)):
            loads[owner] += size
        whole = sum(parameter.bytes for stage in layout for parameter in stage)
        kept = [(whole, sum(sizes), load) for load in loads]
    else:
        shards = [(-(-parameter.rows // dp) * parameter.row_bytes, parameter.kind) for stage in layout
                  for parameter in stage if parameter.kind != "shared"]
        trained = sum(size for size, kind in shards if kind == "trainable") + shared_bytes(layout)
        kept = [(sum(size for size, _ in shards) + shared_bytes(layout), trained, trained)] * dp
    return [{"params": math.ceil(params * per_byte["params"]), "grads": math.ceil(grads * per_byte["grads"]),
             "master": math.ceil(state * per_byte["master"]), "optimizer": math.ceil(state * per_byte["optimizer"])}
            for params, grads, state in kept]


def rank_residents(zero: int, dp: int, layout: tuple, per_byte: dict = None) -> list:
    """Per rank, the bytes of :func:`rank_parts` kept between steps (parameters, master copy, optimizer state);
    ``per_byte`` defaults to fp32 Adam's."""
    per_byte = per_byte or {"params": 1, "grads": 1, "master": 0, "optimizer": ADAM_STATE_PER_BYTE}
    return [parts["params"] + parts["master"] + parts["optimizer"] for parts in rank_parts(zero, dp, layout, per_byte)]
