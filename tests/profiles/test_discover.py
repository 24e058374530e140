"""Stage discovery on unmodified models (profiles/discover.py): Hugging Face GPT-2, Llama and BERT from tiny
configs, a ViT-like and a ConvNeXt-like network (tests/discovery_models.py), with no line of glue.

For each model, at the machine's default thread count and at one thread: the chain is discovered and profiled;
rotor's plans at the least feasible budget, halfway and the store-all peak run by the chain executor give the
unmodified model's loss and bit-identical parameter gradients (dropout, stochastic depth and tied embeddings
included) and a measured peak within 1% of the prediction. Then BatchNorm statistics after a recomputing step,
the stage reports, and each failure's one line.
"""

import copy

import pytest
import torch
from torch import nn

from checks import one_line
from discovery_models import MODELS
from planner.errors import MemschedError
from planner.execute.chain import apply_plan
from planner.execute.live_memory import LiveMemoryTracker
from profiles.chain_profiler import profile_chain
from profiles.discover import discover, model_loss
from profiles.memory import storage_bytes
from solvers import solve, store_all_peak
from solvers.minimum import minimum_budget

pytest.importorskip("transformers")
SEED = 7
BLOCKS = {"gpt2": 3, "llama": 3, "bert": 3, "vit": 3, "convnext": 5}


def call(model, inputs):
    """The model called as its inputs say: keywords, positional arguments or one tensor."""
    if isinstance(inputs, dict):
        return model(**inputs)
    return model(*inputs) if isinstance(inputs, tuple) else model(inputs)


def plain_grads(model, inputs, loss_fn) -> tuple:
    """``(loss, {name: .grad})`` of one step of the unmodified model at :data:`SEED`, gradients cleared after."""
    torch.manual_seed(SEED)
    loss = (loss_fn or model_loss)(call(model, inputs))
    loss.backward()
    return loss.detach(), taken_grads(model)


