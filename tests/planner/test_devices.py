"""A target device as data (planner/devices.py): the built-in specs by name, a ``memsched.device/1`` file, and every
bad name, file or figure refused in one line naming the field and the fix."""

import dataclasses
import json
import math

import pytest

from checks import raises_one_line
from planner.devices import DEVICE_FORMAT, DEVICES, LAUNCH_S, DeviceSpec, device_spec, load_device_spec
from planner.rates import Rates
from planner.transfer import Transfer

GIB = 2**30
GOOD = {"format": DEVICE_FORMAT, "name": "my-gpu", "memory_bytes": "24GiB", "bf16_flops": 1.2e14, "fp32_flops": 3e13,
        "memory_bandwidth": "300GB/s", "d2h_bandwidth": 25e9, "h2d_bandwidth": "25GB/s", "allocator": "cuda",
        "source": "my measurements"}


def test_built_in_devices_by_name_with_data_sheet_figures():
    assert {"h100-80gb", "h100-pcie-80gb", "a100-80gb", "a100-40gb", "l4", "rtx-4090"} <= set(DEVICES)
    h100 = device_spec("h100-80gb")
    assert h100 == device_spec("H100-80GB")  # names are case-blind
    assert (h100.memory_bytes, h100.bf16_flops, h100.fp32_flops) == (80 * GIB, 989.5e12, 67e12)
    assert (h100.memory_bandwidth, h100.d2h_bandwidth, h100.h2d_bandwidth) == (3.35e12, 64e9, 64e9)
    assert device_spec("a100-40gb").memory_bytes == 40 * GIB and device_spec("a100-80gb").bf16_flops == 312e12
    assert h100.transfer() == Transfer(64e9, 64e9, 0.0)
    for name, spec in DEVICES.items():
        assert spec.name == name and spec.allocator == "cuda"
        assert "data sheet" in spec.source or "whitepaper" in spec.source
        assert spec.source and spec.memory_bytes >= 16 * GIB and spec.bf16_flops > spec.fp32_flops > 1e13
        assert spec.rates() == Rates(spec.fp32_flops, spec.memory_bandwidth, LAUNCH_S, spec.bf16_flops, True)
        assert 1e11 < spec.memory_bandwidth < 1e13 and spec.d2h_bandwidth == spec.h2d_bandwidth <= 64e9
        assert spec.op_overhead_s == LAUNCH_S == 5e-6 and "Holistic Trace Analysis" in spec.source  # (cited)


def test_a_device_file_round_trips(tmp_path):
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(GOOD))
    spec = device_spec(str(path))
    assert spec == DeviceSpec("my-gpu", 24 * GIB, 1.2e14, 3e13, 3e11, 25e9, 25e9, "cuda", "my measurements")
    again = tmp_path / "again.json"
    again.write_text(json.dumps(spec.to_dict()))
    assert load_device_spec(again) == spec
    cpu = dict(GOOD, allocator="cpu", memory_bytes=2**34)
    del cpu["source"]
    path.write_text(json.dumps(cpu))
    assert device_spec(path).allocator == "cpu" and device_spec(path).memory_bytes == 2**34


def test_a_cost_per_operation_is_optional_and_goes_into_the_rates(tmp_path):
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(dict(GOOD, op_overhead_s=5e-6)))
    spec = device_spec(path)
    assert spec.op_overhead_s == 5e-6
    assert spec.rates() == Rates(3e13, 3e11, 5e-6, 1.2e14, overhead_overlaps=True)  # a CUDA device: a floor
    # each operation takes the longer of its launch and its kernel on a CUDA device; a CPU's dispatch adds
    assert spec.rates().seconds(0, 3e11 * 1e-6) == 5e-6 and spec.rates().seconds(0, 3e11 * 1e-5) == 1e-5
    cpu = dataclasses.replace(spec, allocator="cpu")
    assert cpu.rates().seconds(0, 3e11 * 1e-6) == pytest.approx(6e-6)
    again = tmp_path / "again.json"
    again.write_text(json.dumps(spec.to_dict()))
    assert load_device_spec(again) == spec and spec.to_dict()["op_overhead_s"] == 5e-6
    path.write_text(json.dumps(GOOD))  # left out: none
    assert device_spec(path).op_overhead_s == 0 and device_spec(path).rates() == Rates(3e13, 3e11, 0, 1.2e14, True)


def test_a_cuda_device_states_its_compute_capability_and_the_workspace_it_holds(tmp_path, monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    expected = {"h100-80gb": "9.0", "h100-pcie-80gb": "9.0", "h200-141gb": "9.0", "a100-80gb": "8.0",
                "a100-40gb": "8.0", "l4": "8.9", "rtx-4090": "8.9"}
    assert {name: spec.compute_capability for name, spec in DEVICES.items()} == expected
    h100, l4 = DEVICES["h100-80gb"], DEVICES["l4"]
    assert h100.step_memory_bytes() == 80 * GIB - 2 * (32 << 20)  # two threads' 32 MiB cuBLAS workspaces
    assert l4.step_memory_bytes() == 24 * GIB - 2 * 8519680 and l4.step_memory_bytes(GIB) == GIB - 2 * 8519680
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # the deterministic setting: 128 KiB
    assert h100.step_memory_bytes() == 80 * GIB - 2 * (128 << 10)
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(dict(GOOD, compute_capability="8.6")))
    spec = device_spec(path)
    assert spec.compute_capability == "8.6" and spec.blas_workspace().held == 2 * (128 << 10)
    again = tmp_path / "again.json"
    again.write_text(json.dumps(spec.to_dict()))
    assert load_device_spec(again) == spec
    path.write_text(json.dumps(GOOD))  # left out: the workspace is not counted, and the file stays as it was
    unknown = device_spec(path)
    assert unknown.compute_capability is None and unknown.step_memory_bytes() == unknown.memory_bytes
    assert "compute_capability" not in unknown.to_dict()


