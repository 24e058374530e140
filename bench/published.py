"""Published memory figures reproduced by memsched's estimate, side by side (``python bench/published.py``).

1. **Korthikanti et al. 2022** ("Reducing Activation Recomputation in Large Transformer Models", Sec. 4.1): a
   transformer layer in 16-bit keeps ``sbh(34 + 5as/h)`` bytes of activations for its backward (``s`` tokens,
   ``b`` sequences, ``h`` width, ``a`` heads; 1-byte dropout masks), ``sbh(32 + 2as/h)`` without dropout, and
   ``2sbh`` (its input) under full recomputation; fused attention (SDPA) replaces the ``as²b`` terms by its
   log-sum-exp (``4asb``: fp32). A Megatron-style layer (:class:`MegatronLayer`) is estimated for an H100 (fake
   tensors, CUDA's dropout kernel and allocator blocks) at three widths, from GPT-2 small to GPT-3 175B: the
   middle layer's ``saved_bytes`` (what it keeps for its backward, its output in place of its input) against the
   formula. memsched also counts what the paper leaves out: each LayerNorm's fp32 mean and reciprocal deviation
   (``8sb`` each).
2. **Rajbhandari et al. 2020** ("ZeRO", Figure 1): model states of a 7.5B-parameter model in mixed-precision Adam
   over 64 data-parallel ranks: 120, 31.4, 16.6 and 1.9 GB per device for ZeRO stages 0 to 3.
3. **Llama-3-8B** (32 layers, built in bf16, Hugging Face's ``LlamaForCausalLM``): torchtitan's published run
   (FSDP over 8 H100 of 96 GB, bf16 compute with fp32 master weights and AdamW, local batch 2 × 8192: 82.4 GiB
   reserved peak per rank, with selective activation checkpointing) and one H100 80 GB at 1 × 4096, mixed
   precision (does not fit: 16 bytes per parameter) and torchtune's pure-bf16 full fine-tune with 8-bit AdamW.
   Each estimate runs in its own process (``memsched plan``): its seconds and its peak host memory are printed.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from planner.devices import DEVICES  # noqa: E402
from planner.setup import TrainingSetup  # noqa: E402
from profiles.chain_profiler import profile_chain  # noqa: E402
from profiles.fake_build import build_fake  # noqa: E402

H100 = DEVICES["h100-80gb"]
# (name, h, a, s, b): sizes whose tensors are whole 2 MiB blocks, so that the allocator adds nothing to compare
WIDTHS = (("GPT-2 small", 768, 12, 1024, 8), ("GPT-3 XL", 2048, 16, 2048, 1), ("GPT-3 175B", 12288, 96, 2048, 1))


class MegatronLayer(nn.Module):
    """A GPT layer as Korthikanti et al. itemise it: LayerNorm, QKV projection, attention (``math``: QKᵀ, softmax,
    dropout, times V; ``sdpa``: fused), output projection, dropout, residual; LayerNorm, MLP (h → 4h, GeLU,
    4h → h), dropout, residual."""

    def __init__(self, h: int, a: int, p: float, attention: str):
        super().__init__()
        self.a, self.p, self.attention = a, p, attention
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        b, s, h = x.shape
        d = h // self.a
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.a, d).permute(2, 0, 3, 1, 4)
        if self.attention == "sdpa":
            context = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            probs = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * d ** -0.5, dim=-1)
            context = torch.matmul(F.dropout(probs, self.p, self.training), v)
        x = x + F.dropout(self.proj(context.transpose(1, 2).reshape(b, s, h)), self.p, self.training)
        return x + F.dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)))), self.p, self.training)


def formula(h: int, a: int, s: int, b: int, dropout: bool, attention: str) -> int:
    """Korthikanti et al.'s bytes per layer (module docstring)."""
    per_token = 34 if dropout else 32
    if attention == "sdpa":
        return s * b * h * per_token + 4 * a * s * b
    return s * b * h * per_token + (5 if dropout else 2) * a * s * s * b


def estimated_layer(h: int, a: int, s: int, b: int, dropout: bool, attention: str):
    """The middle layer of three, estimated for an H100 in bf16: its stage of the chain."""
    def build():
        torch.manual_seed(0)
        layers = [MegatronLayer(h, a, 0.1 if dropout else 0.0, attention).to(torch.bfloat16) for _ in range(3)]
        return layers, torch.randn(b, s, h, dtype=torch.bfloat16, requires_grad=True)

    _, (stages, x) = build_fake(build)
    chain = profile_chain(stages, x, estimate=True, warmup=0, repeats=1, options=0, device_spec=H100)
    return chain.stages[1]


