"""``memsched train SPEC --dp N --zero 1|2|3``: one rank's step planned (or a plan for it read), trained on N ranks.

:func:`train_data_parallel` profiles the model on rank 0's part of the batch (the ranks' parts have the same
shapes) and solves it under the sharded setup (ZeRO ``zero`` over ``dp`` ranks, fp32 Adam updating after the
backward), which lowers the chain to one rank's step (planner/setup/lower.py, planner/sharding.py); ``auto``
budgets what a device of ``device_memory`` bytes leaves beside the largest rank's resident parameters and Adam
state. Given a plan (``memsched solve CHAIN --zero Z --dp N``, the chain profiled on one rank's part), it
trains by it instead. Either way the step runs on ``dp`` processes (planner/execute/data_parallel.py), each
measured against the prediction: spawned here, or under torchrun the ``dp`` ranks it started, each running this
(rank 0 profiles and solves, and its plan is every rank's: planner/execute/torchrun.py).
"""

import functools

import solvers.budgets
from planner.errors import MemschedError
from planner.execute.data_parallel import run_data_parallel, summary_lines
from planner.execute.records import parameter_layout
from planner.execute.stages import named_stages
from planner.execute.torchrun import torchrun_rank
from planner.render import say_on_stderr
from planner.setup import TrainingSetup
from planner.sharding import check_sharding, rank_residents
from planner.simulate import check_plan_schedules
from planner.units import describe_bytes, parse_budget
from profiles.chain_profiler import profile_chain
from profiles.memory import memory_meter
from profiles.spec import built_model


def train_data_parallel(spec: str, batch, dp: int, zero: int, budget: str = None, *, plan=None,
                        device_memory: str = None, solver: str = "auto", steps: int = 5, device: str = "cpu",
                        lr: float = 1e-3, progress_timeout: float = 300.0, say=say_on_stderr) -> list:
    """The lines of a sharded run of the model ``spec`` names (at ``batch``, split over ``dp`` ranks) for ZeRO
    ``zero``: by ``plan`` (a :class:`planner.plan.Plan` solved for this setup on one rank's part), else by the
    plan solved here within ``budget`` per rank (bytes, a percentage of the sharded step's store-all peak, or
    ``auto`` with ``device_memory``); ``say(line)`` tells what is being done. Under torchrun (its ``dp`` ranks
    each run this) rank 0 solves, tells and returns the lines, the others train their part and return none."""
    check_sharding(zero, dp)
    setup = TrainingSetup(zero=zero, dp=dp)
    model = functools.partial(built_model, spec, batch=batch)
    part = model(part=(0, dp))
    if plan is not None:
        check_plan_schedules(plan, "the plan")
        if plan.setup.sizing() != setup.sizing():
            raise MemschedError(f"the plan is for {plan.setup.describe()}, this run trains {setup.describe()}: give "
                                f"--zero {plan.setup.zero} --dp {plan.setup.dp}, or solve for this setup")
    with torchrun_rank(dp, f"--dp {dp}", "give --dp {world}", device, progress_timeout, "data-parallel") as here:
        say = say if here is None or here.rank == 0 else _silent
        if plan is None:
            solve = functools.partial(_solved, part, budget, solver, setup, device_memory, device, say)
            plan, how, chain = solve() if here is None else here.from_rank0(solve)
        else:
            chain, how = None, f"the plan's, {describe_bytes(plan.budget_bytes)}"
        say(f"training on {dp} ranks...")
        results = run_data_parallel(model, plan, zero, dp, steps, meter=memory_meter, device=device, lr=lr,
                                    predicted=plan.predicted.peak_bytes, chain=chain,
                                    progress_timeout=progress_timeout, here=here)
    if results is None:  # a rank torchrun started, not the first
        return []
    residents = rank_residents(zero, dp, parameter_layout(named_stages(part.stages)))
    engine = "ZeroRedundancyOptimizer" if zero == 1 else "FSDP2's fully_shard (each stage a unit)"
    return [f"data parallel: {dp} ranks, ZeRO {zero} on {engine}, {steps} steps on {device}",
            f"budget per rank: {how or describe_bytes(plan.budget_bytes)}",
            f"resident per rank: {', '.join(f'{r:,}' for r in residents)} bytes ("
            + ("whole parameters, Adam state of each rank's part" if zero == 1 else
               "shards, parameters kept whole, Adam state") + ")",
            f"plan: {plan.solver}, predicted peak of a rank's step {describe_bytes(plan.predicted.peak_bytes)}"
            + (" (ZeRO 2's whole parameters included)" if zero == 2 else "")] + summary_lines(results)


def _solved(part, budget: str, solver: str, setup: TrainingSetup, device_memory: str, device: str, say) -> tuple:
    """``(plan, how, chain)``: one rank's ``part`` of the model profiled on ``device`` and solved for ``setup``
    within ``budget`` (:func:`solvers.budgets.solve_for_budget`; ``how`` says how the budget was found)."""
    say("\n".join([*part.report, f"profiling {part.name} on {device} ({len(named_stages(part.stages))} stages, one "
                                 "rank's part of the batch)..."]))
    chain = profile_chain(part.stages, part.example_inputs, loss_fn=part.loss_fn, device=device, name=part.name,
                          options=0)  # a sharded step runs stages whole (planner/sharding.py)
    memory = None if device_memory is None else parse_budget(device_memory, what="--device-memory")
    plan, how = solvers.budgets.solve_for_budget(chain, budget, solver, setup, memory)
    return plan, how, chain


def _silent(line: str) -> None:
    """What a rank other than the first says: nothing (rank 0 tells what the run does)."""
