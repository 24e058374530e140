"""``memsched train SPEC --dp N --zero 1|2|3``: profile one rank's part of the batch, plan its step, train it.

:func:`train_data_parallel` profiles the model on rank 0's part of the batch (the ranks' parts have the same
shapes), turns the chain into one rank's step (planner/sharding.py), takes the budget (``auto``: what a device of
``device_memory`` bytes leaves once the largest rank's resident parameters and Adam state and, for ZeRO 2, the
whole parameters of the step are counted), solves, and trains on ``dp`` processes
(planner/execute/data_parallel.py), each measured against the prediction.
"""

import functools

import solvers
from planner.errors import MemschedError
from planner.execute.data_parallel import run_data_parallel, summary_lines
from planner.execute.sharded import residents_of, shard_units
from planner.execute.stages import named_stages
from planner.render import say_on_stderr
from planner.sharding import check_sharding, sharded_chain, step_constant
from planner.units import describe_bytes, parse_budget
from profiles.chain_profiler import profile_chain
from profiles.memory import memory_meter
from profiles.spec import built_model


def train_data_parallel(spec: str, batch, dp: int, zero: int, budget: str, *, device_memory: str = None,
                        solver: str = "auto", steps: int = 5, device: str = "cpu", lr: float = 1e-3,
                        progress_timeout: float = 300.0, say=say_on_stderr) -> list:
    """The lines of a sharded run of the model ``spec`` names (at ``batch``, split over ``dp`` ranks) for ZeRO
    ``zero`` within ``budget`` per rank (bytes, a percentage of the sharded store-all peak, or ``auto`` with
    ``device_memory``); ``say(line)`` tells what is being done."""
    check_sharding(zero, dp)
    model = functools.partial(built_model, spec, batch=batch)
    part = model(part=(0, dp))
    pairs = named_stages(part.stages)
    say("\n".join([*part.report, f"profiling {part.name} on {device} ({len(pairs)} stages, one rank's part of the "
                                  "batch)..."]))
    chain = profile_chain(part.stages, part.example_inputs, loss_fn=part.loss_fn, device=device, name=part.name,
                          options=0)  # a sharded step runs stages whole (planner/sharding.py)
    units = shard_units(pairs, dp)
    sharded = sharded_chain(chain, zero, units)
    constant = step_constant(zero, units)
    residents = residents_of(pairs, zero, dp)
    resident = max(residents)
    step_budget, how = _step_budget(budget, device_memory, sharded, resident, constant)
    if step_budget <= constant:
        raise MemschedError(f"budget: {describe_bytes(step_budget)} leaves nothing for the step beside ZeRO 2's whole "
                            f"parameters ({describe_bytes(constant)}); use --zero 3 or a larger budget")
    plan = solvers.solve(sharded, step_budget - constant, solver)
    predicted = plan.predicted.peak_bytes + constant
    say(f"training on {dp} ranks...")
    results = run_data_parallel(model, plan, zero, dp, steps, meter=memory_meter, device=device, lr=lr,
                                predicted=predicted, chain=sharded, progress_timeout=progress_timeout)
    engine = "ZeroRedundancyOptimizer" if zero == 1 else "FSDP2's fully_shard (each stage a unit)"
    return [f"data parallel: {dp} ranks, ZeRO {zero} on {engine}, {steps} steps on {device}", f"budget per rank: {how}",
            f"resident per rank: {', '.join(f'{r:,}' for r in residents)} bytes ("
            + ("whole parameters, Adam state of each rank's part" if zero == 1 else
               "shards, parameters kept whole, Adam state") + ")",
            f"plan: {plan.solver}, predicted peak of a rank's step {describe_bytes(predicted)}"
            + (f" (whole parameters {describe_bytes(constant)} included)" if constant else "")] + summary_lines(results)


def _step_budget(budget: str, device_memory, sharded, resident: int, constant: int) -> tuple:
    """``(bytes for one rank's step, how they came about)``."""
    if budget == "auto":
        if device_memory is None:
            raise MemschedError("--budget auto needs --device-memory (one device's memory)")
        memory = parse_budget(device_memory, what="--device-memory")
        if memory <= resident:
            raise MemschedError(f"--device-memory {device_memory}: a rank keeps {describe_bytes(resident)} resident; "
                                "use a larger device or more ranks")
        return memory - resident, (f"device {describe_bytes(memory)} - resident {describe_bytes(resident)}")
    if device_memory is not None:
        raise MemschedError("--device-memory sizes --budget auto: give --budget auto with it, or drop it")
    value = parse_budget(budget, solvers.store_all_peak(sharded) + constant)
    return value, describe_bytes(value)
