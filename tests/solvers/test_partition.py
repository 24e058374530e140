"""Pipeline partitioning (solvers/partition.py): the DP against brute force, infeasibility, and plans of kind
``pipeline`` (JSON round trip, strict validation, re-prediction by planner/simulate/pipeline.py)."""

import copy
import dataclasses
import itertools
import json

import pytest

from checks import one_error_line, one_line
from oracles.pipeline_plans import store_all_split
from planner import MemschedError
from planner.chain import Chain, Loss, Stage
from planner.plan import Plan
from planner.setup.training import TrainingSetup, parameters_of
from planner.simulate import pipeline as pipeline_simulator
from planner.simulate import simulate
from planner.simulate.chain import ChainSimulator
from planner.simulate.pipeline import (
    DeviceState,
    MicroBatch,
    in_flight,
    phase_runs,
    pipeline_time,
    retained,
    step_peak,
    sub_chain,
)
from profiles.synthetic import random_chain
from solvers.extremes import store_all_schedule
from solvers.minimum import minimum_budget
from solvers.partition import MAX_STAGES, PartitionProblem, partition, solve_partition


def compositions(length, parts):
    """Every split of ``range(length)`` into ``parts`` non-empty contiguous ranges."""
    for cuts in itertools.combinations(range(1, length), parts - 1):
        bounds = (0, *cuts, length)
        yield list(zip(bounds, bounds[1:]))


def brute_force(problem):
    """``(T, parts)``: the least iteration time over every partition, each device's option as the solver's."""
    best, best_parts = float("inf"), None
    for parts in compositions(problem.length, problem.devices):
        options = [problem.option(a, b, problem.in_flight(s)) for s, (a, b) in enumerate(parts)]
        if any(o is None for o in options):
            continue
        total = pipeline_time([o.time for o in options], problem.micro_batches, [o.result.sync for o in options])
        if total < best:
            best, best_parts = total, parts
    return best, best_parts


def smallest_memory(problem):
    """Brute force: the least over partitions of the largest requirement."""
    return min(max(problem.requirement(a, b, problem.in_flight(s)) for s, (a, b) in enumerate(parts))
               for parts in compositions(problem.length, problem.devices))


def make(chain, devices, memory, micro, schedule, bandwidth=None, setup=None):
    return PartitionProblem(chain, devices, memory, micro, schedule, bandwidth=bandwidth,
                            latency=1e-5 if bandwidth else 0.0, setup=setup, slots=200)


# (stages, devices, seed): 8 stages once (the brute force re-solves every segment for each of its compositions)
CASES = [(length, devices, seed) for length, devices, seed in
         [(4, 2, 0), (5, 3, 1), (6, 2, 2), (6, 4, 3), (7, 3, 4), (8, 4, 5), (7, 2, 6), (5, 1, 8)]]


@pytest.mark.slow
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
        roomy = max(probe.requirement(a, b, probe.in_flight(s)) for s, a, b in probe.positions())
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
        one_line(info, f"({least} bytes)")
    assert checked >= 8 and recomputing >= 1


