"""The copy channel, transfer operations in plans, and the offload simulator's two timelines."""

import json
import random

import pytest

from checks import one_line
from format_cases import ops
from planner.chain import Chain, Loss, Stage
from planner.errors import MemschedError
from planner.ops import Op, host_weight_stages
from planner.plan import Plan, Predicted
from planner.simulate import simulate
from planner.simulate.offload import OffloadSimulator
from planner.simulate.replay import ScheduleError
from planner.transfer import Transfer
from planner.units import parse_bandwidth
from profiles.synthetic import random_chain
from solvers.extremes import store_all_schedule


def even_chain(length=3, transfer=None):
    """Stages of 1 s forward, 2 s backward, 100-byte outputs that save 150 bytes; a 10-byte input."""
    stages = tuple(Stage(f"s{i}", 1.0, 2.0, out_bytes=100, saved_bytes=150) for i in range(length))
    return Chain("even", "cpu", 10, stages, Loss(), transfer)


SLOW = Transfer(d2h_bandwidth=100.0, h2d_bandwidth=50.0, latency=0.5)  # 150 B: 2.0 s out, 3.5 s back


# --- the channel ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, value", [("16GB/s", 16e9), ("12GiB/s", 12 * 2**30), ("800MB", 8e8), ("1.5e10", 1.5e10),
                                         (" 2 kib / s ", 2048.0)])
def test_bandwidth_is_read_with_decimal_and_binary_units(text, value):
    assert parse_bandwidth(text) == value


@pytest.mark.parametrize("text", ["fast", "16GB/h", "-1GB/s", "1e999GB/s", "16 parsecs", "0"])
def test_bad_bandwidth_is_one_line(text):
    with pytest.raises(MemschedError, match="--bandwidth") as info:
        parse_bandwidth(text)
    one_line(info)


def test_transfer_seconds_and_validation():
    assert SLOW.seconds(150, "d2h") == 2.0 and SLOW.seconds(150, "h2d") == 3.5
    assert Transfer(0.0, 1.0).seconds(1, "d2h") == float("inf") and not Transfer(0.0, 1.0).usable
    for raw, field in [({"d2h_bandwidth": -1, "h2d_bandwidth": 1}, "d2h_bandwidth"),
                       ({"d2h_bandwidth": 1}, "h2d_bandwidth"),
                       ({"d2h_bandwidth": 1, "h2d_bandwidth": True}, "h2d_bandwidth"),
                       ({"d2h_bandwidth": 1, "h2d_bandwidth": 1, "latency": -0.1}, "latency"),
                       ({"d2h_bandwidth": 1, "h2d_bandwidth": 1, "speed": 3}, "speed")]:
        with pytest.raises(MemschedError, match=field):
            Transfer.from_dict(raw)


def test_chain_keeps_its_channel_out_of_the_fingerprint():
    plain, measured = even_chain(), even_chain(transfer=SLOW)
    assert plain.fingerprint() == measured.fingerprint()
    assert "transfer" not in plain.to_dict()
    again = Chain.from_dict(json.loads(json.dumps(measured.to_dict())))
    assert again == measured and again.transfer == SLOW
    with pytest.raises(MemschedError, match=r"transfer\.h2d_bandwidth"):
        Chain.from_dict({**plain.to_dict(), "transfer": {"d2h_bandwidth": 1e9, "h2d_bandwidth": "fast"}})


# --- plans with transfers ---------------------------------------------------------------------------------

def plan_of(schedule, transfer=None):
    chain = even_chain()
    return Plan(chain.name, chain.fingerprint(), "hand", 1000, Predicted(500, 12.5, 9.0), tuple(schedule),
                transfer=transfer)


def test_transfer_operations_round_trip_and_old_plans_are_unchanged():
    schedule = ops("F_all 0, Offload 0 saved, F_all 1, F_all 2, Release 0 saved, Loss, B 2, Prefetch 0 saved, B 1, B 0")
    plan = plan_of(schedule, SLOW)
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["schedule"][1] == {"op": "Offload", "stage": 0, "what": "saved"}
    assert Plan.from_dict(data) == plan and plan.moves_data
    old = plan_of(store_all_schedule(3))
    assert "transfer" not in old.to_dict() and all("what" not in op for op in old.to_dict()["schedule"])
    assert not old.moves_data


