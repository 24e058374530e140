"""The simulator on a chain small enough to replay by hand, and its refusals; the one dispatcher."""

import pytest

import solvers
from checks import one_line
from format_cases import ops as ops_of
from planner import Chain, Loss, MemschedError, Op, ScheduleError, Stage, check_plan_matches, simulate
from planner.ops import host_weight_stages
from planner.simulate import check_schedule
from planner.simulate.chain import ChainSimulator
from planner.simulate.graph import GraphSimulator
from planner.simulate.offload import OffloadResult, OffloadSimulator
from planner.transfer import Transfer
from profiles.synthetic import random_chain, random_graph
from solvers import solve_graph
from solvers.extremes import recompute_all, store_all_schedule
from solvers.partition import partition

# Input 10 bytes; two stages; the loss. Sizes chosen so every term of the model shows in the sums.
CHAIN = Chain(
    name="hand", device="test", input_bytes=10,
    stages=(
        Stage("s0", fwd_time=1.0, bwd_time=2.0, out_bytes=20, saved_bytes=50, fwd_tmp_bytes=3, bwd_tmp_bytes=4,
              param_bytes=5),
        Stage("s1", fwd_time=3.0, bwd_time=4.0, out_bytes=30, saved_bytes=60, fwd_tmp_bytes=6, bwd_tmp_bytes=7,
              param_bytes=8),
    ),
    loss=Loss(bwd_time=0.5, tmp_bytes=9),
)


def _trace(schedule):
    result = simulate(CHAIN, schedule)
    return result, [(str(s.op), s.memory_before, s.peak, s.memory_after) for s in result.timeline]


def test_store_all_by_hand():
    result, steps = _trace(store_all_schedule(2))
    assert steps == [
        ("F_all 0", 10, 10 + 50 + 3, 60),  # ā_1 kept; forward temporaries on top
        ("F_all 1", 60, 60 + 60 + 6, 120),
        ("Loss", 120, 120 + 30 + 9, 150),  # δ_2 is new memory: a_2 lives inside ā_2
        ("B 1", 150, 150 + 20 + 7, 150 - 60 - 30 + 8 + 20),  # δ_1 + temporaries (parameter gradients inside)
        ("B 0", 88, 88 + 10 + 4, 88 - 50 - 20 + 5 + 10),  # the input is never released
    ]
    assert result.peak_bytes == 177
    assert result.time == pytest.approx(1 + 3 + 0.5 + 4 + 2)
    assert [(s.start, s.end) for s in result.timeline][:2] == [(0.0, 1.0), (1.0, 4.0)]


def test_recompute_all_by_hand():
    result, steps = _trace(recompute_all(CHAIN, 10**9).schedule)
    assert steps == [
        ("F_ck 0", 10, 10 + 20 + 3, 30),  # a_1 kept standalone
        ("F_all 1", 30, 30 + 60 + 6, 90),
        ("Loss", 90, 90 + 30 + 9, 120),
        ("B 1", 120, 120 + 20 + 7, 120 - 60 - 30 + 8),  # δ_1 takes the place of the checkpoint a_1
        ("F_all 0", 38, 38 + 50 + 3, 88),
        ("B 0", 88, 88 + 10 + 4, 33),
    ]
    assert result.peak_bytes == 147
    assert result.time == pytest.approx(1 + 3 + 0.5 + 4 + 1 + 2)


def test_f_none_releases_its_input_but_never_the_chain_input():
    three = Chain(name="three", device="test", input_bytes=10,
                  stages=tuple(Stage(f"s{i}", 1.0, 1.0, 20, 40) for i in range(3)), loss=Loss())
    schedule = [Op("F_none", 0), Op("F_none", 1), Op("F_all", 2), Op("Loss"), Op("B", 2),
                Op("F_ck", 0), Op("F_all", 1), Op("B", 1), Op("F_all", 0), Op("B", 0)]
    steps = simulate(three, schedule).timeline
    assert steps[0].memory_after == 10 + 20  # a_0 stays
    assert steps[1].memory_after == 10 + 20  # a_2 made, a_1 released
    assert steps[2].memory_after == 10 + 20 + 40


BAD_SCHEDULES = {
    "backward before its forward": ([Op("B", 0)], "schedule[0] (B 0): ā_1 is not in memory"),
    "loss without the last activation": ([Op("F_all", 0), Op("Loss")], "schedule[1] (Loss): a_2 is not in memory"),
    "backward without its gradient": ([Op("F_all", 0), Op("B", 0)], "schedule[1] (B 0): δ_1 is not in memory"),
    "forward without its input": ([Op("F_all", 1)], "schedule[0] (F_all 1): a_1 is not in memory"),
    "stage out of range": ([Op("F_all", 2)], "schedule[0] (F_all 2): stage must be between 0 and 1"),
    "repeated backward": ([*store_all_schedule(2), Op("B", 0)],
                          "schedule[5] (B 0): the backward of stage 0 has already run"),
    "repeated loss": ([Op("F_all", 0), Op("F_all", 1), Op("Loss"), Op("Loss")],
                      "schedule[3] (Loss): the loss has already"),
    "missing backward": (list(store_all_schedule(2))[:-1], "schedule ends before the backward of stage 0"),
    "missing loss": ([Op("F_all", 0), Op("F_all", 1)], "schedule ends before the loss"),
    "duplicate activation": ([Op("F_ck", 0), Op("F_ck", 0)], "schedule[1] (F_ck 0): a_1 is already in memory"),
    "duplicate saved state": ([Op("F_all", 0), Op("F_all", 0)], "schedule[1] (F_all 0): ā_1 is already in memory"),
}


