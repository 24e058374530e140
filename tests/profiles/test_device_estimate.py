"""An estimate for a target device (``profile_chain(..., device_spec=...)``, ``memsched profile --estimate
--device-spec``): every storage counted as the block the CUDA caching allocator hands out (planner/allocator.py),
the spec's peak FLOP/s as the throughput, its name as the chain's device; bad combinations refused in one line."""

import dataclasses
import json

import pytest
import torch
from torch import nn

import cli
from checks import one_error_line, raises_one_line, run
from planner import fit, load_chain, simulate
from planner.allocator import MIN_BLOCK, allocated_bytes
from planner.devices import DEVICES, DeviceSpec, device_spec
from planner.rates import Rates
from profiles.chain_profiler import profile_chain
from profiles.fake_build import build_fake
from solvers.extremes import store_all_schedule

BATCH = 3001  # odd sizes everywhere; stage 1's output 12 004 000 bytes: a 12 MiB segment handed out whole
H100 = DEVICES["h100-80gb"]
GPT = "gpt-tiny:layers=1,d=36,heads=2,seq=7,vocab=61,batch=3"
STAGE_BYTES = ("out_bytes", "saved_bytes", "fwd_tmp_bytes", "nograd_tmp_bytes", "bwd_tmp_bytes", "param_bytes",
               "own_saved_bytes")
OPTION_BYTES = ("saved_bytes", "own_saved_bytes", "fwd_tmp_bytes", "bwd_tmp_bytes")


def odd_model(dtype=torch.float32):
    return [nn.Linear(7, 13, dtype=dtype), nn.Sequential(nn.Linear(13, 1000, dtype=dtype), nn.Tanh()),
            nn.Linear(1000, 900, dtype=dtype)], torch.randn(BATCH, 7, dtype=dtype)


def estimate(dtype=torch.float32, **options):
    _, (stages, x) = build_fake(lambda: odd_model(dtype))
    return profile_chain(stages, x, estimate=True, warmup=0, repeats=1, name="odd", **options), stages


def sizes(chain) -> list:
    """Every size of the chain: its input, each stage's figures and its options', the loss's."""
    figures = [chain.input_bytes, chain.loss.tmp_bytes, chain.loss.saved_bytes]
    for stage in chain.stages:
        figures += [getattr(stage, field) for field in STAGE_BYTES] + [stage.held_bwd_tmp_bytes or 0]
        figures += [getattr(option, field) for option in stage.options for field in OPTION_BYTES]
    return figures


def test_a_cuda_estimate_counts_the_allocators_blocks():
    plain, stages = estimate()
    rounded, _ = estimate(device_spec=H100)
    assert all(size % MIN_BLOCK == 0 for size in sizes(rounded)), sizes(rounded)
    assert sizes(rounded) != sizes(plain)
    # What the rule predicts, from the unrounded figures: one storage per output, one per parameter.
    assert rounded.input_bytes == allocated_bytes(BATCH * 7 * 4) == 84_480 != plain.input_bytes == 84_028
    assert [s.out_bytes for s in rounded.stages] == [allocated_bytes(s.out_bytes) for s in plain.stages]
    # 156 052 B: 305 blocks of 512; 12 004 000 B: its 12 MiB segment whole (it would leave 578 560 B); 10 803 600 B:
    # 21 101 blocks, split off its 12 MiB segment (it leaves 1 779 200 B, more than 1 MiB).
    assert [s.out_bytes for s in rounded.stages] == [156_160, 12 * 2**20, 10_803_712]
    assert [s.param_bytes for s in rounded.stages] == [
        sum(allocated_bytes(p.untyped_storage().nbytes()) for p in stage.parameters()) for stage in stages]
    assert [s.param_bytes for s in rounded.stages] == [512 + 512, 52_224 + 4_096, 3_600_384 + 4_096]
    for fine, coarse in zip(plain.stages, rounded.stages):
        assert coarse.out_bytes >= fine.out_bytes and coarse.saved_bytes >= fine.saved_bytes
        assert coarse.param_bytes >= fine.param_bytes
    peaks = [simulate(chain, store_all_schedule(chain.length)).peak_bytes for chain in (plain, rounded)]
    assert peaks[1] > peaks[0]


