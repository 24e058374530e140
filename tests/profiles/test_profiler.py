"""The profiler: measured chains predict a real step's memory, are deterministic, and estimates match them."""

import pytest
import torch

from planner import simulate
from planner.execute.live_memory import LiveMemoryTracker
from profiles.chain_profiler import profile_chain
from profiles.fake_build import build_fake
from profiles.memory import storage_bytes
from profiles.reference_step import measured_peak
from profiles.spec import load_model
from profiles.zoo import build
from solvers.extremes import store_all_schedule

QUICK = {"warmup": 0, "repeats": 1}
SIZES = {
    "mlp": ["mlp", "mlp:layers=12,width=384,batch=32"],  # activations dominate, then parameters
    "gpt-tiny": ["gpt-tiny", "gpt-tiny:layers=3,d=192,heads=6,seq=48,batch=4"],
    "resnet-tiny": ["resnet-tiny", "resnet-tiny:blocks=3,channels=48,size=24,batch=8"],
}
SPECS = [spec for specs in SIZES.values() for spec in specs]
DEFAULT_THREADS = torch.get_num_threads()  # what the module's profiles are measured at


def profile(model, **options):
    return profile_chain(model.stages, model.example_inputs, loss_fn=model.loss_fn, name=model.name, **QUICK, **options)


def sizes(chain):
    return ([(s.out_bytes, s.saved_bytes, s.fwd_tmp_bytes, s.bwd_tmp_bytes, s.param_bytes) for s in chain.stages],
            chain.input_bytes, chain.loss.tmp_bytes, chain.loss.saved_bytes)


@pytest.fixture(scope="module")
def profiles():
    """Each spec's model and its measured chain, profiled once for the module."""
    built = {}
    for spec in SPECS:
        model, _ = load_model(spec)
        built[spec] = (model, profile(model))
    return built


@pytest.mark.parametrize("spec", SPECS)
def test_store_all_peak_predicts_a_real_step_within_3_percent(profiles, spec, threads):
    """At the default thread count (the module's profiles) and at one thread, each profiled at its count."""
    model, chain = profiles[spec]
    if threads != DEFAULT_THREADS:
        model, _ = load_model(spec)
        chain = profile(model)
    predicted = simulate(chain, store_all_schedule(chain.length)).peak_bytes
    measured = measured_peak(model)
    assert abs(predicted / measured - 1) <= 0.03, (predicted, measured)


@pytest.mark.parametrize("spec", SPECS)
def test_profiles_are_deterministic_to_the_byte(profiles, spec):
    _, chain = profiles[spec]
    again, _ = load_model(spec)
    assert sizes(profile(again)) == sizes(chain)


@pytest.mark.parametrize("spec", SIZES)
def test_estimates_equal_measurements_to_the_byte(profiles, spec):
    _, chain = profiles[spec]
    fake_model, _ = load_model(spec, estimate=True)
    estimate = profile(fake_model, estimate=True, throughput=1e12)
    assert sizes(estimate) == sizes(chain)
    assert "estimated at 1e+12 FLOP/s" in estimate.device
    # FLOPs / throughput: a lookup (the embedding) counts no FLOPs, matrix products do.
    assert all(s.fwd_time >= 0 and s.bwd_time >= 0 for s in estimate.stages)
    assert max(s.fwd_time for s in estimate.stages) > 0 and estimate.compute_time > 0


@pytest.mark.parametrize("spec", SIZES)
def test_loss_saved_bytes_are_what_its_forward_leaves(profiles, spec):
    """Cross-entropy leaves its log-softmax (the logits' size, saved for its backward) and two scalars (the loss
    and the total weight); a pipeline's last stage holds them from its forward to its backward."""
    _, chain = profiles[spec]
    assert chain.loss.saved_bytes == chain.stages[-1].out_bytes + 8
    assert chain.loss.saved_bytes <= chain.loss.tmp_bytes + chain.stages[-1].out_bytes


def test_stage_names_and_parameter_bytes_come_from_the_model(profiles):
    model, chain = profiles["gpt-tiny"]
    assert [s.name for s in chain.stages] == [name for name, _ in model.stages]
    for (_, module), stage in zip(model.stages, chain.stages):
        assert stage.param_bytes == sum(p.numel() * p.element_size() for p in module.parameters())
        assert stage.saved_bytes >= stage.out_bytes > 0


