"""The roofline time model: FLOPs as FlopCounterMode counts them, the bytes an operation moves, seconds as the
larger of compute and memory time plus a cost per operation, used by estimate profiles; and this CPU's rates."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from planner.errors import MemschedError
from planner.execute.stages import default_loss, run_stages
from planner.rates import Rates
from profiles.chain_profiler import profile_chain
from profiles.cpu_rates import measure_cpu_rates
from profiles.roofline import roofline
from profiles.spec import load_model

N = 1000
FREE = Rates(1e21)  # FLOPs at a zettaflop: seconds next to nothing


def test_flops_equal_flop_counter_modes_on_small_models():
    """A whole step (forward, loss, backward) under the estimate's FakeTensorMode: matrix products, convolutions
    and their backward, counted as FlopCounterMode counts them."""
    for spec in ["mlp:layers=3,width=16,batch=8", "gpt-tiny:layers=1,d=32,seq=8,batch=2",
                 "resnet-tiny:blocks=1,channels=8,size=8,batch=2"]:
        model, mode = load_model(spec, estimate=True)

        def step():
            (model.loss_fn or default_loss)(run_stages(model.stages, model.example_inputs)).backward()

        with mode:
            with FlopCounterMode(display=False) as counter:
                step()
            tally = roofline(step, FREE)
        assert tally.flops == counter.get_total_flops() > 0, spec


def test_cpu_fused_attention_counts_the_attention_formula():
    """FlopCounterMode has no formula for CPU's fused attention (it counts 0); the roofline applies the registry's:
    two batched products of ``b*h`` ``(s, d) x (d, s)`` and ``(s, s) x (s, d)``, three more products' worth backward."""
    b, h, s, d = 2, 4, 8, 16
    q, k, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))
    forward = roofline(lambda: F.scaled_dot_product_attention(q, k, v), FREE)
    assert forward.flops == 2 * (2 * b * h * s * s * d)
    out = F.scaled_dot_product_attention(q, k, v)
    backward = roofline(lambda: out.sum().backward(), FREE)
    assert backward.flops == 5 * (2 * b * h * s * s * d)


def test_bytes_of_known_operations():
    a, b = torch.randn(N), torch.randn(N)
    assert roofline(lambda: a + b, FREE)[1:3] == (3 * 4 * N, 1)  # two read, one written; one operation
    assert roofline(lambda: a.add_(b), FREE)[1:3] == (3 * 4 * N, 1)  # in place: its argument written
    assert roofline(lambda: a.view(10, 100).t().reshape(-1, 10)[2:], FREE)[1:3] == (0, 0)  # views: free
    assert roofline(lambda: torch.empty(N), FREE)[1:3] == (0, 1)  # allocated, nothing written
    row = torch.randn(1, N)
    assert roofline(lambda: row.expand(7, N) * 2.0, FREE)[1] == 4 * N + 7 * 4 * N  # the storage read once
    table, ids = torch.randn(500, 8), torch.tensor([1, 2, 3])
    looked_up = 3 * 8 * 4
    assert roofline(lambda: F.embedding(ids, table), FREE)[1] == looked_up + 3 * 8 + looked_up  # rows, ids, out
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 7]]), torch.ones(2, 8), (500, 8), check_invariants=True)
    assert roofline(lambda: sparse * 2.0, FREE)[1] == 2 * (2 * 8 + 2 * 8 * 4)  # indices and values, read and written


def test_seconds_are_the_larger_of_compute_and_memory_plus_the_overhead():
    rates = Rates(flops_per_s=1e9, bytes_per_s=1e8, op_overhead_s=1e-3)
    assert rates.seconds(2e9, 1e8) == pytest.approx(2.0 + 1e-3)  # compute-bound
    assert rates.seconds(1e6, 5e8) == pytest.approx(5.0 + 1e-3)  # memory-bound
    assert Rates(1e9).seconds(1e9, 1e30) == pytest.approx(1.0)  # no bandwidth: FLOPs alone
    n = 64
    a, b = torch.randn(n, n), torch.randn(n, n)
    tally = roofline(lambda: a @ b, rates)  # 2 n^3 FLOPs, 3 * 4 n^2 bytes: memory-bound at these rates
    assert (tally.flops, tally.bytes_moved, tally.ops) == (2 * n ** 3, 3 * 4 * n * n, 1)
    assert tally.seconds == pytest.approx(max(2 * n ** 3 / 1e9, 3 * 4 * n * n / 1e8) + 1e-3)
    total = roofline(lambda: (a @ b, a + b), rates)
    assert total.seconds == pytest.approx(tally.seconds + 3 * 4 * n * n / 1e8 + 1e-3)  # summed per operation


def test_estimate_profiles_time_each_stage_by_the_roofline():
    rates = Rates(flops_per_s=1e9, bytes_per_s=1e8, op_overhead_s=1e-4)
    model, mode = load_model("mlp:layers=3,width=16,batch=8", estimate=True)
    chain = profile_chain(model.stages, model.example_inputs, loss_fn=model.loss_fn, estimate=True, warmup=0,
                          repeats=1, rates=rates)
    assert "estimated at 1e+09 FLOP/s, 1e+08 B/s, 0.0001 s/op" in chain.device
    activation = model.example_inputs[0]
    with mode, torch.no_grad():
        for (_, module), stage in zip(model.stages, chain.stages):
            tally = roofline(lambda: module(activation), rates)
            assert stage.fwd_time == pytest.approx(tally.seconds) and tally.ops >= 2  # the product and the ReLU
            activation = module(activation)
    flops_only = profile_chain(model.stages, model.example_inputs, loss_fn=model.loss_fn, estimate=True, warmup=0,
                               repeats=1, rates=Rates(1e9))
    assert flops_only.compute_time < chain.compute_time


def test_rates_and_throughput_are_not_both_given():
    model, _ = load_model("mlp:layers=2,width=8,batch=4", estimate=True)
    with pytest.raises(MemschedError, match="throughput or its rates"):
        profile_chain(model.stages, model.example_inputs, estimate=True, throughput=1e9, rates=Rates(1e9))


@pytest.mark.parametrize("field, rates", [
    ("rates.flops_per_s", dict(flops_per_s=-1.0)),
    ("rates.bytes_per_s", dict(flops_per_s=1e9, bytes_per_s=float("nan"))),
    ("rates.op_overhead_s", dict(flops_per_s=1e9, op_overhead_s=-1e-6)),
    ("rates.op_overhead_s", dict(flops_per_s=1e9, op_overhead_s=float("inf"))),
])
def test_bad_rates_name_their_field(field, rates):
    with pytest.raises(MemschedError, match=field.replace(".", r"\.")):
        Rates(**rates)


def test_cpu_rates_are_measured_at_the_thread_count_asked():
    before = torch.get_num_threads()
    rates = measure_cpu_rates(threads=1, repeats=1)
    assert torch.get_num_threads() == before
    assert 1e8 < rates.flops_per_s < 1e13 and 1e8 < rates.bytes_per_s < 1e13 and 0 < rates.op_overhead_s < 1e-2