@pytest.mark.parametrize("item, message", [
    ({"op": "Offload", "stage": 0}, "missing field 'what'"),
    ({"op": "Offload", "stage": 0, "what": "params"}, "what must be one of saved, input, weights, grads"),
    ({"op": "B", "stage": 0, "what": "saved"}, "only Offload, Release, Prefetch take 'what'"),
    ({"op": "Prefetch", "what": "saved"}, "missing field 'stage'"),
])
def test_bad_transfer_operations_are_one_line(item, message):
    data = plan_of(store_all_schedule(3)).to_dict()
    data["schedule"][0] = item
    with pytest.raises(MemschedError, match=message) as info:
        Plan.from_dict(data, "p.json")
    one_line(info, "p.json: schedule[0]")


# --- the simulator -----------------------------------------------------------------------------------------

def test_worked_example_by_hand():
    schedule = ops("F_all 0, Offload 0 saved, F_all 1, F_all 2, Release 0 saved, Loss, B 2, Prefetch 0 saved, B 1, B 0")
    result = simulate(even_chain(), schedule, SLOW)
    # forwards [0,3]; copy out [1,3] so the release does not wait; 460 - 150 resident; the loss adds δ_3 (410),
    # B 2 peaks at 410 + 100 and leaves 260; the prefetch (3.5 s from t=5) adds 150 and B 1 waits until 8.5
    assert result.peak_bytes == 510
    assert result.time == 12.5 and result.stall_time == 3.5
    assert [(c.direction, c.start, c.end, c.nbytes) for c in result.copies] == [("d2h", 1.0, 3.0, 150),
                                                                                ("h2d", 5.0, 8.5, 150)]
    assert [(s.op, s.start, s.end) for s in result.timeline][-2] == (Op("B", 1), 5.0, 10.5)
    assert simulate(even_chain(), store_all_schedule(3)).peak_bytes == 660


def test_release_waits_for_its_copy():
    schedule = ops("F_all 0, Offload 0 saved, F_all 1, Release 0 saved, F_all 2, Loss, B 2, Prefetch 0 saved, B 1, B 0")
    result = simulate(even_chain(), schedule, SLOW)
    assert result.stall_time == 1.0 + 3.5  # the copy out ends 1 s after F_all 1; B 1 waits for the whole prefetch
    assert result.time == 9.0 + 4.5


def test_engines_copy_one_transfer_at_a_time_in_issue_order():
    schedule = ops("F_all 0, Offload 0 saved, F_all 1, Offload 1 saved, F_all 2, Release 0 saved, Release 1 saved, "
                   "Loss, Prefetch 1 saved, Prefetch 0 saved, B 2, B 1, B 0")
    result = simulate(even_chain(), schedule, SLOW)
    out0, out1, in1, in0 = result.copies
    assert (out0.start, out0.end, out1.start, out1.end) == (1.0, 3.0, 3.0, 5.0)  # the second waits for the first
    assert (in1.start, in1.end, in0.start, in0.end) == (5.0, 8.5, 8.5, 12.0)
    # Release 1 waits 2 s; B 2 reads a_2 (in ā_2) and waits 3.5 s; B 1 reads a_1 (in ā_1) and waits 1.5 s more
    assert result.stall_time == 2.0 + 3.5 + 1.5 and result.time == 16.0


def test_free_channel_costs_nothing_and_frees_exactly_the_bytes_away():
    """Random chains, random offloads of ā between the next forward and the backward that reads it: with a very
    fast channel the time is the compute time, and each compute operation peaks at its no-transfer peak less
    the bytes then on the host."""
    fast = Transfer(1e30, 1e30, 0.0)
    rng = random.Random(5)
    for seed in range(20):
        chain = random_chain(6, seed, tmp=True, params=True, own_saved=True)
        length = chain.length
        plain = simulate(chain, store_all_schedule(length))
        chosen = [i for i in range(length - 1) if rng.random() < 0.6]
        forward, backward = [], []
        for i in range(length):
            forward.append(Op("F_all", i))
            if i - 1 in chosen:
                forward += [Op("Offload", i - 1, "saved"), Op("Release", i - 1, "saved")]
        for i in reversed(range(length)):
            if i - 1 in chosen:
                backward.append(Op("Prefetch", i - 1, "saved"))
            backward.append(Op("B", i))
        result = OffloadSimulator(chain, fast).run(forward + [Op("Loss")] + backward)  # with or without transfers
        assert result.stall_time == 0 and result.time == pytest.approx(plain.time, rel=1e-12)
        away = {op: 0 for op in store_all_schedule(length)}
        for step in plain.timeline:
            op = step.op
            if op.kind == "F_all":
                away[op] = sum(chain.stages[j].saved_bytes for j in chosen if j + 1 < op.stage)
            elif op.kind == "B":
                away[op] = sum(chain.stages[j].saved_bytes for j in chosen if j + 1 < op.stage)
            else:
                away[op] = sum(chain.stages[j].saved_bytes for j in chosen)
        compute = [s for s in result.timeline if s.op.kind in ("F_all", "Loss", "B")]
        assert [s.peak for s in compute] == [s.peak - away[s.op] for s in plain.timeline]
        assert result.timeline[-1].memory_after == plain.timeline[-1].memory_after


