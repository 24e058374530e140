"""Built-in models for the demo, the tests and the benchmarks, each a :class:`planner.execute.stages.StagedModel`.

Every model is built in train mode, in float32 on the CPU, and deterministically: two builds with the
same options have identical parameters, buffers, inputs and targets (the builders seed a forked RNG and
leave the caller's random state alone). Each builds in well under a second at its default size and is
scaled by keyword options::

    build("gpt-tiny", layers=12, d=512)
    name, options = parse_spec("gpt-tiny:layers=12,d=512")
    build(name, **options)

A mistake (unknown model or option, bad value, malformed spec) raises :class:`MemschedError` with one
line that names it and lists what is valid, with the defaults.
"""

import inspect
import math
import re

import torch
import torch.nn.functional as F
from torch import nn

from planner.errors import MemschedError
from planner.execute.stages import StagedModel

_F32 = {"dtype": torch.float32}


# --------------------------------------------------------------------------------------------------
# Options


def _defaults(builder) -> dict:
    """The keyword options of a builder and their defaults, in signature order."""
    return {p.name: p.default for p in inspect.signature(builder).parameters.values()
            if p.kind is inspect.Parameter.KEYWORD_ONLY}


def _listing(defaults: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in defaults.items())


def _resolve(model: str, builder, options: dict) -> dict:
    """Check ``options`` against the builder's signature; return every option, defaults filled in."""
    defaults = _defaults(builder)
    valid = f"valid options: {_listing(defaults)}"
    for key in options:
        if key not in defaults:
            raise MemschedError(f"{model}: unknown option {key!r}; {valid}")
    resolved = dict(defaults)
    for key, value in options.items():
        default = defaults[key]
        if isinstance(default, int):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise MemschedError(f"{model}: option {key} must be a whole number >= 1, got {value!r}; {valid}")
        else:  # float options: only probabilities so far (dropout)
            if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                    or not 0.0 <= value < 1.0):
                raise MemschedError(f"{model}: option {key} must be a number in [0, 1), got {value!r}; {valid}")
            value = float(value)
        resolved[key] = value
    return resolved


def _fail(model: str, builder, message: str):
    raise MemschedError(f"{model}: {message}; valid options: {_listing(_defaults(builder))}")


# --------------------------------------------------------------------------------------------------
# mlp


def build_mlp(*, layers: int = 32, width: int = 128, batch: int = 2048) -> StagedModel:
    """``layers`` stages ``Linear(width, width) + ReLU``; cross-entropy over ``width`` classes against fixed labels.

    (Not MSE: CPU ``mse_loss`` returns its scalar inside a batch-sized storage that fake tensors do not
    reproduce, so estimates of its memory could not be exact.)
    """
    opts = _resolve("mlp", build_mlp, dict(layers=layers, width=width, batch=batch))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        stages = [(f"layer{i}", nn.Sequential(nn.Linear(width, width, **_F32), nn.ReLU()).train())
                  for i in range(layers)]
        x = torch.randn(batch, width, **_F32)
        labels = torch.randint(0, width, (batch,), dtype=torch.int64)

    def loss_fn(out):
        return F.cross_entropy(out, labels.to(out.device))  # the targets follow the model to its device

    return StagedModel("mlp", stages, (x,), loss_fn, opts)


# --------------------------------------------------------------------------------------------------
# gpt-tiny


