"""``--estimate`` on a model whose initialisation fake tensors cannot run: ``torch.nn.init.trunc_normal_``
(every ViT and ConvNeXt) draws until every value lies within its bounds, a data-dependent loop that raises
``DataDependentOutputException`` under ``FakeTensorMode``. The estimate builds such a model for real and fakes
its tensors (profiles.fake_build.build_fake); its sizes must equal the measured profile's to the byte, at
the machine's thread count and at one thread."""

import pytest
import torch

import cli
from planner import load_chain
from profiles.fake_build import build_fake
from profiles.spec import load_model

QUICK = ["--warmup", "0", "--repeats", "1"]
BYTES = ("out_bytes", "saved_bytes", "own_saved_bytes", "fwd_tmp_bytes", "nograd_tmp_bytes", "bwd_tmp_bytes",
         "param_bytes")

# A tiny ViT initialised as timm and torchvision do.
VIT = '''
import torch
from torch import nn


class Embed(nn.Module):
    def __init__(self, d, patch, tokens):
        super().__init__()
        self.proj = nn.Conv2d(3, d, patch, stride=patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, d))
        self.pos = nn.Parameter(torch.zeros(1, tokens + 1, d))
        nn.init.trunc_normal_(self.pos, std=0.02)
        nn.init.trunc_normal_(self.cls, std=0.02)

    def forward(self, images):
        x = self.proj(images).flatten(2).transpose(1, 2)
        return torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        for module in self.mlp:
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.02)
                nn.init.zeros_(module.bias)

    def forward(self, x):
        y = self.norm1(x)
        x = x + self.attn(y, y, y, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class Head(nn.Module):
    def __init__(self, d, classes):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(d), nn.Linear(d, classes)
        nn.init.trunc_normal_(self.fc.weight, std=0.02)

    def forward(self, x):
        return self.fc(self.norm(x)[:, 0])


def build(batch=2):
    torch.manual_seed(0)
    d, heads, image, patch, classes = 32, 2, 16, 4, 10
    stages = [("embed", Embed(d, patch, (image // patch) ** 2)), ("block0", Block(d, heads)),
              ("block1", Block(d, heads)), ("head", Head(d, classes))]
    images = torch.randn(batch, 3, image, image)
    labels = torch.randint(0, classes, (batch,))
    return stages, images, lambda logits: nn.functional.cross_entropy(logits, labels)
'''


@pytest.fixture(scope="module")
def vit(tmp_path_factory):
    path = tmp_path_factory.mktemp("estimate_init") / "vit.py"
    path.write_text(VIT)
    return f"{path}:build"



def sizes(chain):
    return (chain.input_bytes, chain.loss.tmp_bytes,
            [(s.name, *(getattr(s, field) for field in BYTES)) for s in chain.stages])


def test_fake_tensors_cannot_build_it():
    """The case the fallback exists for (if a later torch builds it on fake tensors, build_fake's first try does)."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

    with pytest.raises(DataDependentOutputException), FakeTensorMode(allow_non_fake_inputs=True):
        torch.nn.init.trunc_normal_(torch.empty(4, 4), std=0.02)


def test_built_for_real_then_faked(vit):
    from torch._subclasses.fake_tensor import FakeTensor

    model, mode = load_model(vit, estimate=True)
    tensors = [t for _, m in model.stages for t in (*m.parameters(), *m.buffers())] + list(model.example_inputs)
    assert all(isinstance(t, FakeTensor) and t.fake_mode is mode for t in tensors)
    assert all(isinstance(p, torch.nn.Parameter) and p.requires_grad for _, m in model.stages for p in m.parameters())
    real, _ = load_model(vit)
    shapes = [[(n, p.shape, p.dtype) for n, p in m.named_parameters()] for _, m in real.stages]
    assert shapes == [[(n, p.shape, p.dtype) for n, p in m.named_parameters()] for _, m in model.stages]


def test_tied_parameters_stay_tied():
    def factory():
        first, second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        second.weight = first.weight
        torch.nn.init.trunc_normal_(first.weight)
        return [first, second], torch.randn(2, 4)

    _, (stages, inputs) = build_fake(factory)
    assert stages[0].weight is stages[1].weight and stages[0].bias is not stages[1].bias


def test_estimate_sizes_equal_the_measured_ones_to_the_byte(vit, tmp_path, capsys, threads):
    measured, estimated = tmp_path / "measured.json", tmp_path / "estimated.json"
    assert cli.main(["profile", vit, "-o", str(measured), *QUICK]) == 0
    assert cli.main(["profile", vit, "-o", str(estimated), "--estimate", *QUICK]) == 0, capsys.readouterr().err
    measured, estimated = load_chain(measured), load_chain(estimated)
    assert sizes(estimated) == sizes(measured)
    assert "estimated at" in estimated.device


def test_memory_of_the_model(vit, capsys):
    assert cli.main(["memory", vit, "--device-memory", "1GiB"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    model, _ = load_model(vit)
    count = sum(p.numel() for _, m in model.stages for p in m.parameters())
    assert f"{count} trainable parameters" in out and "fits without recomputation" in out