@pytest.mark.parametrize("schedule, message", BAD_SCHEDULES.values(), ids=BAD_SCHEDULES.keys())
def test_invalid_schedules_are_refused_with_the_operation_index(schedule, message):
    with pytest.raises(ScheduleError) as caught:
        simulate(CHAIN, schedule)
    assert str(caught.value).startswith(message)
    one_line(caught)


def test_a_checkpoint_is_kept_until_its_backward():
    three = Chain(name="three", device="test", input_bytes=10,
                  stages=tuple(Stage(f"s{i}", 1.0, 1.0, 20, 40) for i in range(3)), loss=Loss())
    # a_1 is kept by F_ck 1; a_2 is a plain intermediate that F_none 2 releases; F_none 1 may not release a_1.
    with pytest.raises(ScheduleError, match=r"schedule\[3\] \(F_none 1\): a_1 is a checkpoint"):
        simulate(three, [Op("F_ck", 0), Op("F_ck", 1), Op("F_none", 2), Op("F_none", 1)])


def test_a_backward_peaks_at_least_at_the_memory_it_leaves():
    # Parameter gradients larger than what the backward frees: the memory after B 0 is the peak.
    heavy = Chain(name="heavy", device="test", input_bytes=10,
                  stages=(Stage("s0", 1.0, 1.0, out_bytes=20, saved_bytes=20, param_bytes=500),), loss=Loss())
    steps = simulate(heavy, store_all_schedule(1)).timeline
    assert (steps[-1].peak, steps[-1].memory_after) == (10 + 500 + 10, 10 + 500 + 10)


def test_one_dispatcher_for_every_kind_of_plan():
    chain = random_chain(4, seed=3, tmp=True, params=True)
    plan = solvers.solve(chain, 10**12, "store_all")
    assert simulate(chain, plan) == simulate(chain, plan.schedule) == ChainSimulator(chain).run(plan.schedule)
    offload = ops_of("F_all 0, Offload 0 saved, F_all 1, Release 0 saved, F_all 2, F_all 3, Loss, B 3, B 2, "
                     "Prefetch 0 saved, B 1, B 0")
    assert isinstance(simulate(chain, offload, Transfer(1e9, 1e9)), OffloadResult)
    pipeline = partition(chain, 2, 2**40, 2)
    assert simulate(chain, pipeline).peak_bytes == pipeline.predicted.peak_bytes
    graph = random_graph(1, 6)
    graph_plan = solve_graph(graph, 10**12, "store_all")
    assert simulate(graph, graph_plan) == GraphSimulator(graph).run(graph_plan.schedule)


def test_a_plan_is_checked_against_its_problem_and_kind():
    chain = random_chain(4, seed=3)
    pipeline = partition(chain, 2, 2**40, 2)
    check_plan_matches(pipeline, chain)  # a chain takes chain and pipeline plans
    with pytest.raises(MemschedError, match=r"^p.json is a plan of kind 'pipeline', for a pipeline of a chain "
                                            r"\(memsched.chain/1\), not for a chain; give the pipeline it was "
                                            r"solved for, or solve this chain$"):
        check_plan_matches(pipeline, chain, "p.json", kind="chain")
    with pytest.raises(MemschedError, match=r"^plan is a plan of kind 'pipeline', .* not for a graph;"):
        simulate(random_graph(1, 6), pipeline)
    with pytest.raises(MemschedError, match=r"^plan was solved for chain 'synthetic_L4_s3' .*, not for chain "
                                            r"'synthetic_L4_s4' .*; solve again for this chain$"):
        simulate(random_chain(4, seed=4), pipeline)


def test_the_offload_simulator_runs_the_host_weight_stages_it_was_built_for():
    schedule = ops_of("Prefetch 0 weights, F_all 0, Loss, B 0, Release 0 weights, Offload 0 grads, "
                      "Release 0 grads")
    chain = random_chain(1, seed=2, params=True)
    result = OffloadSimulator(chain, Transfer(1e9, 1e9), host_weight_stages(schedule)).run(schedule)
    assert result == simulate(chain, schedule, Transfer(1e9, 1e9))
    with pytest.raises(ValueError, match="build the simulator with host_weight_stages"):
        OffloadSimulator(chain, Transfer(1e9, 1e9)).run(schedule)
    with pytest.raises(ScheduleError, match="^schedule moves the weights of stage 3, which does not exist$"):
        check_schedule(ops_of("Prefetch 3 weights, F_all 0, Loss, B 0"), 1)
