"""``fit`` on every Hugging Face family the tests build, and more: each plan's first-step peak against its
prediction and budget, and its loss against the unmodified model's, each (family, budget) in a fresh process.

    python bench/fit_families.py [FAMILY ...] [--budgets 75% 50%] [--threads N]

Families (tiny configs, no weights downloaded): those of tests/discovery_models.py (GPT-2, Llama, BERT) and of
tests/hf_families.py (BART, Whisper, T5, Mixtral, a peft LoRA Llama), and, built here only, OPT, Phi-3, Gemma,
Qwen2-MoE, GPT-NeoX and RoBERTa. A fresh process per row: the plan differs from process to process (it follows
the measured seconds), and the first step of a process is the one that prepares everything (docs/execution.md).

Each row: the stages discovered, the plan's recomputed forwards, its predicted peak, the measured peak of steps 1
and 2 over the prediction, the measured peak over the budget, and whether the first step's loss equals the
unmodified model's from the same seed (``torch.equal``). A step's measured peak is as in bench/fit_training.py:
the live-memory tracker around ``fitted(**batch)`` and its backward, plus the batch tensors the chain reads as
given. Figures: docs/benchmarks.md, "Hugging Face families".
"""

import argparse
import copy
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
from fit_training import measured_step  # noqa: E402

from discovery_models import MODELS, _token_batch  # noqa: E402
from hf_families import FAMILIES  # noqa: E402


def _causal(config_class, model_class, **config):
    """A builder of a tiny causal LM of ``model_class``: 2 layers, a padding mask, labels the ids."""
    def build():
        import transformers

        torch.manual_seed(0)
        model = getattr(transformers, model_class)(getattr(transformers, config_class)(**config))
        return model.train(), _token_batch(5)
    return build


EXTRA = {
    "opt": _causal("OPTConfig", "OPTForCausalLM", num_hidden_layers=2, hidden_size=64, ffn_dim=128,
                   num_attention_heads=4, vocab_size=256, max_position_embeddings=64, word_embed_proj_dim=64,
                   pad_token_id=1, dropout=0.1),
    "phi3": _causal("Phi3Config", "Phi3ForCausalLM", num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=256, max_position_embeddings=64,
                    pad_token_id=0, bos_token_id=0, eos_token_id=0),
    "gemma": _causal("GemmaConfig", "GemmaForCausalLM", num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
                     max_position_embeddings=64, pad_token_id=0, bos_token_id=0, eos_token_id=0),
    "qwen2-moe": _causal("Qwen2MoeConfig", "Qwen2MoeForCausalLM", num_hidden_layers=2, hidden_size=64,
                         intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                         num_experts=4, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2,
                         vocab_size=256, max_position_embeddings=64, pad_token_id=0, bos_token_id=0, eos_token_id=0),
    "gpt-neox": _causal("GPTNeoXConfig", "GPTNeoXForCausalLM", num_hidden_layers=2, hidden_size=64,
                        intermediate_size=128, num_attention_heads=4, vocab_size=256, max_position_embeddings=64,
                        pad_token_id=0, bos_token_id=0, eos_token_id=0),
}


def roberta():
    from transformers import RobertaConfig, RobertaForSequenceClassification

    torch.manual_seed(0)
    config = RobertaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                           vocab_size=256, max_position_embeddings=40, num_labels=3, pad_token_id=1)
    return RobertaForSequenceClassification(config).train(), _token_batch(6, labels=torch.tensor([0, 2, 1, 0]))


def builders() -> dict:
    """Every family's ``() -> (model, batch)``."""
    found = {name: (lambda build=build: build()[:2]) for name, build in MODELS.items()
             if name in ("gpt2", "llama", "bert")}
    return {**found, **FAMILIES, **EXTRA, "roberta": roberta}


def row(family: str, budget: str) -> dict:
    """One (family, budget) measured in this process (the child's work)."""
    from planner import fit

    model, batch = builders()[family]()
    twin = copy.deepcopy(model)
    fitted = fit(model, batch, budget, warmup=0, repeats=1, progress=False)
    peaks, losses = [], []
    for step in range(2):
        torch.manual_seed(step)
        loss, peak = measured_step(fitted, batch)
        fitted.zero_grad(set_to_none=True)
        peaks.append(peak)
        losses.append(loss)
    torch.manual_seed(0)
    expected = twin(**batch).loss
    return dict(family=family, budget=budget, stages=len(fitted.discovery.staged.stages),
                recomputed=fitted.plan.recomputed_forwards, predicted=fitted.predicted.peak_bytes,
                budget_bytes=fitted.plan.budget_bytes, peaks=peaks, loss_equal=torch.equal(losses[0], expected))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("families", nargs="*", help=f"default: all of {sorted(builders())}")
    parser.add_argument("--budgets", nargs="+", default=["75%", "50%"])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps(row(*args.child)))
        return
    print(f"{'family':<10} {'budget':>6} {'stages':>6} {'recomp':>6} {'predicted':>10} {'step 1':>7} {'step 2':>7} "
          f"{'/budget':>7}  loss equal")
    for family in args.families or sorted(builders()):
        for budget in args.budgets:
            command = [sys.executable, __file__, "--child", family, budget]
            if args.threads:
                command += ["--threads", str(args.threads)]
            done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
            if done.returncode != 0:
                last = (done.stderr.strip().splitlines() or ["?"])[-1]
                print(f"{family:<10} {budget:>6}  refused or failed: {last[:150]}")
                continue
            r = json.loads(done.stdout.strip().splitlines()[-1])
            step1, step2 = (peak / r["predicted"] for peak in r["peaks"])
            print(f"{family:<10} {budget:>6} {r['stages']:>6} {r['recomputed']:>6} {r['predicted']:>10} "
                  f"{step1:>7.4f} {step2:>7.4f} {max(r['peaks']) / r['budget_bytes']:>7.4f}  "
                  f"{'yes' if r['loss_equal'] else 'no'}")


if __name__ == "__main__":
    main()
