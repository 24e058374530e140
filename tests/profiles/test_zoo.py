"""The built-in models (profiles.zoo) and the user-style factory fixture: they build, train a step, are
deterministic, and refuse bad names, options and specs with one line."""

import importlib.util

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from checks import raises_one_line
from paths import FIXTURES
from planner.errors import MemschedError
from planner.execute.stages import run_stages
from profiles import zoo

FIXTURE = FIXTURES / "masked_model.py"

SCALED = {
    "mlp": {"layers": 3, "width": 48, "batch": 5},
    "gpt-tiny": {"layers": 2, "d": 48, "heads": 3, "seq": 10, "vocab": 37, "batch": 3, "dropout": 0.0},
    "resnet-tiny": {"blocks": 2, "channels": 8, "size": 9, "classes": 4, "batch": 3},
    "unet-tiny": {"levels": 2, "channels": 4, "size": 8, "classes": 3, "batch": 3, "convs": 2},
}
STAGES = {
    "mlp": lambda o: [f"layer{i}" for i in range(o["layers"])],
    "gpt-tiny": lambda o: ["embed", *(f"block{i}" for i in range(o["layers"])), "head"],
    "resnet-tiny": lambda o: ["stem", *(f"block{i}" for i in range(o["blocks"])), "head"],
    "unet-tiny": lambda o: ["stem", *(f"down{k}" for k in range(o["levels"])), "middle",
                            *(f"up{k}" for k in reversed(range(o["levels"]))), "head"],
}


def train_step(stages, example_inputs, loss_fn):
    loss = loss_fn(run_stages(stages, example_inputs))
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    return loss


def parameters(stages):
    return [(f"{name}.{p}", t) for name, module in stages for p, t in module.named_parameters()]


