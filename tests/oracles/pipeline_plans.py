"""A pipeline plan at a chosen split (the tests' own: the partition solver chooses its split by the profiled
times), store-all on every device, with the pipeline simulator's figures."""

import dataclasses

from planner.plan import Pipeline, PipelineDevice, Plan, Predicted
from planner.setup.training import TrainingSetup
from planner.simulate import simulate
from planner.simulate.pipeline import to_global
from solvers.extremes import store_all_schedule


def store_all_split(chain, parts, micro_batches, schedule, setup=None) -> Plan:
    """The plan running stages ``[a, b)`` of ``chain`` on device s for ``parts[s] = (a, b)``, store-all."""
    devices = tuple(PipelineDevice(first=a, last=b, schedule=to_global(store_all_schedule(b - a), a), peak_bytes=0,
                                   time=0.0) for a, b in parts)
    pipeline = Pipeline(schedule=schedule, micro_batches=micro_batches, bandwidth=None, latency=0.0,
                        setup=dataclasses.asdict(setup or TrainingSetup()), devices=devices, shared=chain.shared)
    plan = Plan(problem_name=chain.name, fingerprint=chain.fingerprint(), solver="partition", budget_bytes=10 ** 15,
                predicted=Predicted(peak_bytes=0, time=0.0, baseline_time=0.0), schedule=(), kind="pipeline",
                pipeline=pipeline)
    result = simulate(chain, plan)
    devices = tuple(dataclasses.replace(d, peak_bytes=r.peak_bytes, time=r.time)
                    for d, r in zip(devices, result.devices))
    return dataclasses.replace(plan, predicted=Predicted(peak_bytes=result.peak_bytes, time=result.time,
                                                         baseline_time=result.time),
                               pipeline=dataclasses.replace(pipeline, devices=devices))
