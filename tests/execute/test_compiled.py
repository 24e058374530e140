"""Plans under torch.compile (issue 16): the profiler's memory meter against the tracker on an eager step, a
hierarchical plan's stage options through compiled code, and ``memsched train --compile``.

Compiling is slow on this machine (tens of seconds for a small model, cold), so the models are tiny. Under
inductor dropout draws other numbers (``fallback_random`` makes it draw eager's), and fused kernels add in
another order: gradients are compared with tolerances.
"""

import pytest
import torch
from test_stage_options import sized_times
from torch import nn
from torch.testing import assert_close

from checks import run
from planner.execute.chain import apply_plan
from planner.execute.compiled_runs import MergedStages
from planner.execute.fusion import merged_runs
from planner.execute.live_memory import LiveMemoryTracker
from planner.ops import chosen_options
from profiles.chain_profiler import profile_chain
from profiles.memory import ProfilerMemoryMeter, storage_bytes
from profiles.zoo import MODELS
from solvers import solve, store_all_peak
from solvers.minimum import minimum_budget


@pytest.fixture(autouse=True, scope="module")
def compiled_code_dropped_after():
    """Compiled code and its caches are let go after this module: the millions of objects they hold would make
    a later test's garbage collections (tests/solvers/test_time_limits.py times solvers to the tenth of a second)
    slow."""
    yield
    import gc

    import torch._dynamo

    torch._dynamo.reset()
    gc.collect()


def gpt():
    return MODELS["gpt-tiny"](layers=1, d=32, heads=2, seq=16, vocab=64, batch=4)


def parameters(model) -> list:
    return [p for _, module in model.stages for p in module.parameters()]


def step(model, forward):
    for p in parameters(model):
        p.grad = None
    torch.manual_seed(0)
    model.loss_fn(forward(*model.example_inputs)).backward()
    return [p.grad.clone() for p in parameters(model)]


def test_profiler_meter_equals_the_tracker_on_an_eager_step():
    model = MODELS["gpt-tiny"](layers=2)

    def plain(*inputs):
        activation = inputs[0]
        for _, module in model.stages:
            activation = module(activation)
        return activation

    step(model, plain)
    for p in parameters(model):
        p.grad = None
    with LiveMemoryTracker() as tracker:
        model.loss_fn(plain(*model.example_inputs)).backward()
    for p in parameters(model):
        p.grad = None
    with ProfilerMemoryMeter() as meter:
        model.loss_fn(plain(*model.example_inputs)).backward()
    print(f"tracker {tracker.peak} B, torch.profiler {meter.peak} B")
    assert abs(meter.peak / tracker.peak - 1) <= 0.001


@pytest.mark.slow
@pytest.mark.compile
def test_a_hierarchical_plan_runs_compiled():
    import torch._inductor.config as inductor_config

    with inductor_config.patch(fallback_random=True):  # (monkeypatch's undo deletes the setting)
        compiled_like_eager()