def load_fixture():
    spec = importlib.util.spec_from_file_location("masked_model_fixture", FIXTURE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("scaled", [False, True], ids=["default", "scaled"])
@pytest.mark.parametrize("name", list(zoo.MODELS))
def test_model_trains_a_step(name, scaled):
    options = SCALED[name] if scaled else {}
    model = zoo.build(name, **options)
    resolved = {**zoo.defaults(name), **options}
    assert model.name == name and model.options == resolved
    assert [s for s, _ in model.stages] == STAGES[name](resolved)
    assert all(m.training for _, m in model.stages)
    assert model.example_inputs[0].shape[0] == resolved["batch"]
    params = parameters(model.stages)
    assert params and all(t.dtype == torch.float32 for _, t in params)
    train_step(model.stages, model.example_inputs, model.loss_fn)
    for pname, t in params:
        assert t.grad is not None, f"{name}: {pname} got no gradient"
        assert torch.isfinite(t.grad).all(), f"{name}: {pname} has a non-finite gradient"


def test_stage_outputs_have_the_expected_shapes():
    o = SCALED["gpt-tiny"]
    gpt = zoo.build("gpt-tiny", **o)
    assert gpt.example_inputs[0].dtype == torch.int64
    assert run_stages(gpt.stages, gpt.example_inputs).shape == (o["batch"], o["seq"], o["vocab"])
    o = SCALED["resnet-tiny"]
    net = zoo.build("resnet-tiny", **o)
    assert net.example_inputs[0].shape == (o["batch"], 3, o["size"], o["size"])
    assert run_stages(net.stages[:1], net.example_inputs).shape == (o["batch"], o["channels"], o["size"], o["size"])
    assert run_stages(net.stages, net.example_inputs).shape == (o["batch"], o["classes"])


def test_unet_convs_per_level():
    """``convs`` Conv3x3 + ReLU layers in every down, middle and up stage; ``convs=1`` is the default model."""
    base = {k: v for k, v in SCALED["unet-tiny"].items() if k != "convs"}
    default, one = zoo.build("unet-tiny", **base), zoo.build("unet-tiny", convs=1, **base)
    for (_, a), (_, b) in zip(default.stages, one.stages, strict=True):
        da, db = a.state_dict(), b.state_dict()
        assert da.keys() == db.keys() and all(torch.equal(da[k], db[k]) for k in da)
    net = zoo.build("unet-tiny", convs=3, **base)
    for stage, module in net.stages:
        convs = sum(isinstance(m, torch.nn.Conv2d) for m in module.modules())
        assert convs == (1 if stage in ("stem", "head") else 3), stage
    out = run_stages(net.stages, net.example_inputs)
    assert out.shape == (base["batch"], base["classes"], base["size"], base["size"])


def test_gpt_attention_is_causal_and_mask_not_persistent():
    gpt = zoo.build("gpt-tiny", **SCALED["gpt-tiny"])  # dropout 0: deterministic outputs
    ids = gpt.example_inputs[0]
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % SCALED["gpt-tiny"]["vocab"]
    with torch.no_grad():
        before, after = run_stages(gpt.stages, (ids,)), run_stages(gpt.stages, (changed,))
    assert torch.equal(before[:, :-1], after[:, :-1])  # earlier positions do not see the last token
    assert not torch.equal(before[:, -1], after[:, -1])
    block = gpt.stages[1][1]
    assert "attn.future" not in block.state_dict() and "attn.future" in dict(block.named_buffers())


@pytest.mark.parametrize("name", list(zoo.MODELS))
def test_builds_are_deterministic_and_leave_global_rng_alone(name):
    options = SCALED[name]
    torch.manual_seed(123)
    state = torch.get_rng_state()
    a = zoo.build(name, **options)
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(456)  # a different global state must not change the build
    b = zoo.build(name, **options)
    for (sa, ma), (sb, mb) in zip(a.stages, b.stages, strict=True):
        assert sa == sb
        da, db = ma.state_dict(), mb.state_dict()
        assert da.keys() == db.keys() and all(torch.equal(da[k], db[k]) for k in da)
    assert len(a.example_inputs) == len(b.example_inputs)
    assert all(torch.equal(x, y) for x, y in zip(a.example_inputs, b.example_inputs))
    torch.manual_seed(0)
    loss_a = train_step(a.stages, a.example_inputs, a.loss_fn)
    torch.manual_seed(0)
    loss_b = train_step(b.stages, b.example_inputs, b.loss_fn)
    assert torch.equal(loss_a, loss_b)  # same targets closed over


def test_direct_builder_calls_match_build_and_validate():
    a, b = zoo.build_mlp(layers=2, width=8, batch=2), zoo.build("mlp", layers=2, width=8, batch=2)
    assert all(torch.equal(x, y) for x, y in zip(a.example_inputs, b.example_inputs))
    with pytest.raises(MemschedError, match="layers"):
        zoo.build_mlp(layers=0)


def test_unknown_model_lists_the_models():
    message = raises_one_line(zoo.build, "gpt-huge")
    assert "gpt-huge" in message and all(n in message for n in zoo.MODELS)


def test_unknown_option_lists_options_with_defaults():
    message = raises_one_line(zoo.build, "gpt-tiny", layer=12)
    assert "'layer'" in message
    assert "layers=4, d=128, heads=4, seq=64, vocab=512, batch=8, dropout=0.1" in message
    message = raises_one_line(zoo.build, "mlp", depth=3)
    assert "'depth'" in message and "layers=32, width=128, batch=2048" in message
    message = raises_one_line(zoo.build, "resnet-tiny", width=3)
    assert "blocks=4, channels=32, size=32, classes=10, batch=16" in message
    message = raises_one_line(zoo.build, "unet-tiny", depth=3)
    assert "'depth'" in message and "levels=2, channels=8, size=16, classes=4, batch=4, convs=1" in message


@pytest.mark.parametrize("spec, option", [
    ("mlp:layers=abc", "layers"), ("mlp:layers=0", "layers"), ("mlp:layers=-2", "layers"),
    ("mlp:width=2.5", "width"), ("gpt-tiny:dropout=1", "dropout"), ("gpt-tiny:dropout=-0.1", "dropout"),
    ("gpt-tiny:dropout=x", "dropout"), ("gpt-tiny:d=130", "d=130"), ("resnet-tiny:batch=0", "batch"),
    ("unet-tiny:convs=0", "convs"), ("unet-tiny:convs=1.5", "convs"), ("unet-tiny:size=10", "size=10"),
])
def test_bad_values_name_the_option(spec, option):
    name, options = zoo.parse_spec(spec)
    message = raises_one_line(zoo.build, name, **options)
    assert option in message and "valid options:" in message and name in message


@pytest.mark.parametrize("value", [True, 3.0, float("nan"), None, "4"])
def test_bad_value_types(value):
    assert "layers" in raises_one_line(zoo.build, "mlp", layers=value)
    assert "dropout" in raises_one_line(zoo.build, "gpt-tiny", dropout=value)


def test_float_option_accepts_integers():
    assert zoo.build("gpt-tiny", dropout=0, layers=1, d=8, heads=2, seq=4, vocab=7, batch=1).options["dropout"] == 0.0


def test_parse_spec():
    assert zoo.parse_spec("gpt-tiny:layers=12,d=512") == ("gpt-tiny", {"layers": 12, "d": 512})
    assert zoo.parse_spec("mlp") == ("mlp", {})
    assert zoo.parse_spec(" gpt-tiny : dropout=0.25 , layers = 2 ") == ("gpt-tiny", {"dropout": 0.25, "layers": 2})
    name, options = zoo.parse_spec("gpt-tiny:dropout=1e-1,layers=+3,seq=abc")
    assert options == {"dropout": 0.1, "layers": 3, "seq": "abc"}
    assert type(options["layers"]) is int and type(options["dropout"]) is float
    assert zoo.parse_spec("x:a=.5")[1] == {"a": 0.5}


@pytest.mark.parametrize("spec", [
    "", ":layers=2", "mlp:", "mlp:layers", "mlp:layers=", "mlp:=3", "mlp:layers=2,", "mlp:layers=2,,width=3",
    "mlp:layers=2,layers=3", "mlp:1x=2", "mlp:la yers=2", "mlp\nlayers=2", "m lp",
])
def test_malformed_specs(spec):
    message = raises_one_line(zoo.parse_spec, spec)
    assert "malformed model spec" in message


def test_fixture_factory_runs_a_step():
    fixture = load_fixture()
    stages, example_inputs, loss_fn = fixture.build()
    assert [s for s, _ in stages] == ["embed", "block0", "block1", "head"]
    assert not isinstance(stages[1][1], torch.nn.Sequential)
    ids, mask = example_inputs
    assert ids.shape == mask.shape == (4, 16) and mask.dtype == torch.bool and not mask.all()
    params = parameters(stages)
    train_step(stages, example_inputs, loss_fn)
    for pname, t in params:
        assert t.grad is not None and torch.isfinite(t.grad).all(), pname
    stages, (ids, mask), loss_fn = fixture.build(batch=6)  # the --batch hook
    assert ids.shape == mask.shape == (6, 16) and mask.sum(1).tolist() == [16, 13, 8, 1, 16, 13]
    train_step(stages, (ids, mask), loss_fn)


@pytest.mark.parametrize("name", list(zoo.MODELS))
def test_builds_and_steps_under_fake_tensors(name):
    """The profiler's estimate mode builds the models inside a FakeTensorMode: no real data is needed."""
    real = zoo.build(name, **SCALED[name])
    with FakeTensorMode():
        fake = zoo.build(name, **SCALED[name])
        tensors = [t for _, m in fake.stages for t in [*m.parameters(), *m.buffers()]] + list(fake.example_inputs)
        assert all(isinstance(t, FakeTensor) for t in tensors)
        out = run_stages(fake.stages, fake.example_inputs)
        loss = fake.loss_fn(out)
        loss.backward()
        assert loss.shape == () and all(isinstance(p.grad, FakeTensor) for _, p in parameters(fake.stages))
    assert out.shape == run_stages(real.stages, real.example_inputs).shape


def test_fixture_stages_match_the_model_and_the_mask_matters():
    fixture = load_fixture()
    stages, (ids, mask), _ = fixture.build()
    with torch.no_grad():
        chained = run_stages(stages, (ids, mask))
        unmasked = run_stages(stages, (ids, torch.ones_like(mask)))
    padded = mask[1]  # a padded row: its real positions see other keys with and without the mask
    assert not mask[1].all() and mask[0].all()
    assert not torch.allclose(chained[1][padded], unmasked[1][padded])
    assert torch.allclose(chained[0], unmasked[0])  # the unpadded row is unaffected
    # Cut into stages, the encoder computes what the whole module computes.
    weights = {f"embed.{k}" if k == "weight" else k: v for k, v in stages[0][1].embed.state_dict().items()}
    weights["pos"] = stages[0][1].pos
    for i, (_, block) in enumerate(stages[1:-1]):
        weights.update({f"blocks.{i}.{k}": v for k, v in block.state_dict().items()})
    weights.update({f"head.{k}": v for k, v in stages[-1][1].head.state_dict().items()})
    whole = fixture.TinyEncoder()
    whole.load_state_dict(weights)
    with torch.no_grad():
        assert torch.allclose(whole(ids, mask), chained)
