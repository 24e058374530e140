"""Weight offload: host-weight stages in the offload simulator, the placement policy and solving with
TrainingSetup(host_weights=...)."""

import pytest

import cli
import solvers
from checks import one_line
from format_cases import ops
from planner.chain import Chain, Loss, Stage
from planner.errors import MemschedError
from planner.ops import Op
from planner.setup import TrainingSetup
from planner.simulate import simulate
from planner.simulate.replay import ScheduleError
from planner.transfer import Transfer
from profiles.synthetic import random_chain
from solvers.extremes import store_all_schedule
from solvers.weights import chosen_weight_stages, place_weight_transfers, weight_reserve

CHANNEL = Transfer(d2h_bandwidth=100.0, h2d_bandwidth=50.0, latency=0.0)  # 100 B of weights: 2 s in, 1 s out


def two_stage_chain():
    """Stages of 1 s forward, 2 s backward, 10-byte outputs saving 20 bytes, 100 bytes of parameters each."""
    stages = tuple(Stage(f"s{i}", 1.0, 2.0, out_bytes=10, saved_bytes=20, param_bytes=100) for i in range(2))
    return Chain("two", "cpu", 5, stages, Loss())


def test_worked_example_by_hand():
    """Stage 1's parameters on the host: in for its forward, out, in again for its backward; its gradients out."""
    schedule = ops("Prefetch 1 weights, F_all 0, F_all 1, Release 1 weights, Loss, Prefetch 1 weights, B 1, "
                   "Release 1 weights, Offload 1 grads, B 0, Release 1 grads")
    result = simulate(two_stage_chain(), schedule, CHANNEL)
    plain = simulate(two_stage_chain(), store_all_schedule(2))
    # the first prefetch (2 s) overlaps F_all 0 (1 s): F_all 1 waits 1 s; the second one overlaps nothing: B 1
    # waits 2 s; the gradients' copy out (1 s) overlaps B 0 (2 s)
    assert result.stall_time == 3.0 and result.time == plain.time + 3.0
    # B 1 peaks with stage 1's weights on the device (+100) where the plain step keeps no weights in the budget;
    # the step ends without stage 1's gradients (-100)
    b1 = [s for s in result.timeline if s.op == Op("B", 1)][0]
    plain_b1 = [s for s in plain.timeline if s.op == Op("B", 1)][0]
    assert b1.peak == plain_b1.peak + 100
    assert result.timeline[-1].memory_after == plain.timeline[-1].memory_after - 100
    assert [(c.item, c.direction, c.start, c.end) for c in result.copies] == [
        (("weights", 1), "h2d", 0.0, 2.0), (("weights", 1), "h2d", 3.0, 5.0), (("grads", 1), "d2h", 7.0, 8.0)]


@pytest.mark.parametrize("schedule, message", [
    ("F_all 0, Prefetch 1 weights, Release 1 weights, F_all 1", "weights 1 is on the host"),
    ("Prefetch 0 weights, F_all 0, Offload 0 weights", "weights are never copied to the host"),
    ("Prefetch 0 weights, F_all 0, Release 0 weights, Release 0 weights", "weights 0 are not on the device"),
    ("Prefetch 0 weights, F_all 0, F_all 1, Loss, B 1, Offload 0 grads", "gradients of stage 0 do not exist yet"),
    ("F_all 0, F_all 1, Loss, B 1, Offload 1 grads", "only a host-weight stage's gradients move"),
    ("Prefetch 1 weights, F_all 0, F_all 1, Loss, B 1, Release 1 weights, Offload 1 grads, Release 1 grads, "
     "Prefetch 1 grads", "gradients on the host stay there"),
    ("Prefetch 7 weights", "stage 7, which does not exist"),
])
def test_impossible_weight_transfers_are_one_line(schedule, message):
    with pytest.raises(ScheduleError, match=message) as info:
        simulate(two_stage_chain(), ops(schedule), CHANNEL)
    one_line(info)


def test_a_step_ends_with_host_weights_and_their_gradients_on_the_host():
    with pytest.raises(ScheduleError, match="weights of stage 1 on the device"):
        simulate(two_stage_chain(), ops("Prefetch 1 weights, F_all 0, F_all 1, Loss, B 1, B 0"), CHANNEL)
    with pytest.raises(ScheduleError, match="gradients of host-weight stage 1 on the device"):
        simulate(two_stage_chain(), ops("Prefetch 1 weights, F_all 0, F_all 1, Loss, B 1, Release 1 weights, B 0"),
                 CHANNEL)


