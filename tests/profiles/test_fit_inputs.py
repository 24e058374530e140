"""Inputs a fuzz of ``fit``, ``DeviceSpec`` and the command line found raising tracebacks, accepted, or hanging
(issue 40, item 6): each is now one line naming the field and its range."""

import pytest
import torch
from torch import nn

from checks import one_error_line, raises_one_line, run
from planner import fit
from planner.devices import DeviceSpec, device_spec
from planner.setup import TrainingSetup

NET, X = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)), torch.randn(8, 4)
SPEC = dict(name="gpu", memory_bytes=1 << 30, bf16_flops=1e12, fp32_flops=1e12, memory_bandwidth=1e10,
            d2h_bandwidth=1e9, h2d_bandwidth=1e9)


@pytest.mark.parametrize("name", ["x" * 300, "/tmp/" + "y" * 300 + ".json", "a\0b"])
def test_a_device_name_no_file_can_have_is_no_such_device(name, capsys):
    assert "no such device and no such file" in raises_one_line(device_spec, name)  # (was OSError: too long)
    one_error_line(*run(capsys, "plan", "mlp", "--device-spec", name[:4000]), "no such device")


@pytest.mark.parametrize("fields, words", [
    (dict(allocator="tpu"), ["allocator", "cuda", "cpu", "'tpu'"]),
    (dict(compute_capability="x.y"), ["compute_capability", "MAJOR.MINOR"]),
    (dict(memory_bytes=-1), ["memory_bytes"]),
    (dict(fp32_flops="fast"), ["fp32_flops", "number"]),
    (dict(op_overhead_s=2.0), ["op_overhead_s", "seconds"]),
    (dict(name=""), ["name", "non-empty"]),
])
def test_a_device_spec_built_directly_is_checked_as_a_files_is(fields, words):
    message = raises_one_line(DeviceSpec, **dict(SPEC, **fields))  # (was accepted)
    assert all(word in message for word in words), message


@pytest.mark.parametrize("keywords, words", [
    (dict(warmup=-1), ["fit warmup", "from 0 to 100000", "-1"]),
    (dict(repeats=10**9), ["fit repeats", "from 1 to 100000"]),  # (was a hang of minutes)
    (dict(stage_options=-1), ["fit stage_options", "from 0 to 100000"]),
    (dict(batch=10**12, device_spec="h100-80gb", budget="auto"), ["fit batch", "from 1 to 65536"]),  # (traceback)
])
def test_fits_numbers_are_refused_in_one_line_out_of_their_range(keywords, words):
    budget = keywords.pop("budget", "90%")
    message = raises_one_line(fit, NET, X, budget, progress=False, **keywords)
    assert all(word in message for word in words), message


def test_a_model_that_is_no_module_is_one_line():
    assert "fit model: a torch.nn.Module" in raises_one_line(fit, lambda x: x, X, "90%")  # (was AttributeError)


def test_a_data_parallel_degree_no_job_has_is_one_line(capsys):
    assert "from 1 to 262144" in raises_one_line(TrainingSetup, zero=1, dp=10**9)  # (was a hang)
    one_error_line(*run(capsys, "plan", "mlp", "--device-memory", "1GiB", "--zero", "1", "--dp", "1000000000"),
                   "dp", "from 1 to 262144")