def taken_grads(model) -> dict:
    grads = {name: p.grad for name, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = None
    return grads


@pytest.fixture(scope="module", params=sorted(MODELS))
def name(request):
    return request.param


@pytest.fixture
def case(name, threads, per_thread_count):
    """Per model and thread count (profiled at that count): ``(model, discovery, chain, plain loss and
    gradients)``."""
    key = (name, threads)
    if key not in per_thread_count:
        model, inputs, loss_fn = MODELS[name]()
        discovery = discover(model, inputs, loss_fn)
        staged = discovery.staged
        chain = profile_chain(staged.stages, staged.example_inputs, loss_fn=staged.loss_fn, warmup=0, repeats=1)
        per_thread_count[key] = model, discovery, chain, plain_grads(model, inputs, loss_fn)
    return per_thread_count[key]


@pytest.mark.slow
@pytest.mark.parametrize("budget", ["least", "middle", "store-all"])
def test_plans_of_discovered_stages_match_the_model_and_their_prediction(name, threads, budget, case):
    model, discovery, chain, (loss, expected) = case
    staged = discovery.staged
    assert len(staged.stages) >= BLOCKS[name], discovery.describe()
    low, high = minimum_budget(chain), store_all_peak(chain)
    plan = solve(chain, {"least": low, "middle": (low + high) // 2, "store-all": high}[budget], "rotor")
    torch.manual_seed(SEED)
    with LiveMemoryTracker() as tracker:
        got_loss = apply_plan(staged.stages, plan, chain)(*staged.example_inputs)
        got_loss.backward()
    got = taken_grads(model)
    measured = tracker.peak + storage_bytes(list(staged.example_inputs))
    ratio = measured / plan.predicted.peak_bytes
    what = f"{name}, rotor at the {budget} budget, {threads} threads"
    print(f"{what}: {len(staged.stages)} stages, least {low} B, store-all {high} B, predicted "
          f"{plan.predicted.peak_bytes} B, measured {measured} B (ratio {ratio:.4f})")
    assert torch.equal(got_loss.detach(), loss), what
    assert got.keys() == expected.keys()
    different = [key for key in expected if not torch.equal(got[key], expected[key])]
    assert not different, (what, different)
    assert abs(ratio - 1) <= 0.01, (what, measured, plan.predicted.peak_bytes, ratio)
    if budget == "least":
        assert plan.recomputed_forwards > 0, what


def test_batchnorm_statistics_are_updated_once_by_a_recomputing_plan():
    model, inputs, _ = MODELS["convnext"]()
    twin = copy.deepcopy(model)
    discovery = discover(model, inputs)
    staged = discovery.staged
    chain = profile_chain(staged.stages, staged.example_inputs, loss_fn=staged.loss_fn, warmup=0, repeats=1)
    plan = solve(chain, minimum_budget(chain), "rotor")
    assert plan.recomputed_forwards > 0
    torch.manual_seed(SEED)
    apply_plan(staged.stages, plan, chain)(*staged.example_inputs).backward()
    torch.manual_seed(SEED)
    call(twin, inputs)["loss"].backward()
    statistics = {name: b for name, b in model.named_buffers()}
    assert any("running_mean" in name for name in statistics)
    for name, buffer in twin.named_buffers():
        assert torch.equal(statistics[name], buffer), name
    written = [m.memsched_written_buffers for _, m in staged.stages if m.memsched_written_buffers]
    assert written, "the stages with BatchNorm list the statistics they write"


def test_tied_embeddings_are_one_parameter_shared_by_the_first_and_last_stages():
    model, inputs, _ = MODELS["gpt2"]()
    staged = discover(model, inputs).staged
    first = {id(p) for p in staged.stages[0][1].parameters()}
    last = {id(p) for p in staged.stages[-1][1].parameters()}
    assert id(model.transformer.wte.weight) in first & last


def test_the_report_names_each_stage_by_its_module_and_the_shared_inputs():
    model, inputs, _ = MODELS["gpt2"]()
    discovery = discover(model, inputs)
    names = [name for name, _ in discovery.staged.stages]
    assert "transformer.h.1[ln_1,attn]" in names and "transformer.h.1[ln_2,mlp]" in names, names
    assert len(set(names)) == len(names)
    lines = discovery.describe()
    assert f"{len(names)} stages discovered" in lines[0] and "from attention_mask" in lines[0], lines[0]
    assert len(lines) == len(names) + 1


def test_max_stages_merges_neighbours_inside_one_block_first():
    model, inputs, _ = MODELS["gpt2"]()
    names = [name for name, _ in discover(model, inputs, max_stages=6).staged.stages]
    assert len(names) == 6 and "transformer.h.0" in names, names


# --------------------------------------------------------------------------------------------------
# What discovery cannot split, in one line each


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        x = self.a(x)
        return self.b(x) if x.sum() > 0 else x


class TwoBranches(nn.Module):
    """Two branches on an input that needs a gradient, multiplied: no single tensor carries the step."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.a(x) * self.b(x)


def test_a_forward_export_cannot_capture_fails_in_one_line_naming_the_models_line():
    """Before (issue 40, item 5): 500+ characters of torch's message, cut mid-word, pointing into torch."""
    with pytest.raises(MemschedError, match="cannot capture the forward with torch.export") as error:
        discover(DataDependent(), torch.randn(2, 4))
    one_line(error, "at test_discover.py:", "(`return self.b(x) if x.sum() > 0 else x`)",
             "a value computed from the batch decides a branch or a shape there", "give the stages by hand")
    assert len(str(error.value)) < 400


def test_a_model_with_no_cut_is_one_stage_with_the_same_loss():
    model, x = TwoBranches(), torch.randn(2, 4, requires_grad=True)
    staged = discover(model, x).staged
    assert len(staged.stages) == 1
    torch.manual_seed(0)
    assert torch.equal(staged.stages[0][1](*staged.example_inputs), call(model, x).mean())


@pytest.mark.parametrize("loss_fn, message", [
    (lambda out: out, "the loss must be a floating-point scalar"),
    (lambda out: torch.ones(()), "does not depend on any parameter"),
])
def test_a_loss_that_cannot_be_trained_fails_in_one_line(loss_fn, message):
    with pytest.raises(MemschedError, match=message):
        discover(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), torch.randn(2, 4), loss_fn)


def test_two_inputs_needing_gradients_fail_in_one_line():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x, y):
            return self.a(x) + y

    x, y = torch.randn(2, 4, requires_grad=True), torch.randn(2, 4, requires_grad=True)
    with pytest.raises(MemschedError, match="2 inputs need gradients"):
        discover(Two(), (x, y))


def test_inputs_other_than_a_tensor_a_tuple_or_a_dict_fail_in_one_line():
    with pytest.raises(MemschedError, match="example inputs must be a tensor, a tuple"):
        discover(nn.Linear(4, 4), 3.0)


def test_an_estimate_discovers_the_same_stages_and_sizes_without_allocating():
    from profiles.fake_build import build_fake

    mode, (model, inputs, _) = build_fake(MODELS["gpt2"])
    estimated = discover(model, inputs).staged
    chain = profile_chain(estimated.stages, estimated.example_inputs, loss_fn=estimated.loss_fn, estimate=True)
    real_model, real_inputs, _ = MODELS["gpt2"]()
    staged = discover(real_model, real_inputs).staged
    real = profile_chain(staged.stages, staged.example_inputs, loss_fn=staged.loss_fn, warmup=0, repeats=1)
    fields = ("out_bytes", "saved_bytes", "fwd_tmp_bytes", "bwd_tmp_bytes", "param_bytes")
    assert [s.name for s in chain.stages] == [s.name for s in real.stages]
    assert [[getattr(s, f) for f in fields] for s in chain.stages] == [[getattr(s, f) for f in fields]
                                                                       for s in real.stages]
    assert chain.input_bytes == real.input_bytes and chain.loss.tmp_bytes == real.loss.tmp_bytes


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
def test_a_decoder_built_in_bf16_is_cut_as_its_fp32_twin(kind):
    """Its residual stream is saved only as the fp32 copy its RMSNorm computes on: no cut was taken between layers,
    and the whole decoder was one stage (issue 39, item 1)."""
    from hf_families import decoder

    stages = {dtype: [name for name, _ in discover(*decoder(kind, dtype)).staged.stages]
              for dtype in (torch.float32, torch.bfloat16)}
    assert stages[torch.bfloat16] == stages[torch.float32]
    assert "model.layers.1[post_attention_layernorm,mlp]" in stages[torch.bfloat16]


def test_a_loss_computed_from_the_labels_data_dependently_is_named_and_the_advice_fits():
    """DeBERTa-v2's classification loss keeps the labelled rows with ``(labels >= 0).nonzero()`` and branches on
    their count: export stops there. The refusal names that line and says to capture the forward without the
    labels; done so (the loss from the output by ``loss_fn``), fit plans and trains the model."""
    transformers = pytest.importorskip("transformers")
    from planner import fit

    config = transformers.DebertaV2Config(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                          intermediate_size=64, max_position_embeddings=32, num_labels=3)
    torch.manual_seed(0)
    model = transformers.DebertaV2ForSequenceClassification(config)
    batch = {"input_ids": torch.randint(0, 64, (4, 16)), "labels": torch.tensor([0, 2, 1, 0])}
    with pytest.raises(MemschedError) as error:
        fit(model, batch, "60%", warmup=0, repeats=1, progress=False)
    one_line(error, "at modeling_deberta_v2.py:", "label", "decides a branch or a shape",
             "capture the forward without the labels", "loss_fn=")
    labels = batch.pop("labels")
    fitted = fit(model, batch, "60%", loss_fn=lambda out: torch.nn.functional.cross_entropy(out.logits, labels),
                 returns="loss", warmup=0, repeats=1, progress=False)
    fitted(**batch).backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
