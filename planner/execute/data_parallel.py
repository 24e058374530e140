"""Data parallelism with ZeRO: one process per rank, each training the same chain plan on its part of the batch.

:func:`run_data_parallel` launches ``dp`` ranks (planner/execute/pipeline.py's launcher: spawn, gloo on CPU,
NCCL on CUDA). Each builds the model on its part of the batch (planner/execute/stages.py's ``rank_slice``) and runs
the plan's schedule: for ZeRO 2 and 3 on stages sharded with FSDP2 (planner/execute/sharded.py), the gradients of
parameters kept whole averaged after the backward, Adam stepping on its shards; for ZeRO 1 on the whole stages,
every gradient averaged, PyTorch's ``ZeroRedundancyOptimizer`` (Adam) stepping its part of the state. Each
measures its steps' peaks in a window opened with the gradients ``None`` and the optimizer state made, and
returns a :class:`DataParallelResult`. Under torchrun this process runs its own rank instead
(planner/execute/torchrun.py). How: docs/execution.md ("Sharded data parallelism").
"""

import functools
import os
import time
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_flatten

from planner.errors import MemschedError
from planner.execute.chain import apply_schedule
from planner.execute.pipeline import check_progress_timeout, launch_ranks
from planner.execute.records import input_specs, stage_specs
from planner.execute.sharded import average_gradients, shard_stages
from planner.execute.stages import named_parameters, named_stages
from planner.execute.updates import state_tensors
from planner.measured_on import record_of
from planner.sharding import check_sharding


@dataclass
class DataParallelResult:
    """What one rank measured (bytes, seconds), and for the tests its whole gradients of the first step."""

    rank: int
    losses: list  # per step, the mean over the ranks of their losses: the whole batch's mean loss
    peaks: list  # per step: the rank's input plus what its step allocated at its peak (bytes)
    seconds: list  # per step, wall clock of forward, loss and backward
    predicted: int  # the plan's peak for one rank's step (the sharded chain's, ZeRO 2's whole parameters added)
    resident: int  # bytes of the rank's parameters (its padded shards, those kept whole) and Adam state
    grads: dict  # parameter name -> whole gradient after the first step (None unless asked for)

    @property
    def measured(self) -> int:
        """The last step's peak (the first also holds what FSDP2 allocates once)."""
        return self.peaks[-1]


