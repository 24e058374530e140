"""`memsched partition` and `memsched show` on pipeline plans."""


from checks import one_error_line, run
from paths import EXAMPLE
from planner import load_chain, load_plan
from planner.simulate import simulate


def test_partition_writes_a_plan_that_show_replays(capsys, tmp_path):
    plan_path = tmp_path / "pipeline.json"
    status, out, err = run(capsys, "partition", EXAMPLE, "--devices", "4", "--micro-batches", "8",
                           "--device-memory", "1GiB", "--bandwidth", "10GB/s", "-o", plan_path)
    assert status == 0, err
    assert "on 4 devices, 1f1b, 8 micro-batches" in out and out.count(" MiB  ") >= 4
    plan = load_plan(plan_path)
    assert plan.kind == "pipeline" and len(plan.pipeline.devices) == 4
    result = simulate(load_chain(EXAMPLE), plan)
    assert (result.time, result.peak_bytes) == (plan.predicted.time, plan.predicted.peak_bytes)
    assert result.peak_bytes <= 2**30
    status, out, err = run(capsys, "show", plan_path, "--chain", EXAMPLE)
    assert status == 0, err
    assert "simulated  peak" in out and "note" not in out
    # the breakdown of each device's peak: resident state + buffers + the step's peak
    header = next(line for line in out.splitlines() if "resident" in line).split()
    assert header == ["device", "resident", "buffers", "gradients", "held/micro", "in", "flight", "step", "peak",
                      "peak"]
    for device in result.devices:
        assert device.resident_bytes + device.buffer_bytes + device.step_peak == device.peak_bytes
        assert device.step_peak >= device.gradient_bytes + (device.in_flight - 1) * device.micro.held


def test_partition_errors_are_one_line(capsys, tmp_path):
    for argv, message in [
        (["--devices", "2", "--micro-batches", "4"], "give --device-memory"),
        (["--devices", "2", "--micro-batches", "4", "--device-memory", "1MiB"], "smallest device memory"),
        (["--devices", "4", "--micro-batches", "2", "--device-memory", "1GiB"], "micro"),
        (["--devices", "2", "--micro-batches", "4", "--device-memory", "1GiB", "--optimizer", "lion"], "optimizer"),
    ]:
        one_error_line(*run(capsys, "partition", EXAMPLE, *argv), message)