def test_an_unknown_name_lists_the_known_ones():
    message = raises_one_line(device_spec, "h100")
    assert "'h100'" in message and "docs/formats.md" in message and DEVICE_FORMAT in message
    assert all(name in message for name in DEVICES)


@pytest.mark.parametrize("text, fragments", [
    pytest.param("{not json", ("not valid JSON",), id="not-json"),
    pytest.param("[1, 2]", ("expected a JSON object",), id="a-list"),
    pytest.param(json.dumps(dict(GOOD, format="memsched.chain/1")), ("expected 'memsched.device/1'",), id="format"),
    pytest.param(json.dumps({k: v for k, v in GOOD.items() if k != "format"}), ("missing field 'format'",),
                 id="no-format"),
    pytest.param(json.dumps({k: v for k, v in GOOD.items() if k != "fp32_flops"}), ("missing field 'fp32_flops'",),
                 id="missing-field"),
    pytest.param(json.dumps(dict(GOOD, memory=1)), ("unknown field 'memory'", "memory_bytes"), id="typo"),
])
def test_a_malformed_file_is_refused(tmp_path, text, fragments):
    path = tmp_path / "bad.json"
    path.write_text(text)
    message = raises_one_line(device_spec, str(path))
    assert all(fragment in message for fragment in fragments), message


@pytest.mark.parametrize("field, value, fragments", [
    pytest.param("memory_bytes", 0, ("memory_bytes", "below 1 MiB", "80GiB is 85899345920"), id="memory-zero"),
    pytest.param("memory_bytes", -1, ("memory_bytes", ">= 0"), id="memory-negative"),
    pytest.param("memory_bytes", 1000, ("memory_bytes", "below 1 MiB"), id="memory-1000-bytes"),
    pytest.param("memory_bytes", "lots", ("memory_bytes", "cannot read 'lots'", "4GiB"), id="memory-words"),
    pytest.param("memory_bytes", True, ("memory_bytes", "whole number of bytes"), id="memory-bool"),
    pytest.param("memory_bytes", 1.5e9 + 0.5, ("memory_bytes", "whole number of bytes"), id="memory-fraction"),
    pytest.param("memory_bytes", None, ("memory_bytes", "whole number of bytes"), id="memory-null"),
    pytest.param("memory_bytes", 2**61, ("memory_bytes", "1 EiB"), id="memory-beyond-an-exbibyte"),
    pytest.param("bf16_flops", 0, ("bf16_flops", "FLOP/s from 1000"), id="bf16-zero"),
    pytest.param("fp32_flops", -3e13, ("fp32_flops", "positive number of FLOP/s"), id="fp32-negative"),
    pytest.param("fp32_flops", "67 TFLOPS", ("fp32_flops", "a number of FLOP/s", "9.895e14"), id="fp32-string"),
    pytest.param("bf16_flops", math.nan, ("bf16_flops",), id="bf16-nan"),
    pytest.param("memory_bandwidth", 0, ("memory_bandwidth", "bytes per second", "leave it out"), id="bandwidth-zero"),
    pytest.param("d2h_bandwidth", -1e9, ("d2h_bandwidth", "bytes per second"), id="d2h-negative"),
    pytest.param("h2d_bandwidth", "fast", ("h2d_bandwidth", "cannot read 'fast'", "16GB/s"), id="h2d-words"),
    pytest.param("op_overhead_s", -1e-6, ("op_overhead_s", ">= 0 seconds"), id="overhead-negative"),
    pytest.param("op_overhead_s", "5us", ("op_overhead_s", "seconds per operation", "5e-06"), id="overhead-words"),
    pytest.param("op_overhead_s", 2, ("op_overhead_s", "no device's", "5e-06"), id="overhead-seconds"),
    pytest.param("op_overhead_s", math.inf, ("op_overhead_s", "finite"), id="overhead-infinite"),
    pytest.param("op_overhead_s", None, ("op_overhead_s", "number of seconds"), id="overhead-null"),
    pytest.param("allocator", "rocm", ("allocator", '"cuda"', '"cpu"', "'rocm'"), id="allocator"),
    pytest.param("compute_capability", 9.0, ("compute_capability", '"MAJOR.MINOR"', '"9.0"'), id="capability-number"),
    pytest.param("compute_capability", "nine", ("compute_capability", "nvidia-smi", "'nine'"), id="capability-words"),
    pytest.param("compute_capability", "9", ("compute_capability", '"MAJOR.MINOR"'), id="capability-major-only"),
    pytest.param("compute_capability", "0.0", ("compute_capability", '"MAJOR.MINOR"'), id="capability-zero"),
    pytest.param("name", "  ", ("name is empty", "h100-80gb"), id="name-empty"),
    pytest.param("name", 7, ("name must be a string",), id="name-number"),
])
def test_nonsense_figures_are_refused_naming_the_field(tmp_path, field, value, fragments):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(dict(GOOD, **{field: value})))
    message = raises_one_line(device_spec, str(path))
    assert message.startswith(f"{path}: {field}") or f"{path}: {field}" in message, message
    assert all(fragment in message for fragment in fragments), message


def test_a_cpu_device_has_no_compute_capability(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(dict(GOOD, allocator="cpu", compute_capability="9.0")))
    message = raises_one_line(device_spec, str(path))
    assert message.startswith(f"{path}: compute_capability is a CUDA device's") and "leave it out" in message
