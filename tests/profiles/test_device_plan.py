"""Planning for a device this machine does not have (profiles/device_plan.py, ``memsched plan SPEC --device-spec``):
the model estimated on fake tensors for the target, solved within what the device leaves, the optimizer step
timed, and ``--batch auto`` keeping the micro-batch of most samples per second."""

import dataclasses
import json
import os
import re

import pytest

from checks import one_error_line, raises_one_line, run
from planner.devices import DEVICES, DeviceSpec
from planner.setup import TrainingSetup
from planner.setup.account import activation_budget
from planner.setup.training import device_sizes, parameters_of, resident_on_device
from planner.units import describe_bytes
from profiles.device_plan import best, plan_for_device, target_device, update_seconds
from profiles.estimate import estimate_chain
from solvers.budgets import least_device_memory

MLP = "mlp:layers=3,width=256"
# A device of 24 MiB: room for a few micro-batches of the MLP, not for 64.
SMALL = DeviceSpec("small", 24 << 20, 2e12, 1e12, 1e11, 1e10, 1e10, "cuda", "made up for the tests")


def test_batch_auto_tries_doubling_micro_batches_until_one_does_not_fit_and_keeps_the_fastest():
    tried = plan_for_device(MLP, SMALL, "auto")
    batches = [c.batch for c in tried]
    assert batches == [2 ** k for k in range(len(batches))] and len(batches) >= 3
    assert all(c.plan is not None for c in tried[:-1]) and tried[-1].plan is None  # it stopped at the first misfit
    rates = [c.samples_per_second for c in tried[:-1]]
    assert not any(b < 1.01 * a and c < 1.01 * b for a, b, c in zip(rates, rates[1:], rates[2:]))  # not flat yet
    last = tried[-1]
    least = least_device_memory(last.estimate.chain, TrainingSetup())
    assert last.why == f"needs {describe_bytes(least)} of device memory"
    for c in tried[:-1]:
        chain = c.estimate.chain
        assert c.peak <= SMALL.memory_bytes and c.accumulate == 1
        assert c.seconds == pytest.approx(c.plan.predicted.time + update_seconds(chain, TrainingSetup(), SMALL))
        assert c.samples_per_second == pytest.approx(c.batch / c.seconds)
        assert dict(chain.measured_on.inputs)["0"].shape[0] == c.batch  # estimated at that batch
    chosen, most = best(tried), max(rates)  # the smallest micro-batch within 1% of the most samples per second
    assert chosen.samples_per_second >= 0.99 * most
    assert all(c.samples_per_second < 0.99 * most for c in tried if c.plan is not None and c.batch < chosen.batch)


def test_batch_auto_stops_once_two_doublings_gain_under_one_percent_each():
    tried = plan_for_device(MLP, DeviceSpec("big", 64 << 30, 2e12, 1e12, 1e11, 1e10, 1e10), "auto")
    rates = [c.samples_per_second for c in tried]
    assert all(c.plan is not None for c in tried) and tried[-1].batch < 1 << 16
    assert rates[-1] < 1.01 * rates[-2] and rates[-2] < 1.01 * rates[-3]
    assert not any(b < 1.01 * a and c < 1.01 * b for a, b, c in zip(rates, rates[1:-1], rates[2:-1]))


def test_a_global_batch_is_accumulated_over_the_micro_batches():
    tried = plan_for_device(MLP, SMALL, "auto", global_batch=8)
    assert [(c.batch, c.accumulate) for c in tried if c.plan is not None][:4] == [(1, 8), (2, 4), (4, 2), (8, 1)]
    for c in tried:
        if c.plan is not None:
            update = update_seconds(c.estimate.chain, TrainingSetup(accumulate=c.accumulate), SMALL)
            assert c.seconds == pytest.approx(c.accumulate * c.plan.predicted.time + update)
            assert c.plan.accumulate == c.accumulate
    raises_one_line(plan_for_device, MLP, SMALL, 3, global_batch=8)  # not a multiple


def test_an_update_reads_and_writes_the_state_over_the_memory_bandwidth():
    chain = estimate_chain(MLP, 2).chain
    sizes = device_sizes(chain, TrainingSetup())  # fp32 Adam: 4 + 4 + 8 bytes per parameter, no master copy
    moved = 2 * (sizes["params"] + sizes["optimizer"]) + sizes["grads"]
    assert moved == 28 * sizes["params"] // 4
    assert update_seconds(chain, TrainingSetup(), SMALL) == moved / SMALL.memory_bandwidth


def test_a_model_that_does_not_fit_at_a_micro_batch_of_one_is_one_line():
    tiny = DeviceSpec("tiny", 2 << 20, 1e12, 1e12, 1e11, 1e10, 1e10)
    message = raises_one_line(plan_for_device, MLP, tiny, "auto")
    assert "does not fit tiny at a micro-batch of 1" in message and "of device memory" in message