class GPTEmbed(nn.Module):
    """Token embedding + learned position embedding + dropout; input int64 ids (batch, seq)."""

    def __init__(self, vocab: int, d: int, seq: int, dropout: float):
        super().__init__()
        self.tok = nn.Embedding(vocab, d, **_F32)
        self.pos = nn.Embedding(seq, d, **_F32)
        self.drop = nn.Dropout(dropout)

    def forward(self, ids):
        # The position rows are a slice of the table: no index tensor is allocated.
        return self.drop(self.tok(ids) + self.pos.weight[: ids.shape[1]])


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention written out by hand (no scaled_dot_product_attention)."""

    def __init__(self, d: int, heads: int, seq: int, dropout: float):
        super().__init__()
        self.heads, self.head_dim = heads, d // heads
        self.q = nn.Linear(d, d, **_F32)
        self.k = nn.Linear(d, d, **_F32)
        self.v = nn.Linear(d, d, **_F32)
        self.proj = nn.Linear(d, d, **_F32)
        self.attn_drop = nn.Dropout(dropout)
        self.resid_drop = nn.Dropout(dropout)
        # True above the diagonal: the future keys each query may not see. Built once, not saved.
        self.register_buffer("future", torch.ones(seq, seq, dtype=torch.bool).triu(1), persistent=False)

    def forward(self, x):
        b, t, d = x.shape
        split = (b, t, self.heads, self.head_dim)
        q = self.q(x).view(split).transpose(1, 2)  # (b, heads, t, head_dim)
        k = self.k(x).view(split).transpose(1, 2)
        v = self.v(x).view(split).transpose(1, 2)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(self.future[:t, :t], float("-inf"))
        weights = self.attn_drop(scores.softmax(dim=-1))
        y = (weights @ v).transpose(1, 2).reshape(b, t, d)
        return self.resid_drop(self.proj(y))


class GPTBlock(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, d: int, heads: int, seq: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(d, **_F32)
        self.attn = CausalSelfAttention(d, heads, seq, dropout)
        self.ln2 = nn.LayerNorm(d, **_F32)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d, **_F32), nn.GELU(), nn.Linear(4 * d, d, **_F32),
                                 nn.Dropout(dropout))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPTHead(nn.Module):
    """Final LayerNorm + Linear(d, vocab), no weight tying; logits (batch, seq, vocab)."""

    def __init__(self, d: int, vocab: int):
        super().__init__()
        self.ln = nn.LayerNorm(d, **_F32)
        self.out = nn.Linear(d, vocab, **_F32)

    def forward(self, x):
        return self.out(self.ln(x))


def build_gpt_tiny(*, layers: int = 4, d: int = 128, heads: int = 4, seq: int = 64, vocab: int = 512,
                   batch: int = 8, dropout: float = 0.1) -> StagedModel:
    """A small GPT: ``embed``, ``block0..``, ``head``; cross-entropy against fixed random next tokens."""
    opts = _resolve("gpt-tiny", build_gpt_tiny, dict(layers=layers, d=d, heads=heads, seq=seq, vocab=vocab,
                                                      batch=batch, dropout=dropout))
    if d % heads:
        _fail("gpt-tiny", build_gpt_tiny, f"option d={d} must be a multiple of heads={heads}")
    dropout = opts["dropout"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        stages = [("embed", GPTEmbed(vocab, d, seq, dropout).train())]
        stages += [(f"block{i}", GPTBlock(d, heads, seq, dropout).train()) for i in range(layers)]
        stages.append(("head", GPTHead(d, vocab).train()))
        ids = torch.randint(0, vocab, (batch, seq), dtype=torch.int64)
        target = torch.randint(0, vocab, (batch * seq,), dtype=torch.int64)

    def loss_fn(logits):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.to(logits.device))

    return StagedModel("gpt-tiny", stages, (ids,), loss_fn, opts)


# --------------------------------------------------------------------------------------------------
# resnet-tiny


def _conv3x3(cin: int, cout: int) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, kernel_size=3, padding=1, bias=False, **_F32)


class ResNetStem(nn.Module):
    """Conv3x3(3 -> channels) + BatchNorm2d + ReLU."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = _conv3x3(3, channels)
        self.bn = nn.BatchNorm2d(channels, **_F32)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)))