def plan_merging_an_option(chain):
    """A hierarchical plan (of 11 budgets from the least to the store-all peak, the first) whose schedule runs
    several stages together, one of them with an option (a compiled run with a region inside), and its chain."""
    chain = sized_times(chain)  # times from sizes (tests/execute/test_stage_options.py): the same plans on every run
    low, high = minimum_budget(chain, options=True), store_all_peak(chain)
    for k in range(11):
        plan = solve(chain, low + (high - low) * k // 10, "hierarchical")
        options = chosen_options(plan.schedule)
        if any(first < last and any(first <= stage <= last for stage in options)
               for first, last in merged_runs(plan.schedule, chain.length)):
            return plan, chain
    raise AssertionError("no plan runs an option inside a run of stages")


def compiled_like_eager():
    model = MODELS["gpt-tiny"](layers=2, d=32, heads=2, seq=16, vocab=64, batch=4)
    chain = profile_chain(model.stages, model.example_inputs, loss_fn=model.loss_fn, warmup=0, repeats=1,
                          options=4)
    plan, chain = plan_merging_an_option(chain)
    eager = step(model, apply_plan(model.stages, plan, chain))
    compiled_plan = apply_plan(model.stages, plan, chain, compile=True)
    assert len(compiled_plan.stages) < chain.length  # merged (planner/execute/compiled_runs.py)
    compiled = step(model, compiled_plan)
    for got, expected in zip(compiled, eager):
        assert_close(got, expected, rtol=1e-4, atol=1e-5)
    for p in parameters(model):
        p.grad = None
    with ProfilerMemoryMeter() as meter:
        model.loss_fn(compiled_plan(*model.example_inputs)).backward()
    print(f"compiled: measured {meter.peak} B, the eager plan's prediction {plan.predicted.peak_bytes} B")
    assert 0 < meter.peak <= 1.25 * plan.predicted.peak_bytes
    for p in parameters(model):  # compiled before: under a dispatch mode the plan still runs, as its eager plan
        p.grad = None
    with pytest.warns(UserWarning, match="torch.compile compiles nothing"), LiveMemoryTracker() as tracker:
        model.loss_fn(compiled_plan(*model.example_inputs)).backward()
    measured = tracker.peak + storage_bytes(model.example_inputs)
    assert abs(measured / plan.predicted.peak_bytes - 1) <= 0.01, (measured, plan.predicted)


def gpt2_block():
    """The first block of a Hugging Face GPT-2 (dropout 0) as discovery cuts it, and its input."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from profiles.discover import discover

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=64, n_positions=64, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    ids = torch.randint(0, 64, (4, 64), generator=torch.Generator().manual_seed(1))
    staged = discover(GPT2LMHeadModel(config).train(), {"input_ids": ids, "labels": ids.clone()}).staged
    activation, *extra = staged.example_inputs
    with torch.no_grad():
        activation = staged.stages[0][1](activation, *extra)
    return staged.stages[1][1], activation, extra


@pytest.mark.slow
@pytest.mark.compile
@pytest.mark.parametrize("name", ["gpt-tiny", "gpt2"])
def test_a_compiled_option_keeps_less_than_the_compiled_block(name):
    """The option's values are recomputed inside the compiled backward (the selective tags survive
    compilation, the policy placing the traced operations: no warning, on our block and on Hugging Face's,
    whose traced dropout is spelled otherwise), so its compiled forward keeps less than the compiled plain
    block's, and its gradients are the eager block's."""
    import warnings

    from planner.execute.selective import forward_nodes, run_with_option
    from profiles.options import candidate_recomputes

    if name == "gpt2":
        block, x, extra = gpt2_block()
    else:
        model = MODELS["gpt-tiny"](layers=1, d=64, heads=2, seq=64, vocab=64, batch=4, dropout=0.0)
        with torch.no_grad():
            x = model.stages[0][1](model.example_inputs[0])
        block, extra = model.stages[1][1], []
    recompute = candidate_recomputes(forward_nodes(block, (x.requires_grad_(), *extra)), 4)[-1]

    def eager(t):
        return block(t, *extra)

    plain = torch.compile(eager)

    def measured(forward):
        for p in block.parameters():
            p.grad = None
        with ProfilerMemoryMeter() as meter:
            output = forward(x.detach().requires_grad_())
        sum(t.sum() for t in torch.utils._pytree.tree_flatten(output)[0] if isinstance(t, torch.Tensor)).backward()
        return meter.peak, [p.grad for p in block.parameters()]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        measured(plain), measured(lambda t: run_with_option(block, recompute, t, *extra, compiled=True))  # compiled
        plain_peak, expected = measured(eager)
        compiled_plain_peak, _ = measured(plain)
        option_peak, got = measured(lambda t: run_with_option(block, recompute, t, *extra, compiled=True))
        eager_option_peak, _ = measured(lambda t: run_with_option(block, recompute, t, *extra))
    assert not [w for w in caught if "option under torch.compile" in str(w.message)]
    print(f"forward peaks: eager {plain_peak} B, with the option {eager_option_peak} B; compiled "
          f"{compiled_plain_peak} B, with the option {option_peak} B")
    assert option_peak <= eager_option_peak and option_peak < 0.8 * compiled_plain_peak
    for grad, want in zip(got, expected):
        assert_close(grad, want, rtol=1e-4, atol=1e-5)


def test_the_policy_places_each_traced_operation_in_its_graph_node():
    """Traced operations take their graph node's decision, found among the eager dispatches from the last node
    placed on; one spelled otherwise takes the decision of the node before it, a random one is saved."""
    from torch.utils.checkpoint import CheckpointPolicy

    from planner.execute.compiled_option import _Policy

    save, recompute = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.MUST_RECOMPUTE
    aten = torch.ops.aten

    class Region:
        decisions = [save, recompute, recompute, save]
        spellings = [("aten.t.default", "aten.addmm.default"), ("aten.gelu.default",),
                     ("aten.empty_like.default", "aten.bernoulli_.float", "aten.mul.Tensor"),
                     ("aten.t.default", "aten.addmm.default")]

        def misaligned(self, unplaced, seen):
            raise AssertionError("warned")

    policy = _Policy(Region())
    traced = [aten.t.default, aten.addmm.default, aten.gelu.default, aten.native_dropout.default,
              aten.mul.Tensor, aten.t.default, aten.addmm.default]
    assert [policy(None, op) for op in traced] == [save, save, recompute, save, recompute, save, save]


@pytest.mark.compile
def test_a_merged_run_whose_option_writes_in_place_runs_stage_by_stage():
    """BatchNorm's exported graph writes its statistics in place, so its option cannot be a compiled region: the
    run holding it goes stage by stage, its gradients and statistics those of the eager plan."""
    torch.manual_seed(0)
    stages = [(f"b{i}", nn.Sequential(nn.Linear(64, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, 64)))
              for i in range(4)]
    x = torch.randn(512, 64)
    chain = profile_chain(stages, x, warmup=0, repeats=1, options=4)
    plan, chain = plan_merging_an_option(chain)
    parameters = [p for _, module in stages for p in module.parameters()]
    statistics = [b for _, module in stages for b in module.buffers()]

    def trained(planned):
        before = [b.clone() for b in statistics]
        for p in parameters:
            p.grad = None
        planned(x).mean().backward()
        after = [b.clone() for b in statistics]
        for b, value in zip(statistics, before):
            b.copy_(value)
        return [p.grad.clone() for p in parameters], after

    eager_grads, eager_statistics = trained(apply_plan(stages, plan, chain))
    compiled_plan = apply_plan(stages, plan, chain, compile=True)
    assert len(compiled_plan.stages) < chain.length
    grads, statistics_after = trained(compiled_plan)
    runs = [compiled_plan.compiled_stage(i) for i, module in enumerate(compiled_plan.modules_in_order)
            if isinstance(module, MergedStages)]
    assert any(run.stepwise is not None for run in runs)
    for got, expected in zip(grads + statistics_after, eager_grads + eager_statistics):
        assert_close(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("extra", [["--graph"]])
def test_compile_is_refused_where_it_does_not_run(capsys, extra):
    status, out, err = run(capsys, "train", "mlp:layers=2", "--budget", "60%", "--compile", *extra)
    assert status != 0 and "--compile does not mix with --graph" in out + err


@pytest.mark.compile
def test_train_compile_runs_and_measures(capsys):
    status, out, err = run(capsys, "train", "mlp:layers=4,width=64,batch=256", "--budget", "85%", "--compile",
                           "--steps", "1")
    assert status == 0, out + err
    assert "with the plan" in out and "of predicted" in out


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
                                    for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


@pytest.mark.compile
def test_fit_compile_trains_as_fit_does():
    from planner import fit

    torch.manual_seed(0)
    model = Small()
    x = torch.randn(512, 32)
    eager = fit(model, x, "70%", warmup=0, repeats=1)
    eager(x).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    compiled = fit(model, x, "70%", warmup=0, repeats=1, compile=True)
    compiled(x).backward()
    for p, grad in zip(model.parameters(), expected):
        assert_close(p.grad, grad, rtol=1e-4, atol=1e-5)


@pytest.mark.compile
def test_a_compiled_fit_recomputing_batch_norm_under_autocast_updates_its_statistics_once():
    """A discovered stage writes its BatchNorm statistics as ops of its graph: its recomputation, swapping them out
    (planner/execute/autograd.py), runs eagerly, since compiled code keeps reading the swapped-out tensors (before:
    each recomputation updated them again, ``num_batches_tracked`` counting 2 or 3 per step)."""
    import copy

    from planner import fit

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
                            for _ in range(4)]).train()
    twin, x = copy.deepcopy(model), torch.randn(4, 8, 16, 16)
    fitted = fit(model, x, "60%", autocast=torch.bfloat16, warmup=0, repeats=1, stage_options=0, compile=True,
                 progress=False)
    assert fitted.plan.recomputed_forwards > 0
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, expected = fitted(x), twin(x).float().mean()
        loss.backward()
        expected.backward()
    for (key, value), reference in zip(model.state_dict().items(), twin.state_dict().values()):
        assert_close(value, reference, rtol=1e-4, atol=1e-5, msg=key)  # num_batches_tracked 2, as eager's
    for (key, p), q in zip(model.named_parameters(), twin.parameters()):
        assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-4, msg=key)


@pytest.mark.compile
def test_a_compiled_fit_of_a_convolutional_model_compiles_each_shape_statically():
    """ConvNeXt's stages, compiled in turn with torch's automatic dynamic shapes (a shape seen to change marked
    dynamic), failed in Inductor ("cannot determine truth value of Relational: 1 < 128*((s53//2))"); compiled
    statically (``dynamic=False``: a plan is made for one layout of inputs) they train as the unmodified
    model."""
    import copy

    from discovery_models import MODELS
    from planner import fit

    model, batch, _ = MODELS["convnext"]()
    twin = copy.deepcopy(model)
    fitted = fit(model, batch, "85%", returns="loss", warmup=0, repeats=1, stage_options=0, compile=True,
                 progress=False)  # (recomputing: stages of several shapes through the compiler in turn)
    assert fitted.plan.recomputed_forwards > 0
    torch.manual_seed(0)
    fitted(*batch).backward()
    torch.manual_seed(0)
    twin(*batch)["loss"].backward()
    for (key, p), q in zip(model.named_parameters(), twin.parameters()):
        assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-5, msg=key)
    for (key, value), reference in zip(model.state_dict().items(), twin.state_dict().values()):
        assert_close(value, reference, rtol=1e-4, atol=1e-6, msg=key)


@pytest.mark.slow
def test_a_compiled_plan_measures_its_prediction_under_the_tracker():
    """Issue 38, item 6. Under a TorchDispatchMode (the live-memory tracker) torch.compile compiles nothing: the
    compiled functions' Python ran eagerly, and with it each option's selective checkpoint, whose policy is made
    for traced operations: it kept what the plan drops (this mixer read 1.51 of its prediction, a Llama 1.24) and,
    on an eager dropout (``empty_like``, ``bernoulli_``, ``div_``) in some plans, raised "Tensor cached during
    selective activation checkpoint has been mutated". Now the options run as the eager plan runs them: the first
    and the second step measure the prediction, the gradients are the eager plan's, and one warning says so."""
    import textwrap
    import types
    import warnings

    from test_first_step import MIXER

    mixer = types.ModuleType("mixer")
    exec(textwrap.dedent(MIXER), mixer.__dict__)
    sequential, x = mixer.stages()  # token and channel mixing, each with dropout 0.1
    model = types.SimpleNamespace(stages=[(f"s{i}", m) for i, m in enumerate(sequential)], example_inputs=(x,),
                                  loss_fn=lambda y: y.square().mean())
    chain = profile_chain(model.stages, x, loss_fn=model.loss_fn, warmup=0, repeats=1, options=4)
    plan, chain = plan_merging_an_option(chain)
    expected = step(model, apply_plan(model.stages, plan, chain))
    compiled_plan = apply_plan(model.stages, plan, chain, compile=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        peaks = []
        for _ in range(2):
            for p in parameters(model):
                p.grad = None
            torch.manual_seed(0)
            with LiveMemoryTracker() as tracker:
                model.loss_fn(compiled_plan(*model.example_inputs)).backward()
            peaks.append(tracker.peak + storage_bytes([x]))  # the input, made before, is in the prediction
            for got, want in zip([p.grad for p in parameters(model)], expected):
                assert_close(got, want, rtol=1e-4, atol=1e-5)
    print(f"under the tracker: {peaks} B, predicted {plan.predicted.peak_bytes} B")
    for peak in peaks:
        assert abs(peak / plan.predicted.peak_bytes - 1) <= 0.01
    told = [w for w in caught if "torch.compile compiles nothing" in str(w.message)]
    assert len(told) == 1 and "\n" not in str(told[0].message)