def test_checkpoint_offloaded_between_its_segments():
    """A rotor-style schedule: a_1 kept by F_ck 0... here F_ck 1 keeps a_1 standalone while stage 1-2 run."""
    chain = even_chain()
    schedule = ops("F_ck 0, Offload 1 input, F_all 1, F_all 2, Release 1 input, Loss, B 2, Prefetch 1 input, B 1, "
                   "F_all 0, B 0")
    result = simulate(chain, schedule, SLOW)
    plain = simulate(chain, [op for op in schedule if op.kind not in ("Offload", "Release", "Prefetch")])
    assert result.peak_bytes < plain.peak_bytes
    assert [c.nbytes for c in result.copies] == [100, 100]


@pytest.mark.parametrize("schedule, message", [
    ("F_all 0, Offload 0 saved, Release 0 saved, F_all 1", "saved 0 is on the host"),
    ("F_all 0, F_all 1, F_all 2, Loss, B 2, B 1, Offload 0 saved, B 0", "still being offloaded"),
    ("F_all 0, Release 0 saved", "not being offloaded"),
    ("F_all 0, Prefetch 0 saved", "not on the host"),
    ("F_all 0, Offload 0 saved, Offload 0 saved", "already copying"),
    ("Offload 0 input", "the input a_0 is the caller's"),
    ("Offload 1 saved", "ā_2 is not in memory"),
    ("F_all 0, F_all 1, F_all 2, Loss, B 2, B 1, B 0, Offload 0 saved", "ā_1 is not in memory"),
])
def test_impossible_transfers_name_the_operation(schedule, message):
    with pytest.raises(ScheduleError, match=message) as info:
        simulate(even_chain(), ops(schedule), SLOW)
    one_line(info, "schedule[")


def test_schedule_may_not_end_with_data_away():
    with pytest.raises(ScheduleError, match="still offloaded without Release"):
        simulate(even_chain(), ops("F_all 0, Offload 0 saved"), SLOW)
    with pytest.raises(ScheduleError, match="ends before the backward of stage 0"):
        simulate(even_chain(), ops("F_all 0, Offload 0 saved, F_all 1, Release 0 saved, F_all 2, Loss, B 2, "
                                   "Prefetch 0 saved, B 1"), SLOW)
    with pytest.raises(ScheduleError, match="ends with saved 0 on host"):
        simulate(even_chain(), ops("F_all 0, Offload 0 saved, F_all 1, Release 0 saved, F_all 2, Loss, B 2"), SLOW)


def test_channel_is_required():
    schedule = ops("F_all 0, Offload 0 saved, F_all 1, F_all 2, Release 0 saved, Loss, B 2, Prefetch 0 saved, B 1, B 0")
    with pytest.raises(MemschedError, match="no copy channel"):
        simulate(even_chain(), schedule)
    with pytest.raises(ScheduleError, match="no d2h bandwidth"):
        simulate(even_chain(), schedule, Transfer(0.0, 1e9))
    assert simulate(even_chain(transfer=SLOW), schedule).time == 12.5  # the chain's own channel
    assert simulate(even_chain(), plan_of(schedule, SLOW)).time == 12.5  # the plan's channel


def test_shrunk_saved_activation_goes_back_at_its_own_size():
    """ā_3 is offloaded while the loss makes δ_3: what it releases and brings back is own_saved_bytes."""
    stages = (Stage("a", 1.0, 1.0, 100, 150), Stage("b", 1.0, 1.0, 100, 150, own_saved_bytes=60))
    chain = Chain("shrink", "cpu", 10, stages, Loss())
    schedule = ops("F_all 0, F_all 1, Offload 1 saved, Loss, Release 1 saved, Prefetch 1 saved, B 1, B 0")
    result = simulate(chain, schedule, Transfer(1e3, 1e3))
    assert [c.nbytes for c in result.copies] == [150, 60]
    assert result.timeline[-1].memory_after == simulate(chain, store_all_schedule(2)).timeline[-1].memory_after


def test_simulator_class_is_reusable():
    schedule = ops("F_all 0, Offload 0 saved, F_all 1, F_all 2, Release 0 saved, Loss, B 2, Prefetch 0 saved, B 1, B 0")
    simulator = OffloadSimulator(even_chain(), SLOW, host_weight_stages(schedule))
    assert simulator.run(schedule) == simulator.run(schedule) == simulate(even_chain(), schedule, SLOW)
