"""Pipeline partitioning (solvers/partition.py): the DP against brute force, infeasibility, and plans of kind
``pipeline`` (JSON round trip, strict validation, re-prediction by planner/pipeline_simulator.py)."""

import copy
import dataclasses
import itertools
import json

import pytest
from pipeline_plans import store_all_split

from planner import MemschedError
from planner.chain import Chain, Loss, Stage
from planner.pipeline_simulator import phase_order, pipeline_time, simulate_pipeline, sub_chain
from planner.plan import Plan
from planner.simulator import ChainSimulator
from planner.step_memory import TrainingSetup, setup_chain
from profiles.synthetic import random_chain
from solvers.extremes import store_all_schedule
from solvers.minimum import minimum_budget
from solvers.partition import PartitionProblem, partition, solve_partition


def compositions(length, parts):
    """Every split of ``range(length)`` into ``parts`` non-empty contiguous ranges."""
    for cuts in itertools.combinations(range(1, length), parts - 1):
        bounds = (0, *cuts, length)
        yield list(zip(bounds, bounds[1:]))


def brute_force(problem):
    """``(T, parts)``: the least iteration time over every partition, each device's option as the solver's."""
    best, best_parts = float("inf"), None
    for parts in compositions(problem.length, problem.devices):
        options = [problem.option(a, b, problem.k(s)) for s, (a, b) in enumerate(parts)]
        if any(o is None for o in options):
            continue
        total = pipeline_time([o.time for o in options], problem.micro_batches)
        if total < best:
            best, best_parts = total, parts
    return best, best_parts


def smallest_memory(problem):
    """Brute force: the least over partitions of the largest requirement."""
    return min(max(problem.requirement(a, b, problem.k(s)) for s, (a, b) in enumerate(parts))
               for parts in compositions(problem.length, problem.devices))


def make(chain, devices, memory, micro, schedule, bandwidth=None, setup=None):
    return PartitionProblem(chain, devices, memory, micro, schedule, bandwidth=bandwidth, latency=1e-5 if bandwidth else 0.0,
                            setup=setup, slots=200)


CASES = [(length, devices, seed) for length, devices, seed in
         [(4, 2, 0), (5, 3, 1), (6, 2, 2), (6, 4, 3), (7, 3, 4), (8, 4, 5), (8, 2, 6), (8, 3, 7), (5, 1, 8)]]