def korthikanti_lines() -> list:
    lines = ["Korthikanti et al. 2022, activations per layer (bytes), bf16, estimated for an H100:",
             f"  {'width':<12} {'h':>6} {'a':>3} {'s':>5} {'b':>2} {'dropout':>7} {'attention':>9} "
             f"{'paper':>14} {'memsched':>14} {'ratio':>8} {'+ LN stats':>10}  {'input (full recompute)':>22}"]
    for name, h, a, s, b in WIDTHS:
        for dropout, attention in ((True, "math"), (False, "math"), (False, "sdpa")):
            stage = estimated_layer(h, a, s, b, dropout, attention)
            paper, norms = formula(h, a, s, b, dropout, attention), 2 * 8 * s * b
            lines.append(f"  {name:<12} {h:>6} {a:>3} {s:>5} {b:>2} {'yes' if dropout else 'no':>7} {attention:>9} "
                         f"{paper:>14} {stage.saved_bytes:>14} {stage.saved_bytes / paper:>8.5f} "
                         f"{stage.saved_bytes / (paper + norms):>10.5f}  "
                         f"{stage.out_bytes} = 2sbh {'yes' if stage.out_bytes == 2 * s * b * h else 'NO':>3}")
    return lines


def zero_lines() -> list:
    """ZeRO's Figure 1: 7.5B parameters, 64 ranks, mixed-precision Adam (K = 12)."""
    parameters, published = 7_500_000_000, {0: 120, 1: 31.4, 2: 16.6, 3: 1.9}
    lines = ["ZeRO (Rajbhandari et al. 2020) Figure 1: model states per device, 7.5B parameters, 64 ranks, "
             "mixed-precision Adam:",
             f"  {'stage':>5} {'paper GB':>9} {'memsched GB':>12} {'ratio':>7}"]
    for zero, paper in published.items():
        sizes = TrainingSetup("adam", "bf16", zero=zero, dp=64).breakdown(parameters)
        ours = sum(sizes.values()) / 1e9
        lines.append(f"  {zero:>5} {paper:>9} {ours:>12.3f} {ours / paper:>7.4f}")
    return lines


LLAMA = textwrap.dedent('''\
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM


    def build(batch: int = 1, seq: int = 4096):
        config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                             num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                             rope_theta=500000.0, attention_dropout=0.0, attn_implementation="sdpa")
        model = LlamaForCausalLM(config).to(torch.bfloat16).train()
        ids = torch.zeros(batch, seq, dtype=torch.long)
        return model, {"input_ids": ids, "labels": ids}
''')
# memsched's command line in this process, then its peak resident memory on stderr
MEASURED_CLI = ("import resource, sys, cli; status = cli.main(sys.argv[1:]); "
                "print('host peak KiB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)")
# (label, the file's factory, memsched plan's flags)
LLAMA_RUNS = (
    ("torchtitan: 8 x H100 96 GB, FSDP (ZeRO 3), bf16 + fp32 master, AdamW, 2 x 8192; logged 82.4 GiB",
     "build_titan", ["--device-spec", "{h100_96}", "--batch", "2", "--precision", "bf16", "--optimizer", "adamw",
                     "--zero", "3", "--dp", "8"]),
    ("one H100 80 GB, 1 x 4096, bf16 + fp32 master, AdamW (16 B/parameter: 128 GB of model states)",
     "build", ["--device-spec", "h100-80gb", "--batch", "1", "--precision", "bf16", "--optimizer", "adamw"]),
    ("one H100 80 GB, 1 x 4096, pure bf16, 8-bit AdamW (torchtune's single-device full fine-tune)",
     "build", ["--device-spec", "h100-80gb", "--batch", "1", "--precision", "pure-bf16", "--optimizer",
               "adam8bit"]),
)


def llama_lines(folder: Path) -> list:
    model = folder / "llama3_8b.py"
    model.write_text(LLAMA + "\n\ndef build_titan(batch: int = 2):\n    return build(batch, 8192)\n")
    spec = folder / "h100-96gb.json"
    spec.write_text(json_spec(H100, "h100-96gb", 96 * 2 ** 30))
    lines = ["Llama-3-8B (32 layers, built in bf16), memsched plan on fake tensors:"]
    for label, factory, flags in LLAMA_RUNS:
        argv = [sys.executable, "-c", MEASURED_CLI, "plan", f"{model}:{factory}",
                *[flag.format(h100_96=spec) for flag in flags]]
        started = time.perf_counter()
        done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
        seconds = time.perf_counter() - started
        host = int(done.stderr.rsplit("host peak KiB ", 1)[1].split()[0])
        said = [line for line in (done.stdout + done.stderr).splitlines()
                if line.startswith(("chosen", "floor", "memsched: error", "resident"))]
        lines += [f"  {label}", f"    estimate: {seconds:.0f} s, peak host memory {host / 2 ** 20:.2f} GiB"]
        lines += [f"    {line}" for line in said]
    return lines


def json_spec(base, name: str, memory: int) -> str:
    """A memsched.device/1 file's text: ``base`` with another name and memory."""
    return json.dumps(dict(base.to_dict(), name=name, memory_bytes=memory,
                           source=f"{base.source}; torchtitan's H100s: 96 GB"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-llama", action="store_true", help="the layer and ZeRO tables only (seconds)")
    args = parser.parse_args()
    print("\n".join(korthikanti_lines()), flush=True)
    print()
    print("\n".join(zero_lines()), flush=True)
    if not args.skip_llama:
        print()
        with tempfile.TemporaryDirectory() as folder:
            print("\n".join(llama_lines(Path(folder))), flush=True)
    print(f"\n(torch {torch.__version__}; one process per Llama estimate)")


if __name__ == "__main__":
    main()