def test_a_non_sequential_model_with_a_mask_argument():
    model, _ = load_model("tests/fixtures/masked_model.py:build")
    chain = profile(model)
    assert [s.name for s in chain.stages] == [name for name, _ in model.stages]
    ids, mask = model.example_inputs
    assert chain.input_bytes == storage_bytes([ids, mask])
    predicted = simulate(chain, store_all_schedule(chain.length)).peak_bytes
    assert predicted >= measured_peak(model)  # conservative (see docs/execution.md, known limits)
    fake_model, _ = load_model("tests/fixtures/masked_model.py:build", estimate=True)
    assert sizes(profile(fake_model, estimate=True)) == sizes(chain)


class TwoOutputs(torch.nn.Module):
    """A stage returning a tuple, then a dict: outputs are passed as-is to the next stage."""

    def __init__(self, width, kind):
        super().__init__()
        self.linear, self.kind = torch.nn.Linear(width, width), kind

    def forward(self, x):
        if isinstance(x, dict):
            x = x["a"] + x["b"]
        elif isinstance(x, tuple):
            x = x[0] * x[1]
        y = self.linear(x)
        return (y, y.relu()) if self.kind == "tuple" else {"a": y, "b": y.tanh()} if self.kind == "dict" else y


@pytest.mark.parametrize("container", ["sequential", "list", "pairs", "dict"])
def test_stage_containers_and_structured_outputs(container):
    torch.manual_seed(0)
    modules = [TwoOutputs(16, "tuple"), TwoOutputs(16, "dict"), TwoOutputs(16, "plain")]
    stages = {
        "sequential": torch.nn.Sequential(*modules),
        "list": modules,
        "pairs": [(f"s{k}", m) for k, m in enumerate(modules)],
        "dict": {f"s{k}": m for k, m in enumerate(modules)},
    }[container]
    chain = profile_chain(stages, torch.randn(4, 16), **QUICK)
    assert chain.stages[0].out_bytes == 2 * 4 * 16 * 4  # two distinct outputs
    assert chain.stages[2].out_bytes == 4 * 16 * 4
    assert [s.name for s in chain.stages] == (["0", "1", "2"] if container == "sequential" else
                                              ["stage0", "stage1", "stage2"] if container == "list" else
                                              ["s0", "s1", "s2"])


def test_profiling_leaves_the_model_as_it_was():
    model = build("resnet-tiny", blocks=1, batch=4)
    buffers = [b.clone() for _, m in model.stages for b in m.buffers()]
    for _, module in model.stages:
        for parameter in module.parameters():
            parameter.grad = None
    rng = torch.get_rng_state()
    profile(model)
    assert all(torch.equal(a, b) for a, b in zip(buffers, [b for _, m in model.stages for b in m.buffers()]))
    assert all(p.grad is None for _, m in model.stages for p in m.parameters())
    assert torch.equal(rng, torch.get_rng_state())


def test_a_shared_parameter_belongs_to_its_last_stage():
    shared = torch.nn.Linear(8, 8)
    chain = profile_chain([shared, torch.nn.ReLU(), shared], torch.randn(2, 8), **QUICK)
    assert [s.param_bytes for s in chain.stages] == [0, 0, (64 + 8) * 4]


def test_tracker_counts_allocations_not_views():
    weight = torch.randn(64, 64)
    with LiveMemoryTracker() as tracker:
        view = weight.t()  # an alias: no allocation
        assert tracker.current == 0
        product = weight @ view
        assert tracker.current == 64 * 64 * 4
        del product
        assert tracker.current == 0
        assert tracker.peak == 64 * 64 * 4


def test_estimate_needs_fake_tensors():
    from planner import MemschedError

    with pytest.raises(MemschedError, match="FakeTensorMode"):
        profile_chain([torch.nn.Linear(2, 2)], torch.randn(1, 2), estimate=True)
    mode, (module, x) = build_fake(lambda: (torch.nn.Linear(2, 2), torch.randn(1, 2)))
    assert profile_chain([module], x, estimate=True, **QUICK).stages[0].out_bytes == 8