def test_a_step_budget_caps_each_micro_batch_below_what_the_device_leaves(capsys):
    roomy, capped = plan_for_device(MLP, SMALL, "auto"), plan_for_device(MLP, SMALL, "auto", budget="4MiB")
    assert all(c.plan.budget_bytes == 4 << 20 >= c.plan.predicted.peak_bytes for c in capped[:-1])
    assert capped[-1].plan is None and "below the minimum feasible" in capped[-1].why
    assert [c.batch for c in capped] < [c.batch for c in roomy]  # it stopped at a smaller micro-batch
    above = plan_for_device(MLP, SMALL, "auto", budget="1GiB")  # more than the device leaves: what it leaves
    assert [(c.batch, c.plan and c.plan.budget_bytes) for c in above] == [(c.batch, c.plan and c.plan.budget_bytes)
                                                                         for c in roomy]
    status, out, err = run(capsys, "plan", MLP, "--device-spec", "l4", "--batch", "64", "--budget", "auto")
    assert status == 0, err
    status, capped_out, err = run(capsys, "plan", MLP, "--device-spec", "l4", "--batch", "1024", "--budget", "6MiB")
    assert status == 0, err
    assert "rotor" in capped_out.split("chosen")[0].splitlines()[-1]  # 6 MiB does not store a batch of 1024


def test_memsched_plan_prints_the_table_and_the_fastest(capsys, tmp_path):
    spec = tmp_path / "small.json"
    spec.write_text(json.dumps(SMALL.to_dict()))
    status, out, err = run(capsys, "plan", MLP, "--device-spec", str(spec), "--batch", "auto")
    assert status == 0, err
    tried = plan_for_device(MLP, SMALL, "auto")
    chosen = best(tried)
    assert "target     small: 25165824 bytes (24.0 MiB)" in out and "times are estimates" in out
    assert f"chosen     micro-batch {chosen.batch} x 1: peak {chosen.peak} bytes" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in [[str(c.batch)] for c in tried]]
    assert [int(row[0]) for row in rows] == [c.batch for c in tried]
    assert any(line.split()[:1] == [str(tried[-1].batch)] and "does not fit: needs" in line
               for line in out.splitlines())
    status, out, err = run(capsys, "memory", MLP, "--device-spec", "l4", "--batch", "4")  # the old name, one batch
    assert status == 0, err
    assert "chosen     micro-batch 4 x 1" in out


def test_memsched_plan_for_this_cpu_measures_its_rates(capsys):
    status, out, err = run(capsys, "plan", MLP, "--device-spec", "cpu", "--device-memory", "24MiB", "--batch", "4")
    assert status == 0, err
    target = next(line for line in out.splitlines() if line.startswith("target"))
    assert target.startswith("target     this-cpu: 25165824 bytes (24.0 MiB), ") and " s/op; times are" in target
    assert "chosen     micro-batch 4 x 1" in out
    # the device is here: the chosen plan trained on it, measured beside the prediction
    measured = next(line for line in out.splitlines() if line.startswith("measured"))
    assert measured.startswith("measured   on this CPU, micro-batch 4 x 1, 3 steps: step peak ")
    ratio = float(re.search(r"predicted \d+ bytes \([^)]*\) \(([\d.]+)\)", measured).group(1))  # peak's
    assert abs(ratio - 1) < 0.01, measured
    status, out, err = run(capsys, "plan", MLP, "--device-spec", "l4", "--batch", "4")  # not here: estimated only
    assert status == 0, err
    assert "measured   on" not in out


def test_the_cpu_target_has_the_machines_memory_unless_told_and_other_names_are_the_specs():
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert target_device("CPU").memory_bytes == physical and target_device("cpu", 1 << 30).memory_bytes == 1 << 30
    assert target_device("l4") == DEVICES["l4"]


@pytest.mark.parametrize("argv, words", [
    (["plan", MLP, "--batch", "auto"], ["--batch auto", "--device-spec"]),
    (["plan", MLP, "--global-batch", "8"], ["--global-batch", "--device-spec"]),
    (["plan", "examples/example-L24.chain.json", "--device-spec", "l4"], ["--device-spec builds a SPEC"]),
    (["plan", MLP, "--device-spec", "tpu-v9"], ["no such device", "h100-80gb"]),
    (["plan", MLP, "--batch", "many"], ["--batch"]),
    (["plan", MLP, "--budget", "4MiB"], ["--budget 4MiB", "--device-spec"]),
    (["plan", MLP, "--device-spec", "l4", "--budget", "4 parsecs"], ["--budget", "'parsecs'"]),
])
def test_plan_refusals_are_one_line(capsys, argv, words):
    line = one_error_line(*run(capsys, *argv))
    assert all(word in line for word in words), line