def run_data_parallel(model, plan, zero: int, dp: int, steps: int = 1, *, meter, device: str = "cpu",
                      lr: float = 1e-3, predicted: int, chain=None, return_grads: bool = False, seed: int = 0,
                      progress_timeout: float = 300.0, threads: int = None, here=None) -> list:
    """Train ``steps`` steps of ``model`` by the chain ``plan`` on ``dp`` ranks with ZeRO ``zero``; a
    :class:`DataParallelResult` per rank (under torchrun: on rank 0, None on the others). ``model(part=(rank,
    dp))``: a picklable function returning the staged model on that rank's part of the batch
    (``functools.partial(profiles.spec.built_model, spec, batch=N)``, which cuts the inputs before it finds the
    stages: planner/execute/stages.py's :func:`batch_part`).

    ``plan``: solved for one rank's step (planner/sharding.py's chain); ``predicted``: its peak for that step.
    ``meter(device)``: the memory meter (``profiles.memory.memory_meter``). ``chain``: when given, what it was
    measured on must be the model's stages and one rank's slice of its inputs. ``threads``: torch threads per
    spawned rank (default: the machine's cores shared by the ranks). ``here``: this process's rank of a launch by
    torchrun (planner/execute/torchrun.py's :class:`TorchrunRank`), which runs its part of the batch on torchrun's
    threads; None: the ranks are spawned here."""
    check_sharding(zero, dp)
    check_progress_timeout(progress_timeout)
    if plan.kind != "chain" or plan.update != "after" or plan.moves_data:
        raise MemschedError("a sharded run trains by a chain plan without transfers, updating after the backward")
    built = model(part=(0, dp))  # a bad batch or loss is refused here, before any process starts
    measured, source = record_of(chain, plan)
    if measured is not None:
        measured.check_stages(stage_specs(named_stages(built.stages)), source)
        measured.check_inputs(input_specs(built.example_inputs), source,
                              f"the chain is profiled on one rank's slice of the batch: {dp} ranks need a batch "
                              f"{dp} times the profiled one")
    del built
    job = functools.partial(_rank_job, model=model, plan=plan, zero=zero, steps=steps, meter=meter, lr=lr,
                            predicted=predicted, return_grads=return_grads, seed=seed)
    if here is not None:
        return here.run(job, dp)
    threads = max(1, (os.cpu_count() or 1) // dp) if threads is None else threads
    return launch_ranks(job, dp, device, progress_timeout, label="data-parallel", threads=threads)


def _rank_job(rank, world, where, report, *, model, plan, zero, steps, meter, lr, predicted, return_grads, seed):
    report.doing("building and sharding its stages", True, milestone=True)
    torch.manual_seed(seed)
    built = model(part=(rank, world))
    pairs = [(name, module.to(where)) for name, module in named_stages(built.stages)]
    inputs = tuple(t.to(where) if isinstance(t, torch.Tensor) else t for t in built.example_inputs)
    input_bytes = _storage_bytes([t for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)])
    if zero > 1:
        shard_stages(pairs, zero, world)
    planned = apply_schedule(pairs, plan.schedule, zero=zero if zero > 1 else None)
    named = list(named_parameters(pairs).values())
    parameters = [p for _, p in named]
    averaged = parameters if zero == 1 else []  # ZeRO 2-3: the planned step averages what FSDP2 does not reduce
    if zero == 1:  # each rank steps the state of its part of the parameters and broadcasts them
        from torch.distributed.optim import ZeroRedundancyOptimizer

        optimizer = ZeroRedundancyOptimizer(parameters, optimizer_class=torch.optim.Adam, lr=lr)
    else:
        optimizer = torch.optim.Adam(parameters, lr=lr)
    local = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's optimizer of its part
    for p in parameters:  # the state exists before the first window, as in steady state: a zero step makes it,
        p.grad = torch.zeros_like(p)  # moving nothing, and its count is reset (the first step is then the first)
    optimizer.step()
    for state in local.state.values():
        state["step"].zero_()
    resident = _storage_bytes([_local(t) for t in parameters + state_tensors([local])])
    report.doing("ready, waiting for its peers", False, milestone=True)
    losses, peaks, seconds, grads = [], [], [], None
    for step in range(1, steps + 1):
        report.step = step
        for p in parameters:
            p.grad = None
        report.doing(f"step {step}: forward and backward", True)
        with meter(where) as window:
            start = window.current
            started = time.perf_counter()
            loss = built.loss_fn(planned(*inputs))
            loss.backward()
            average_gradients(averaged)
            if where.type == "cuda":
                torch.cuda.synchronize(where)
            seconds.append(time.perf_counter() - started)
            peaks.append(window.peak - start + input_bytes)
        value = loss.detach().reshape(1).clone()
        del loss
        torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.AVG)
        losses.append(float(value))
        if grads is None and return_grads:
            grads = {name: _whole(p.grad) for name, p in named}
        optimizer.step()
        report.send("step", step)
    return DataParallelResult(rank=rank, losses=losses, peaks=peaks, seconds=seconds, predicted=predicted,
                              resident=resident, grads=grads)


def _local(tensor):
    """A rank's own part of a sharded tensor (a DTensor's local shard), else the tensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _storage_bytes(tensors) -> int:
    return sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}.values())


def _whole(grad):
    """A gradient whole on the CPU (a sharded one gathered from every rank: a collective)."""
    if grad is None:
        return None
    return (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().cpu().clone()


def summary_lines(results) -> list:
    """Per rank: the last step's measured peak against the prediction, the first step's, seconds, loss."""
    lines = [f"{'rank':>4}  {'measured':>12}  {'predicted':>12}  {'ratio':>6}  {'first step':>12}  {'resident':>10}  "
             f"{'seconds':>8}  loss"]
    for r in results:
        lines.append(f"{r.rank:>4}  {r.measured:>12,}  {r.predicted:>12,}  {r.measured / r.predicted:>6.3f}  "
                     f"{r.peaks[0]:>12,}  {r.resident:>10,}  {r.seconds[-1]:>8.4f}  {r.losses[-1]:.6f}")
    lines.append("measured: the rank's input and what its step allocated at its peak (all-gathered parameters and "
                 "gradients included), in the last step; predicted: the plan's peak for one rank's step; first step: "
                 "also what FSDP2 allocates once; resident: the rank's parameters and Adam state, measured")
    return lines