def test_policy_brings_weights_in_one_operation_ahead_and_frees_them_after_each_run():
    chain = random_chain(6, 2, tmp=True, params=True)
    fast = Transfer(1e15, 1e15)
    for solver in ("store_all", "rotor"):
        budget = solvers.store_all_peak(chain) if solver == "store_all" else int(0.7 * solvers.store_all_peak(chain))
        base = solvers.solve(chain, budget, solver).schedule
        schedule = place_weight_transfers(base, range(chain.length))
        assert [op for op in schedule if op.what not in ("weights", "grads")] == list(base)
        result = simulate(chain, schedule, fast)
        plain = simulate(chain, base)
        assert result.stall_time < 1e-6 * plain.time and result.time == pytest.approx(plain.time)
        # at most two stages' parameters on the device at once: the peak is the plain peak plus at most that
        assert result.peak_bytes <= plain.peak_bytes + weight_reserve(chain, range(chain.length))
        assert result.timeline[-1].memory_after == plain.timeline[-1].memory_after - sum(
            s.param_bytes for s in chain.stages)


def test_solve_with_host_weights_fits_and_moves_only_the_stages_asked():
    chain = random_chain(10, 5, tmp=True, params=True)
    transfer = Transfer(5e9, 5e9, 1e-5)
    budget = int(0.6 * solvers.store_all_peak(chain))
    for solver, params in (("rotor", {}), ("pofo", {"time_limit": 0}), ("offload_greedy", {})):
        plan = solvers.solve(chain, budget, solver, TrainingSetup(host_weights="1,3"), transfer=transfer, **params)
        assert plan.predicted.peak_bytes <= budget and not plan.optimal
        assert {op.stage for op in plan.schedule if op.what == "weights"} == {1, 3}
        assert plan.params["weights"] == [1, 3] and plan.transfer == transfer
        again = simulate(chain, plan)
        assert (again.peak_bytes, again.time) == (plan.predicted.peak_bytes, plan.predicted.time)


def test_weight_arguments_are_checked():
    chain = random_chain(4, 1, params=True)
    assert chosen_weight_stages(chain, "all") == (0, 1, 2, 3) and chosen_weight_stages(chain, [2, 0, 2]) == (0, 2)
    for bad, message in [("x", "give 'all' or stage indices"), ("9", "stage 9 does not exist"),
                         ([-1], "stage -1 does not exist")]:
        with pytest.raises(MemschedError, match=message):
            chosen_weight_stages(chain, bad)
    no_params = random_chain(3, 1)
    with pytest.raises(MemschedError, match="none of the stages chosen has parameters"):
        chosen_weight_stages(no_params, "all")
    with pytest.raises(MemschedError, match="needs? a copy channel|copy channel both ways"):
        solvers.solve(chain, solvers.store_all_peak(chain), "rotor", TrainingSetup(host_weights="all"))
    with pytest.raises(MemschedError, match="does not hold the parameters of two host-weight stages"):
        solvers.solve(chain, 10, "rotor", TrainingSetup(host_weights="all"), transfer=Transfer(1e9, 1e9))


def test_command_line(capsys, tmp_path):
    from planner import save_chain

    path = tmp_path / "chain.json"
    save_chain(random_chain(8, 3, tmp=True, params=True), path)
    status = cli.main(["solve", str(path), "--budget", "60%", "--offload-weights", "all", "--bandwidth", "8GB/s",
                       "-o", str(tmp_path / "plan.json")])
    out, err = capsys.readouterr()
    assert status == 0, err
    assert "weights=[0, 1, 2, 3, 4, 5, 6, 7]" in out and "stalls" in out
    status = cli.main(["solve", str(path), "--budget", "60%", "--offload-weights", "all"])
    _, err = capsys.readouterr()
    assert status == 2 and "--offload-weights moves data to host memory and needs the copy channel" in err


def test_train_with_host_weights(capsys):
    status = cli.main(["train", "gpt-tiny:layers=3,d=32,heads=2,seq=16,vocab=64,batch=4", "--budget", "90%",
                       "--offload-weights", "all", "--bandwidth", "50GB/s", "--steps", "2"])
    out, err = capsys.readouterr()
    assert status == 0, err
    ratios = [float(row.split()[-4]) for row in out.splitlines() if row.strip()[:1].isdigit() and "iB" in row
              and len(row.split()) >= 8]
    assert len(ratios) == 2 and all(abs(ratio - 1) <= 0.02 for ratio in ratios)