def test_the_spec_gives_the_throughput_of_each_operations_precision_and_the_device_label():
    fp32, _ = estimate(device_spec=H100)
    bf16, _ = estimate(torch.bfloat16, device_spec=H100)
    label = "h100-80gb (estimated at 6.7e+13 FLOP/s (9.9e+14 in 16-bit), 3.35e+12 B/s, 5e-06 s/op at least)"
    assert fp32.device == bf16.device == label
    # the roofline at the spec's peak and memory bandwidth (profiles/roofline.py), each operation at least a kernel
    # launch: an fp32 model's operations at the fp32 peak, a bf16 model's at the tensor cores'
    launched = dict(op_overhead_s=H100.op_overhead_s, overhead_overlaps=True)
    assert fp32.compute_time == estimate(rates=Rates(H100.fp32_flops, H100.memory_bandwidth,
                                                     **launched))[0].compute_time
    assert bf16.compute_time == estimate(torch.bfloat16, rates=Rates(H100.bf16_flops, H100.memory_bandwidth,
                                                                     **launched))[0].compute_time
    assert 2 < fp32.compute_time / bf16.compute_time < H100.bf16_flops / H100.fp32_flops  # (bandwidth, launches)


def test_an_autocast_step_is_timed_at_the_16_bit_peak_where_its_operations_are_16_bit():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=1024, n_head=16, vocab_size=4096, n_positions=512)
    with torch.device("meta"):  # (a width where matmuls, not bandwidth, set the time: sized on fake tensors)
        model = GPT2LMHeadModel(config).train()
    model = model.to_empty(device="cpu")
    ids = torch.zeros(4, 512, dtype=torch.long)
    batch = {"input_ids": ids, "labels": ids}
    timed = {}
    for autocast in (False, torch.bfloat16):
        fitted = fit(model, batch, "auto", device_spec=H100, autocast=autocast, progress=False, stage_options=0)
        timed[autocast] = fitted.chain.compute_time
    # its matmuls cast to bf16 (at 14.8x the fp32 peak); its norms, softmax and pointwise ops fp32 or bandwidth-bound
    assert 2 < timed[False] / timed[torch.bfloat16] < H100.bf16_flops / H100.fp32_flops, timed


def test_a_specs_cost_per_operation_is_in_its_rates_and_its_label():
    slow = dataclasses.replace(H100, name="slow-h100", op_overhead_s=2e-5)
    chain, _ = estimate(device_spec=slow)
    rates = "6.7e+13 FLOP/s (9.9e+14 in 16-bit), 3.35e+12 B/s, 2e-05 s/op at least"
    assert chain.device == f"slow-h100 (estimated at {rates})"
    assert chain.compute_time == estimate(rates=Rates(H100.fp32_flops, H100.memory_bandwidth, 2e-5,
                                                      overhead_overlaps=True))[0].compute_time
    assert chain.compute_time > estimate(device_spec=H100)[0].compute_time
    unlaunched = estimate(device_spec=dataclasses.replace(H100, op_overhead_s=0))[0]
    assert estimate(device_spec=H100)[0].compute_time > unlaunched.compute_time
    assert sizes(chain) == sizes(estimate(device_spec=H100)[0]) == sizes(unlaunched)