@pytest.mark.parametrize("length,devices,seed", CASES)
def test_dp_equals_brute_force(length, devices, seed):
    chain = random_chain(length, seed=seed, tmp=True, params=True, own_saved=True)
    setups = [TrainingSetup(), TrainingSetup("adam", "bf16", 1, 4)]
    checked = recomputing = 0
    for schedule, micro, bandwidth in [("1f1b", 2 * devices, None), ("gpipe", devices, 1e9), ("1f1b", devices + 1, 5e8),
                                       ("gpipe", 1, None)]:
        setup = setups[(seed + micro) % 2]
        probe = make(chain, devices, 10**15, micro, schedule, bandwidth, setup)
        least = smallest_memory(probe)
        roomy = max(probe.requirement(a, b, probe.k(s)) for s, a, b in probe.positions())
        for memory in sorted({least, least + (roomy - least) // 10, least + (roomy - least) // 3,
                              (least + roomy) // 2, roomy}):
            problem = make(chain, devices, memory, micro, schedule, bandwidth, setup)
            expected, _ = brute_force(problem)
            solution = solve_partition(make(chain, devices, memory, micro, schedule, bandwidth, setup))
            assert solution.time == expected, (schedule, micro, memory, solution.parts)
            assert all(o.result.peak_bytes <= memory for o in solution.options)  # the allowance is safe
            checked += 1
            recomputing += any(o.kind != "store_all" for o in solution.options)
        with pytest.raises(MemschedError) as info:
            solve_partition(make(chain, devices, least - 1, micro, schedule, bandwidth, setup))
        assert f"({least} bytes)" in str(info.value) and "\n" not in str(info.value)
    assert checked >= 8 and recomputing >= 1


def uniform_chain(length):
    """Stages of 100-byte outputs that their backward reads (own saved = saved), 40 bytes of fp32 gradients each,
    no temporaries: every figure of the pipeline model can be worked by hand."""
    stages = tuple(Stage(name=f"s{i}", fwd_time=1.0, bwd_time=2.0, out_bytes=100, saved_bytes=100, param_bytes=40)
                   for i in range(length))
    return Chain(name="uniform", device="cpu", input_bytes=100, stages=stages, loss=Loss(0.5, 0))


@pytest.mark.parametrize("parts,micro,schedule,peaks", [
    # One device, GPipe, 2 micro-batches: 80 B parameters + 2 inputs of 100; per micro-batch (above its input)
    # forward peak 200, held 200, backward peak 400 (first backward 400, gradients 80 forming): the first
    # backward runs with the other micro-batch held: 200 + 400.
    ([(0, 2)], 2, "gpipe", [80 + 200 + 600]),
    # The same under 1F1B (one forward, one backward): the second forward runs beside the gradients (80) and
    # the output the engine still holds (100): 80 + 100 + 200 = 380 < the second backward's 80 + 400.
    ([(0, 2)], 2, "1f1b", [80 + 200 + 480]),
    # Two devices, 1F1B: device 0 (2 forwards, then 2 backwards) holds the inputs and received-gradient buffers
    # (2 * 200) and peaks in its first backward beside the other micro-batch: 100 + 300; device 1 (last) holds
    # 2 inputs and peaks in its second backward beside the gradients (40) and the first micro-batch's input
    # gradient still referenced by its send (100): 40 + 100 + 300.
    ([(0, 1), (1, 2)], 2, "1f1b", [40 + 400 + 400, 40 + 200 + 440]),
])
def test_device_peaks_worked_by_hand(parts, micro, schedule, peaks):
    chain = uniform_chain(2)
    result = simulate_pipeline(chain, store_all_split(chain, parts, micro, schedule, TrainingSetup("sgd")))
    assert [d.peak_bytes for d in result.devices] == peaks
    assert [phase_order(2, 2), phase_order(1, 2), phase_order(2, 4)] == ["FFBB", "FBFB", "FFBFBFBB"]


def test_one_device_one_micro_batch_is_the_chain_step():
    """With one device and one micro-batch the device's peak is the chain simulator's (gradients of the setup's
    size) plus the resident state, and its time the chain's own step time."""
    chain = dataclasses.replace(uniform_chain(5), stages=tuple(
        dataclasses.replace(stage, fwd_tmp_bytes=30 * i, bwd_tmp_bytes=70 * i, param_bytes=40 + 8 * i)
        for i, stage in enumerate(uniform_chain(5).stages)))
    for setup in (TrainingSetup(), TrainingSetup("adam", "bf16", 2, 4)):
        plan = partition(chain, 1, 10**15, 1, setup=setup)
        assert plan.predicted.time == chain.compute_time
        parameters = -(-sum(s.param_bytes for s in chain.stages) // 4)
        single = ChainSimulator(setup_chain(chain, setup)).run(store_all_schedule(5)).peak_bytes
        assert plan.predicted.peak_bytes == setup.resident_bytes(parameters) + single


def pipeline_plan(chain):
    probe = make(chain, 3, 10**15, 6, "1f1b", 2e9)
    least = smallest_memory(probe)
    roomy = max(probe.requirement(a, b, probe.k(s)) for s, a, b in probe.positions())
    return partition(chain, 3, least + (roomy - least) * 2 // 5, 6, "1f1b", bandwidth=2e9, latency=1e-5, slots=200)


def test_plan_round_trip_and_prediction(tmp_path):
    chain = random_chain(8, seed=4, tmp=True, params=True)
    plan = pipeline_plan(chain)
    assert plan.kind == "pipeline" and plan.schedule == ()
    assert "rotor" in plan.params["options"] and plan.recomputed_forwards > 0  # a device recomputes
    data = json.loads(json.dumps(plan.to_dict()))
    assert "schedule" not in data and data["pipeline"]["schedule"] == "1f1b"
    again = Plan.from_dict(data)
    assert again == plan
    result = simulate_pipeline(chain, again)
    assert result.time == plan.predicted.time and result.peak_bytes == plan.predicted.peak_bytes
    for device, figures in zip(plan.pipeline.devices, result.devices):
        assert (device.peak_bytes, device.time) == (figures.peak_bytes, figures.time)
        assert device.peak_bytes <= plan.budget_bytes
    assert plan.predicted.time >= plan.predicted.baseline_time
    with pytest.raises(MemschedError, match="solved for chain"):
        simulate_pipeline(random_chain(8, seed=5), plan)


BAD = [
    (lambda d: d["pipeline"].update(schedule="zb"), "pipeline.schedule must be one of 1f1b, gpipe"),
    (lambda d: d["pipeline"].update(micro_batches=0), "micro_batches must be at least 1"),
    (lambda d: d["pipeline"].update(schedule="1f1b", micro_batches=1), "1F1B needs at least as many micro-batches"),
    (lambda d: d["pipeline"].update(bandwidth=-1), "bandwidth must be bytes per second"),
    (lambda d: d["pipeline"].update(extra=1), "extra"),
    (lambda d: d["pipeline"]["setup"].update(optimizer="lion"), "pipeline.setup"),
    (lambda d: d["pipeline"]["devices"][1].update(first=0), "must be a non-empty range starting at"),
    (lambda d: d["pipeline"]["devices"][0]["schedule"].append({"op": "B", "stage": 7}), "is not on this device"),
    (lambda d: d["pipeline"]["devices"][0].pop("peak_bytes"), "peak_bytes"),
    (lambda d: d.update(schedule=[{"op": "Loss"}]), "has no top-level 'schedule'"),
    (lambda d: d.pop("pipeline"), "pipeline"),
]


@pytest.mark.parametrize("mutate,fragment", BAD)
def test_pipeline_plan_validation(mutate, fragment):
    chain = random_chain(8, seed=4, tmp=True, params=True)
    data = copy.deepcopy(pipeline_plan(chain).to_dict())
    mutate(data)
    with pytest.raises(MemschedError) as info:
        Plan.from_dict(data)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_other_kinds_refuse_pipeline_object():
    from solvers import solve
    chain = random_chain(5, seed=1)
    data = solve(chain, 10**12).to_dict()
    assert "pipeline" not in data
    data["pipeline"] = {}
    with pytest.raises(MemschedError, match="only a plan of kind 'pipeline'"):
        Plan.from_dict(data)


def test_bad_arguments():
    chain = random_chain(3, seed=1)
    with pytest.raises(MemschedError, match="at most that many devices"):
        partition(chain, 4, 10**12, 2)
    with pytest.raises(MemschedError, match="schedule must be one of"):
        partition(chain, 2, 10**12, 2, schedule="zb")


def test_simulator_refuses_a_broken_device_schedule():
    chain = random_chain(8, seed=4, tmp=True, params=True)
    data = pipeline_plan(chain).to_dict()
    data["pipeline"]["devices"][1]["schedule"] = data["pipeline"]["devices"][1]["schedule"][:-1]
    with pytest.raises(MemschedError) as info:
        simulate_pipeline(chain, Plan.from_dict(data))
    assert "devices[1]" in str(info.value) and "\n" not in str(info.value)


def test_recomputed_forwards_counts_every_device():
    chain = random_chain(8, seed=4, tmp=True, params=True)
    plan = pipeline_plan(chain)
    extra = sum(sum(op.kind in ("F_all", "F_ck", "F_none") for op in d.schedule) - (d.last - d.first)
                for d in plan.pipeline.devices)
    assert plan.recomputed_forwards == extra and not plan.moves_data


def test_1f1b_needs_as_many_micro_batches_as_devices():
    chain = random_chain(6, seed=1, params=True)
    with pytest.raises(MemschedError, match="1F1B needs at least as many micro-batches as devices") as info:
        make(chain, 4, 10**12, 3, "1f1b")
    assert "\n" not in str(info.value)
    make(chain, 4, 10**12, 3, "gpipe")  # GPipe takes any count


def test_gradients_added_to_a_replay_equal_a_replay_that_makes_them():
    """The pipeline simulator replays a device's sub-chain once and adds the parameter gradients each ``B``
    makes: the same steps as replaying the sub-chain with those gradients as its ``param_bytes``."""
    from planner.pipeline_simulator import _with_gradients
    from solvers.minimum import least_memory_schedule
    from solvers.rotor import rotor

    chain = random_chain(8, seed=9, tmp=True, params=True, own_saved=True)
    sub = sub_chain(chain, 2, 7)
    gradients = (13, 0, 77, 5, 1000)
    making = dataclasses.replace(sub, stages=tuple(dataclasses.replace(stage, param_bytes=g)
                                                   for stage, g in zip(sub.stages, gradients)))
    budget = (ChainSimulator(sub).run(store_all_schedule(5)).peak_bytes + minimum_budget(sub)) // 2
    for schedule in (store_all_schedule(5), least_memory_schedule(sub), rotor(sub, budget).schedule):
        added = _with_gradients(ChainSimulator(sub).run(schedule).timeline, sub, gradients)
        assert added == list(ChainSimulator(making).run(schedule).timeline)