def test_a_cuda_device_leaves_the_step_its_memory_less_the_cublas_workspaces(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    held = 2 * 8519680  # two threads' default workspaces on compute capability 8.9, each split off a 20 MiB segment
    ada = DeviceSpec("ada", 256 << 20, 2e12, 1e12, 1e11, 1e10, 1e10, "cuda", "made up", compute_capability="8.9")
    unknown = dataclasses.replace(ada, compute_capability=None)  # the same spec, its architecture not given
    outs = {}
    for spec in (ada, unknown):
        path = tmp_path / f"{spec.compute_capability}.json"
        path.write_text(json.dumps(spec.to_dict()))
        status, outs[spec.compute_capability], err = run(capsys, "plan", MLP, "--device-spec", path, "--batch", "4")
        assert status == 0, err
    lines = {key: [line for line in out.splitlines() if line.startswith(("workspace", "budget", "chosen"))]
             for key, out in outs.items()}
    assert lines["8.9"][0].startswith(f"workspace  cuBLAS {describe_bytes(held)} held from the first matmul: 2 x ")
    assert lines[None][0].startswith("workspace  cuBLAS's not counted: the device spec gives no compute_capability")
    budgets = {key: int(re.search(r"^budget +(\d+) bytes", "\n".join(found), re.M).group(1))
               for key, found in lines.items()}
    assert budgets[None] - budgets["8.9"] == held
    chain = plan_for_device(MLP, ada, 4)[0].estimate.chain
    assert budgets[None] == activation_budget(chain, TrainingSetup(), ada.memory_bytes)
    with_, without = plan_for_device(MLP, ada, 4)[0], plan_for_device(MLP, unknown, 4)[0]
    assert with_.peak - without.peak == held  # the predicted device peak counts them
    assert f"peak {with_.peak} bytes" in lines["8.9"][-1]
    # a device with room for the step and less than the workspaces beside it: it fits only when they are not counted
    tight = dataclasses.replace(ada, memory_bytes=least_device_memory(chain, TrainingSetup()) + (1 << 20))
    assert plan_for_device(MLP, dataclasses.replace(tight, compute_capability=None), 4)[0].plan is not None
    message = raises_one_line(plan_for_device, MLP, tight, 4)
    least = least_device_memory(chain, TrainingSetup()) + held
    assert "does not fit ada at a micro-batch of 4" in message and f"needs {describe_bytes(least)}" in message


BF16_MODEL = '''
import torch


def build():
    torch.manual_seed(0)
    layers = [torch.nn.Linear(256, 256) for _ in range(4)] + [torch.nn.Linear(256, 8)]
    model = torch.nn.Sequential(*[part for layer in layers for part in (layer, torch.nn.GELU())][:-1])
    return model.to(torch.bfloat16), torch.randn(16, 256, dtype=torch.bfloat16)
'''


def test_a_model_built_in_bf16_is_counted_at_its_parameters_in_every_figure(capsys, tmp_path):
    """Its gradients are 2 bytes a parameter: counted as fp32 ones (param_bytes / 4) it had half its parameters, so
    the floor and the chosen peak held half the resident state the breakdown printed (issue 39, item 2)."""
    (tmp_path / "bf16_model.py").write_text(BF16_MODEL)
    parameters = 4 * (256 * 256 + 256) + 256 * 8 + 8
    spec = f"{tmp_path / 'bf16_model.py'}:build"
    status, out, err = run(capsys, "plan", spec, "--device-spec", "h100-80gb", "--precision", "bf16")
    assert status == 0, err
    assert f"{parameters} trainable parameters" in out
    # The chain's count: its gradients on a CUDA target, each rounded up to the allocator's 512-byte blocks.
    chain = estimate_chain(spec, device_spec=DEVICES["h100-80gb"]).chain
    counted = parameters_of(chain)
    assert parameters <= counted < 1.01 * parameters
    assert f"param_bytes count {counted} parameters" in out
    resident = resident_on_device(chain, TrainingSetup(precision="bf16"))
    assert resident == 14 * counted  # bf16 weights, fp32 master, Adam's 2 moments
    assert re.search(rf"^resident +{resident} ", out, re.M)  # the table's line is the floor's resident state
    least = int(re.search(r"least feasible (\d+) bytes", out).group(1))
    assert f"floor      {resident + least} bytes" in out
    peak = int(re.search(r"^chosen .* peak (\d+) bytes", out, re.M).group(1))
    assert peak >= resident + least