class BasicBlock(nn.Module):
    """conv-BN-ReLU-conv-BN, plus the identity, then ReLU (no in-place ops: the input is left intact)."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = _conv3x3(channels, channels)
        self.bn1 = nn.BatchNorm2d(channels, **_F32)
        self.conv2 = _conv3x3(channels, channels)
        self.bn2 = nn.BatchNorm2d(channels, **_F32)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + x)


class ResNetHead(nn.Module):
    """AdaptiveAvgPool2d(1) + Flatten + Linear(channels, classes)."""

    def __init__(self, channels: int, classes: int):
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(channels, classes, **_F32)

    def forward(self, x):
        return self.fc(self.flatten(self.pool(x)))


def build_resnet_tiny(*, blocks: int = 4, channels: int = 32, size: int = 32, classes: int = 10,
                      batch: int = 16) -> StagedModel:
    """A small ResNet on ``size`` x ``size`` RGB images: ``stem``, ``block0..``, ``head``; cross-entropy."""
    opts = _resolve("resnet-tiny", build_resnet_tiny, dict(blocks=blocks, channels=channels, size=size,
                                                            classes=classes, batch=batch))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        stages = [("stem", ResNetStem(channels).train())]
        stages += [(f"block{i}", BasicBlock(channels).train()) for i in range(blocks)]
        stages.append(("head", ResNetHead(channels, classes).train()))
        images = torch.randn(batch, 3, size, size, **_F32)
        labels = torch.randint(0, classes, (batch,), dtype=torch.int64)

    def loss_fn(logits):
        return F.cross_entropy(logits, labels.to(logits.device))

    return StagedModel("resnet-tiny", stages, (images,), loss_fn, opts)


# --------------------------------------------------------------------------------------------------
# unet-tiny


def _conv_block(cin: int, cout: int, convs: int = 1) -> nn.Sequential:
    """``convs`` times Conv3x3 + ReLU (the first ``cin -> cout``, the others ``cout -> cout``), as one flat
    Sequential."""
    layers = []
    for k in range(convs):
        layers += [nn.Conv2d(cin if k == 0 else cout, cout, kernel_size=3, padding=1, **_F32), nn.ReLU()]
    return nn.Sequential(*layers)


class UNetStem(nn.Module):
    """Conv3x3(3 -> channels) + ReLU; returns ``(h,)``, the start of the tuple the stages pass on."""

    def __init__(self, channels: int):
        super().__init__()
        self.block = _conv_block(3, channels)

    def forward(self, x):
        return (self.block(x),)


class UNetDown(nn.Module):
    """``(h, *skips) -> (maxpool(y), y, *skips)`` with ``y = conv_block(h)``: ``y`` is a long skip to the decoder."""

    def __init__(self, cin: int, cout: int, convs: int = 1):
        super().__init__()
        self.block = _conv_block(cin, cout, convs)

    def forward(self, state):
        h, *skips = state
        y = self.block(h)
        return (F.max_pool2d(y, 2), y, *skips)


class UNetMiddle(nn.Module):
    """The bottleneck: ``(h, *skips) -> (conv_block(h), *skips)``."""

    def __init__(self, channels: int, convs: int = 1):
        super().__init__()
        self.block = _conv_block(channels, channels, convs)

    def forward(self, state):
        h, *skips = state
        return (self.block(h), *skips)


class UNetUp(nn.Module):
    """``(h, skip, *skips) -> (conv_block(cat(upsample(h), skip)), *skips)``: nearest-neighbour x2 upsampling."""

    def __init__(self, cin: int, cskip: int, cout: int, convs: int = 1):
        super().__init__()
        self.block = _conv_block(cin + cskip, cout, convs)

    def forward(self, state):
        h, skip, *skips = state
        return (self.block(torch.cat([F.interpolate(h, scale_factor=2.0, mode="nearest"), skip], dim=1)), *skips)


class UNetHead(nn.Module):
    """Conv1x1(channels -> classes): per-pixel logits (batch, classes, size, size)."""

    def __init__(self, channels: int, classes: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, classes, kernel_size=1, **_F32)

    def forward(self, state):
        (h,) = state
        return self.conv(h)


def build_unet_tiny(*, levels: int = 2, channels: int = 8, size: int = 16, classes: int = 4,
                    batch: int = 4, convs: int = 1) -> StagedModel:
    """A small U-Net with long skips: ``stem``, ``down0..``, ``middle``, ``up..0``, ``head``; per-pixel cross-entropy.

    Level k works at ``size / 2**k`` with ``channels * 2**k`` channels; ``down k`` hands its full-resolution
    output to ``up k`` across every deeper stage (the stages pass a tuple ``(h, *skips)``), so the skips
    of the first levels live from the start of the forward to the end of the backward's decoder part.
    Each ``down``, the ``middle`` and each ``up`` stage runs ``convs`` Conv3x3 + ReLU layers (the original
    U-Net has two): with more, the activations inside the levels outweigh the skips and the single
    full-resolution decoder computation, so recomputation can save a larger share of the memory.
    ``size`` must be a multiple of ``2**levels``.
    """
    opts = _resolve("unet-tiny", build_unet_tiny, dict(levels=levels, channels=channels, size=size,
                                                        classes=classes, batch=batch, convs=convs))
    if size % (2 ** levels):
        _fail("unet-tiny", build_unet_tiny, f"option size={size} must be a multiple of 2**levels={2 ** levels}")
    widths = [channels * 2 ** k for k in range(levels)]  # level k's channels
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        stages = [("stem", UNetStem(channels).train())]
        stages += [(f"down{k}", UNetDown(widths[max(k - 1, 0)], widths[k], convs).train()) for k in range(levels)]
        stages.append(("middle", UNetMiddle(widths[levels - 1], convs).train()))
        stages += [(f"up{k}", UNetUp(widths[min(k + 1, levels - 1)], widths[k], widths[k], convs).train())
                   for k in reversed(range(levels))]
        stages.append(("head", UNetHead(channels, classes).train()))
        images = torch.randn(batch, 3, size, size, **_F32)
        labels = torch.randint(0, classes, (batch, size, size), dtype=torch.int64)

    def loss_fn(logits):
        return F.cross_entropy(logits, labels.to(logits.device))

    return StagedModel("unet-tiny", stages, (images,), loss_fn, opts)


# --------------------------------------------------------------------------------------------------
# Registry and specs

MODELS = {"mlp": build_mlp, "gpt-tiny": build_gpt_tiny, "resnet-tiny": build_resnet_tiny,
          "unet-tiny": build_unet_tiny}


def defaults(name: str) -> dict:
    """The options of model ``name`` with their defaults."""
    return _defaults(_builder(name))


def _builder(name: str):
    if not isinstance(name, str) or name not in MODELS:
        raise MemschedError(f"unknown model {name!r}; built-in models: {', '.join(MODELS)}")
    return MODELS[name]


def build(name: str, **options) -> StagedModel:
    """Build model ``name`` with ``options`` (the others at their defaults)."""
    builder = _builder(name)
    _resolve(name, builder, options)  # refuses unknown options before the builder's TypeError would
    return builder(**options)


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*\Z")
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_INT = re.compile(r"[+-]?[0-9]+\Z")
_FLOAT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?\Z")


def parse_spec(spec: str) -> tuple:
    """``"gpt-tiny:layers=12,d=512"`` -> ``("gpt-tiny", {"layers": 12, "d": 512})``.

    Integers and floats are parsed; any other value is kept as a string (for :func:`build` to judge).
    """
    form = "expected NAME or NAME:OPTION=VALUE,... (e.g. gpt-tiny:layers=12,d=512)"
    if not isinstance(spec, str):
        raise MemschedError(f"model spec must be a string, got {spec!r}; {form}")
    name, colon, rest = spec.strip().partition(":")
    name = name.strip()
    if not _NAME.match(name):
        raise MemschedError(f"malformed model spec {spec!r}: bad model name {name!r}; {form}")
    options = {}
    if colon and not rest.strip():
        raise MemschedError(f"malformed model spec {spec!r}: no options after ':'; {form}")
    for item in rest.split(",") if colon else ():
        key, eq, text = (part.strip() for part in item.partition("="))
        if not eq or not _KEY.match(key) or not text:
            raise MemschedError(f"malformed model spec {spec!r}: bad option {item.strip()!r}; {form}")
        if key in options:
            raise MemschedError(f"malformed model spec {spec!r}: option {key} given twice; {form}")
        if _INT.match(text):
            options[key] = int(text)
        elif _FLOAT.match(text):
            options[key] = float(text)
        else:
            options[key] = text
    return name, options