def tied_chain(length, seed):
    """A random chain whose first stage shares a parameter with its last, and its second one with its fourth
    (each half of the owner's param_bytes, which count them)."""
    from planner.shared import SharedParameter

    chain = random_chain(length, seed=seed, tmp=True, params=True, own_saved=True)
    shared = (SharedParameter("embed", (0, length - 1), chain.stages[-1].param_bytes // 2),
              SharedParameter("w", (1, 3), chain.stages[3].param_bytes // 2))
    return dataclasses.replace(chain, shared=shared)


@pytest.mark.parametrize("length,devices,seed", [(5, 2, 11), (6, 3, 12), (7, 2, 13)])
def test_dp_with_shared_parameters_equals_brute_force(length, devices, seed):
    """Each device holding a copy of a parameter owned by a later device counts it (memory) and sums its gradient
    once per step (time, with a channel): the DP's optimum is still the brute force's, and the plan records the
    chain's shared parameters and re-predicts exactly."""
    chain = tied_chain(length, seed)
    untied = dataclasses.replace(chain, shared=())
    from planner.simulate.pipeline import copies

    synced = 0
    for schedule, micro, bandwidth in [("1f1b", 2 * devices, 2e8), ("gpipe", devices, None)]:
        probe = make(chain, devices, 10**15, micro, schedule, bandwidth)
        least = smallest_memory(probe)
        plain = make(untied, devices, 10**15, micro, schedule, bandwidth)
        for s, a, b in probe.positions():  # a copy costs its device memory; elsewhere nothing changes
            grows = probe.requirement(a, b, probe.in_flight(s)) > plain.requirement(a, b, plain.in_flight(s))
            assert grows == bool(copies(chain, a, b)), (s, a, b)
        roomy = max(probe.requirement(a, b, probe.in_flight(s)) for s, a, b in probe.positions())
        for memory in sorted({least, (least + roomy) // 2, roomy}):
            expected, _ = brute_force(make(chain, devices, memory, micro, schedule, bandwidth))
            solution = solve_partition(make(chain, devices, memory, micro, schedule, bandwidth))
            assert solution.time == expected, (schedule, micro, memory, solution.parts)
            synced += any(o.result.sync > 0 for o in solution.options)
    assert synced >= 1
    plan = partition(chain, devices, 10**15, 2 * devices, bandwidth=2e8, latency=1e-5)
    assert plan.pipeline.shared == chain.shared and Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    result = simulate(chain, plan)
    assert (result.time, result.peak_bytes) == (plan.predicted.time, plan.predicted.peak_bytes)


def uniform_chain(length):
    """Stages of 100-byte outputs that their backward reads (own saved = saved), 40 bytes of fp32 gradients each,
    no temporaries: every figure of the pipeline model can be worked by hand."""
    stages = tuple(Stage(name=f"s{i}", fwd_time=1.0, bwd_time=2.0, out_bytes=100, saved_bytes=100, param_bytes=40)
                   for i in range(length))
    return Chain(name="uniform", device="cpu", input_bytes=100, stages=stages, loss=Loss(0.5, 0))


@pytest.mark.parametrize("parts,micro,schedule,peaks", [
    # One device, GPipe, 2 micro-batches: 80 B parameters + 2 inputs of 100; per micro-batch (above its input)
    # forward peak 200, held 200, backward peak 440 (B 0: a_1's 100 beside the gradient of s1 (40), δ_0 (100)
    # and the device's output a_2 (100), which the engine holds through the whole backward): the first
    # backward runs with the other micro-batch held: 200 + 440.
    ([(0, 2)], 2, "gpipe", [80 + 200 + 640]),
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
    result = simulate(chain, store_all_split(chain, parts, micro, schedule, TrainingSetup("sgd")))
    assert [d.peak_bytes for d in result.devices] == peaks


def walked_peak(micro, schedule, k, m, state):
    """Every phase of the step in PyTorch's order (k forwards, then a backward and a forward while forwards
    remain, then the remaining backwards), the highest point above resident state and buffers."""
    peak = held = done = 0
    for phase in "F" * k + "BF" * (m - k) + "B" * k:
        others = retained(schedule, phase, k, m, done, state)
        if phase == "F":
            peak = max(peak, others + held * micro.held + micro.forward_peak + (state.gradients if done else 0))
            held += 1
            continue
        held -= 1
        peak = max(peak, others + held * micro.held + (micro.backward_peak + state.gradients if done
                                                       else micro.first_backward_peak))
        done += 1
    return peak


def expanded(runs):
    """The phases of :func:`phase_runs` one by one, as ``(phase, held, done)``."""
    return sorted((phase, held + i * held_step, done + i * done_step)
                  for phase, count, held, held_step, done, done_step in runs for i in range(count))


def test_step_peak_equals_walking_every_phase():
    """step_peak evaluates a few phases per run; walking all 2m phases gives the same peak (random figures, both
    schedules, every device of up to 6, m up to 40), and the runs are the order's phases."""
    import random

    rng = random.Random(0)

    def figure():
        return rng.choice([0, rng.randint(0, 100), rng.randint(0, 10**4)])

    for _ in range(3000):
        schedule, devices = rng.choice(["1f1b", "gpipe"]), rng.randint(1, 6)
        m = rng.randint(devices if schedule == "1f1b" else 1, 40)
        k = in_flight(schedule, m, devices, rng.randrange(devices))
        micro = MicroBatch(0.0, figure(), figure(), figure(), figure())
        state = DeviceState(0, 0, (figure(), figure()), figure(), figure(), 0, (0, 0), rng.random() < 0.5)
        assert step_peak(micro, schedule, k, m, state) == walked_peak(micro, schedule, k, m, state)
    order = "FFBFBFBB"  # k = 2, m = 4
    held = done = 0
    phases = []
    for phase in order:
        held -= phase == "B"
        phases.append((phase, held, done))
        held += phase == "F"
        done += phase == "B"
    assert expanded(phase_runs(2, 4)) == sorted(phases)

pipeline_simulator_phase_peak = pipeline_simulator.phase_peak  # the function counted below


def test_a_million_micro_batches_is_as_fast_as_a_few(monkeypatch):
    """The step's peak is found without walking its 2m phases: a million micro-batches partition evaluating no
    more phases than eight (counted: 2044 each), and the device peaks grow only by the m buffers; beyond 2**20 is
    refused in one line."""
    calls = []
    monkeypatch.setattr(pipeline_simulator, "phase_peak",
                        lambda *args: calls.append(args) or pipeline_simulator_phase_peak(*args))
    chain = random_chain(10, seed=3, tmp=True, params=True)
    evaluated, plans = [], []
    for m in (8, 10**6):
        calls.clear()
        plans.append(partition(chain, 3, 10**15, m))
        evaluated.append(len(calls))
    assert 0 < evaluated[1] <= 2 * evaluated[0], evaluated  # walking would be 2 * 10**6 per device and partition
    assert simulate(chain, plans[1]).peak_bytes == plans[1].predicted.peak_bytes
    with pytest.raises(MemschedError) as info:
        partition(chain, 3, 10**15, 2**20 + 1)
    assert "micro_batches (--micro-batches) must be a whole number from 1 to 1048576" in str(info.value)
    one_line(info)


def test_one_device_one_micro_batch_is_the_chain_step():
    """With one device and one micro-batch the device's peak is the chain simulator's (gradients of the setup's
    size) plus the resident state and the output the engine holds, and its time the chain's own step time."""
    chain = dataclasses.replace(uniform_chain(5), stages=tuple(
        dataclasses.replace(stage, fwd_tmp_bytes=30 * i, bwd_tmp_bytes=70 * i, param_bytes=40 + 8 * i)
        for i, stage in enumerate(uniform_chain(5).stages)))
    for setup in (TrainingSetup(), TrainingSetup("adam", "bf16", 2, 4)):
        plan = partition(chain, 1, 10**15, 1, setup=setup)
        assert plan.predicted.time == chain.compute_time
        parameters = -(-sum(s.param_bytes for s in chain.stages) // 4)
        scale = setup.gradient_bytes(parameters_of(chain)), sum(stage.param_bytes for stage in chain.stages)
        scaled = dataclasses.replace(chain, stages=tuple(  # the setup's gradients, as each device counts them
            dataclasses.replace(stage, param_bytes=-(-stage.param_bytes * scale[0] // scale[1]))
            for stage in chain.stages))
        single = ChainSimulator(scaled).run(store_all_schedule(5))
        # the engine holds the device's output a_5 through the backwards of the stages before the last
        held = [step.peak + (chain.act_bytes(5) if step.op.kind == "B" and step.op.stage < 4 else 0)
                for step in single.timeline]
        assert plan.predicted.peak_bytes == setup.resident_bytes(parameters) + max(held)


def pipeline_plan(chain):
    probe = make(chain, 3, 10**15, 6, "1f1b", 2e9)
    least = smallest_memory(probe)
    roomy = max(probe.requirement(a, b, probe.in_flight(s)) for s, a, b in probe.positions())
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
    result = simulate(chain, again)
    assert result.time == plan.predicted.time and result.peak_bytes == plan.predicted.peak_bytes
    for device, figures in zip(plan.pipeline.devices, result.devices):
        assert (device.peak_bytes, device.time) == (figures.peak_bytes, figures.time)
        assert device.peak_bytes <= plan.budget_bytes
    assert plan.predicted.time >= plan.predicted.baseline_time
    with pytest.raises(MemschedError, match="solved for chain"):
        simulate(random_chain(8, seed=5), plan)


BAD = [
    (lambda d: d["pipeline"].update(schedule="zb"), "pipeline.schedule must be one of 1f1b, gpipe"),
    (lambda d: d["pipeline"].update(micro_batches=0), "micro_batches must be a whole number from 1 to 1048576"),
    (lambda d: d["pipeline"].update(micro_batches=2**20 + 1), "micro_batches must be a whole number from 1 to"),
    (lambda d: d["pipeline"].update(micro_batches=10**400), "got 'about 2**1328'"),
    (lambda d: d["pipeline"].update(shared=[{"name": "w", "stages": [0, 8], "bytes": 4}]), "pipeline.shared[0].stages"),
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
    one_line(info, fragment)


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
    del data["check"]  # an edit taken as its author's: the schedule is what is checked
    data["pipeline"]["devices"][1]["schedule"] = data["pipeline"]["devices"][1]["schedule"][:-1]
    with pytest.raises(MemschedError) as info:
        simulate(chain, Plan.from_dict(data))
    one_line(info, "devices[1]")


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
    one_line(info)
    make(chain, 4, 10**12, 3, "gpipe")  # GPipe takes any count


def test_a_chain_too_long_to_partition_is_refused_at_once():
    """Every stage range is solved and simulated, so the work grows faster than L^2: past MAX_STAGES the answer
    is one line, before any range is solved, not minutes of work."""
    chain = random_chain(MAX_STAGES + 1, seed=1)
    with pytest.raises(MemschedError, match=f"has {MAX_STAGES + 1} stages, more than the {MAX_STAGES}") as info:
        make(chain, 4, 10**12, 8, "1f1b")
    one_line(info)


def test_gradients_added_to_a_replay_equal_a_replay_that_makes_them():
    """The pipeline simulator replays a device's sub-chain once and adds the parameter gradients each ``B``
    makes: the same steps as replaying the sub-chain with those gradients as its ``param_bytes``."""
    from planner.simulate.pipeline import _with_gradients
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


def test_cli_a_million_micro_batches_partitions_and_shows_at_once(tmp_path, capsys):
    """``memsched partition --micro-batches 1000000`` and ``memsched show`` of its plan answer at once (the step's
    phases are not walked one by one); beyond 2**20 micro-batches, in a plan file or on the command line, is one
    line naming the field."""
    import cli
    from planner import save_chain

    save_chain(random_chain(10, seed=3, tmp=True, params=True), tmp_path / "chain.json")
    plan_path, chain_path = str(tmp_path / "plan.json"), str(tmp_path / "chain.json")
    assert cli.main(["partition", chain_path, "--devices", "3", "--micro-batches", "1000000", "--device-memory",
                     "900TiB", "-o", plan_path]) == 0
    assert "1000000 micro-batches" in capsys.readouterr().out
    assert cli.main(["show", plan_path, "--chain", chain_path]) == 0
    assert "simulated" in capsys.readouterr().out
    status = cli.main(["partition", chain_path, "--devices", "3", "--micro-batches", str(2**20 + 1),
                       "--device-memory", "900TiB"])
    one_error_line(status, *capsys.readouterr(), "--micro-batches", "from 1 to 1048576")
    data = json.loads((tmp_path / "plan.json").read_text())
    data["pipeline"]["micro_batches"] = 10**7
    (tmp_path / "plan.json").write_text(json.dumps(data))
    one_error_line(cli.main(["show", plan_path]), *capsys.readouterr(),
                   "pipeline.micro_batches must be a whole number from 1 to 1048576")
