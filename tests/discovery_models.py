"""Unmodified models as users bring them, built small for the discovery tests: Hugging Face GPT-2 (tied
embeddings, dropout, padding mask), Llama (rotary embeddings, grouped key/value heads) and BERT (padding mask,
pooler) from tiny configs, no weights downloaded; and, written here since torchvision and timm are not
installed beside the CPU torch, a ViT-like and a ConvNeXt-like network in the style of timm's.

Each builder returns ``(model, example_inputs, loss_fn or None)`` as a factory for ``memsched`` would, and no
line of memsched's knows any of them.
"""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, BATCH, SEQUENCE = 256, 4, 32


def _token_batch(seed: int, labels=None) -> dict:
    """Token ids, a padding mask (the second sequence padded after 20 tokens) and labels (the ids by default)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQUENCE), generator=generator)
    mask = torch.ones(BATCH, SEQUENCE, dtype=torch.long)
    mask[1, 20:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.clone() if labels is None else labels}


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=3, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=SEQUENCE,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config).train(), _token_batch(1), None


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=3, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQUENCE,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(config).train(), _token_batch(2), None


def bert():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(num_hidden_layers=3, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                        vocab_size=VOCAB, max_position_embeddings=SEQUENCE, num_labels=3, pad_token_id=0)
    return BertForSequenceClassification(config).train(), _token_batch(3, labels=torch.tensor([0, 2, 1, 0])), None


# --------------------------------------------------------------------------------------------------
# ViT-like: class token and position embedding added outside the blocks, trunc_normal_ init


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, drop: float):
        super().__init__()
        self.heads, self.drop = heads, drop
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(drop)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        x = F.scaled_dot_product_attention(q, k, v, dropout_p=self.drop if self.training else 0.0)
        return self.proj_drop(self.proj(x.transpose(1, 2).reshape(b, n, c)))


class VitBlock(nn.Module):
    def __init__(self, dim: int, heads: int, drop: float):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), Attention(dim, heads, drop)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(drop))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Module):
    def __init__(self, size=32, patch=4, dim=64, depth=3, heads=4, classes=10, drop=0.1):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, patch, stride=patch)
        tokens = (size // patch) ** 2
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, tokens + 1, dim))
        self.pos_drop = nn.Dropout(drop)
        self.blocks = nn.Sequential(*[VitBlock(dim, heads, drop) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.cls_token, std=0.02)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.02)
                nn.init.zeros_(module.bias)

    def forward(self, pixels):
        x = self.patch_embed(pixels).flatten(2).transpose(1, 2)
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
        x = self.blocks(self.pos_drop(x + self.pos_embed))
        return self.head(self.norm(x)[:, 0])


def vit():
    torch.manual_seed(0)
    model = VisionTransformer().train()
    generator = torch.Generator().manual_seed(4)
    pixels = torch.randn(BATCH, 3, 32, 32, generator=generator)
    labels = torch.randint(0, 10, (BATCH,), generator=generator)
    return model, pixels, lambda logits: F.cross_entropy(logits, labels)


# --------------------------------------------------------------------------------------------------
# ConvNeXt-like: stages with downsampling (BatchNorm here, for its statistics), depthwise and 1x1 convolutions
# (as linear layers on channels-last), layer scale, stochastic depth; it returns {"loss", "logits"}


class LayerNorm2d(nn.LayerNorm):
    def forward(self, x):
        return F.layer_norm(x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.bias,
                            self.eps).permute(0, 3, 1, 2)


def drop_path(x, p: float, training: bool):
    """Stochastic depth as timm writes it: a whole sample's branch dropped with probability ``p``."""
    if p == 0.0 or not training:
        return x
    keep = 1 - p
    mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
    return x * mask.div_(keep)


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int, drop_path: float):
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim)
        self.pwconv1, self.pwconv2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(1e-1 * torch.ones(dim))
        self.drop_path = drop_path

    def forward(self, x):
        branch = self.norm(self.dwconv(x).permute(0, 2, 3, 1))
        branch = (self.gamma * self.pwconv2(F.gelu(self.pwconv1(branch)))).permute(0, 3, 1, 2)
        return x + drop_path(branch, self.drop_path, self.training)


class ConvNeXt(nn.Module):
    def __init__(self, dims=(16, 32, 64), depths=(2, 2, 1), classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, dims[0], 4, stride=4), LayerNorm2d(dims[0]))
        rates = torch.linspace(0, 0.2, sum(depths)).tolist()
        stages = []
        for i, (dim, depth) in enumerate(zip(dims, depths)):
            down = [nn.BatchNorm2d(dims[i - 1]), nn.Conv2d(dims[i - 1], dim, 2, stride=2)] if i else []
            blocks = [ConvNeXtBlock(dim, rates.pop(0)) for _ in range(depth)]
            stages.append(nn.Sequential(*down, *blocks))
        self.stages = nn.Sequential(*stages)
        self.norm = nn.LayerNorm(dims[-1])
        self.head = nn.Linear(dims[-1], classes)

    def forward(self, pixels, labels):
        logits = self.head(self.norm(self.stages(self.stem(pixels)).mean((2, 3))))
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


def convnext():
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(5)
    pixels = torch.randn(BATCH, 3, 64, 64, generator=generator)
    labels = torch.randint(0, 10, (BATCH,), generator=generator)
    return ConvNeXt().train(), (pixels, labels), None


MODELS = {"gpt2": gpt2, "llama": llama, "bert": bert, "vit": vit, "convnext": convnext}