def test_this_cpu_as_a_device_has_its_measured_rates_and_counts_storages_as_they_are():
    from profiles.cpu_rates import cpu_device_spec

    cpu = cpu_device_spec(2 << 30, repeats=1)
    assert (cpu.name, cpu.allocator, cpu.memory_bytes) == ("this-cpu", "cpu", 2 << 30)
    assert cpu.bf16_flops == cpu.fp32_flops and cpu.d2h_bandwidth == cpu.h2d_bandwidth == cpu.memory_bandwidth
    assert 1e8 < cpu.fp32_flops < 1e14 and 1e8 < cpu.memory_bandwidth < 1e13 and 0 < cpu.op_overhead_s < 1e-3
    chain, _ = estimate(device_spec=cpu)
    rates = f"{cpu.fp32_flops:.3g} FLOP/s, {cpu.memory_bandwidth:.3g} B/s, {cpu.op_overhead_s:.3g} s/op"
    assert chain.device == f"this-cpu (estimated at {rates})"
    assert sizes(chain) == sizes(estimate()[0])
    assert chain.compute_time == estimate(rates=cpu.rates())[0].compute_time


def test_a_cpu_spec_counts_storages_as_they_are():
    cpu = DeviceSpec("my-cpu", 2**34, 1e12, 1e12, 1e11, 1e10, 1e10, allocator="cpu")
    assert sizes(estimate(device_spec=cpu)[0]) == sizes(estimate()[0])


def test_a_spec_is_for_estimates_alone():
    stages, x = odd_model()
    raises_one_line(profile_chain, stages, x, device_spec=H100)
    _, (stages, x) = build_fake(odd_model)
    message = raises_one_line(profile_chain, stages, x, estimate=True, throughput=1e12, device_spec=H100)
    assert "--throughput" in message and "--device-spec" in message and "not both" in message


def test_profile_estimate_for_a_device_spec(tmp_path, capsys):
    output = tmp_path / "chain.json"
    status, out, err = run(capsys, "profile", GPT, "-o", str(output), "--estimate", "--device-spec", "l4")
    assert status == 0, err
    chain = load_chain(output)
    assert chain.device == "l4 (estimated at 3.03e+13 FLOP/s (1.21e+14 in 16-bit), 3e+11 B/s, 5e-06 s/op at least)"
    assert "on l4 (estimated" in out
    assert any(stage.options for stage in chain.stages)  # the options too (--options 4 by default)
    assert all(size % MIN_BLOCK == 0 for size in sizes(chain)) and chain.input_bytes == 512
    spec = tmp_path / "gpu.json"
    spec.write_text(json.dumps(dict(device_spec("a100-40gb").to_dict(), name="mine", fp32_flops=2e13)))
    assert cli.main(["profile", "mlp:layers=2,width=33,batch=3", "-o", str(output), "--estimate",
                     "--device-spec", str(spec)]) == 0
    mine = "mine (estimated at 2e+13 FLOP/s (3.12e+14 in 16-bit), 1.56e+12 B/s, 5e-06 s/op at least)"
    assert load_chain(output).device == mine


@pytest.mark.parametrize("flags, fragments", [
    pytest.param(["--device-spec", "l4"], ("--device-spec", "give it with --estimate"), id="without-estimate"),
    pytest.param(["--estimate", "--device-spec", "h100"], ("'h100'", "h100-80gb", "memsched.device/1"),
                 id="unknown-name"),
    pytest.param(["--estimate", "--graph", "--device-spec", "l4"], ("--device-spec does not mix with --graph",
                                                                    "fake tensors"), id="graph"),
    pytest.param(["--estimate", "--throughput", "1e12", "--device-spec", "l4"], ("not both",), id="throughput"),
])
def test_profile_refuses_a_device_spec_it_cannot_use(tmp_path, capsys, flags, fragments):
    output = tmp_path / "chain.json"
    one_error_line(*run(capsys, "profile", "mlp:layers=2,width=33,batch=3", "-o", str(output), *flags), *fragments)
    assert not output.exists()


def test_profile_estimate_for_this_cpu_measures_its_rates(tmp_path, capsys):
    output = tmp_path / "chain.json"
    status, out, err = run(capsys, "profile", "mlp:layers=2,width=33,batch=3", "-o", str(output), "--estimate",
                           "--device-spec", "cpu")
    assert status == 0, err
    device = load_chain(output).device
    assert device.startswith("this-cpu (estimated at ") and device.endswith(" s/op)")  # FLOP/s, B/s, s/op measured
