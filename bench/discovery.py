"""Discovery benchmark: ``fit`` on unmodified Hugging Face models against what users pick instead.

    python bench/discovery.py [--layers N] [--steps N] [--threads N] [--wall-clock]

For GPT-2 (tied embeddings), Llama and BERT built from configs (``--layers`` layers, width 128, sequence 128,
batch 8, a padding mask, labels; no weights downloaded), in one run:

* ``plain``: the unmodified step, ``model(**batch).loss.backward()``;
* ``hf``: the same after ``model.gradient_checkpointing_enable(use_reentrant=False)`` (every layer recomputed,
  Hugging Face's one-liner);
* ``fit@hf``: ``fit(model, batch, budget)`` with the budget at ``hf``'s measured peak (plus the batch, which
  the chain counts and the measured windows do not), then ``fitted(**batch).backward()``;
* ``fit@2hf``: rotor's plan at twice that budget, which Hugging Face's all-or-nothing switch cannot use;
* ``fit@least``: rotor's plan at the chain's least feasible budget, run on the same discovered stages.

Peaks are what each step allocates, by the live-memory tracker (the batch, there before every step, is not
counted for any). Times are medians of ``--steps`` steps, the four variants interleaved step by step, on the
clock of ``bench/executor.py`` (process CPU time at one thread unless ``--wall-clock``). Each row also gives
discovery's seconds and stage count and checks that fit's loss equals the unmodified model's (same seed).
"""

import argparse
import contextlib
import functools
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from executor import Clock, load_average, pin_malloc  # noqa: E402 (bench/ is the script's folder)

from planner import fit  # noqa: E402
from planner.execute.chain import apply_plan  # noqa: E402
from planner.execute.live_memory import LiveMemoryTracker  # noqa: E402
from profiles.memory import storage_bytes  # noqa: E402
from solvers import solve  # noqa: E402
from solvers.minimum import minimum_budget  # noqa: E402

BATCH, SEQUENCE, WIDTH, VOCAB = 8, 128, 128, 1000
VARIANTS = ("plain", "hf/1", "hf/2", "fit@hf/1", "fit@hf/2", "fit@least")


def batch_of(seed: int, labels=None) -> dict:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQUENCE), generator=generator)
    mask = torch.ones(BATCH, SEQUENCE, dtype=torch.long)
    mask[0, SEQUENCE // 2:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.clone() if labels is None else labels}


def models(layers: int) -> dict:
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
    )

    return {
        "gpt2": lambda: (GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=WIDTH, n_head=4, vocab_size=VOCAB,
                                                    n_positions=SEQUENCE, bos_token_id=0, eos_token_id=0)),
                         batch_of(1)),
        "llama": lambda: (LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers, hidden_size=WIDTH,
                                                       intermediate_size=4 * WIDTH, num_attention_heads=4,
                                                       num_key_value_heads=2, vocab_size=VOCAB,
                                                       max_position_embeddings=SEQUENCE, bos_token_id=0,
                                                       eos_token_id=0, pad_token_id=0)),
                          batch_of(2)),
        "bert": lambda: (BertForSequenceClassification(BertConfig(num_hidden_layers=layers, hidden_size=WIDTH,
                                                                  intermediate_size=4 * WIDTH, num_attention_heads=4,
                                                                  vocab_size=VOCAB, max_position_embeddings=SEQUENCE,
                                                                  num_labels=3, pad_token_id=0)),
                         batch_of(3, labels=torch.arange(BATCH) % 3)),
    }


@contextlib.contextmanager
def checkpointed(model, every: int = 1):
    """Hugging Face's activation checkpointing on ``model`` (non-reentrant, every ``every``-th layer; transformers
    before 5 checkpoints every layer), off again afterwards."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable({"use_reentrant": False}, every_n_layers=every)
        disable = model.activation_checkpointing_disable
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        disable = model.gradient_checkpointing_disable
    try:
        yield
    finally:
        disable()


def one_step(model, loss) -> float:
    """A step from gradients set to None at a fixed seed: ``loss()`` then its backward; the loss value."""
    for parameter in model.parameters():
        parameter.grad = None
    torch.manual_seed(0)
    value = loss()
    value.backward()
    return float(value.detach())


def peak(model, loss) -> tuple:
    with LiveMemoryTracker() as tracker:
        value = one_step(model, loss)
    return tracker.peak, value


def run_model(name, build, steps, clock) -> dict:
    torch.manual_seed(0)
    model, batch = build()
    model.train()
    plain = lambda: model(**batch).loss  # noqa: E731
    peaks, losses = {}, {}
    peaks["plain"], plain_loss = peak(model, plain)
    for every in (1, 2):
        with checkpointed(model, every):
            peaks[f"hf/{every}"], _ = peak(model, plain)
    inputs = storage_bytes(list(batch.values()))  # the chain counts the batch; the measured windows do not
    started = time.perf_counter()
    fitted = fit(model, batch, peaks["hf/1"] + inputs, returns="loss")
    fit_seconds = time.perf_counter() - started
    chain, stages = fitted.chain, fitted.discovery.staged.stages
    planned = {"fit@hf/2": solve(chain, peaks["hf/2"] + inputs, "rotor"),
               "fit@least": solve(chain, minimum_budget(chain), "rotor")}
    runs = {variant: apply_plan(stages, plan, chain) for variant, plan in planned.items()}
    variants = {"plain": plain, "hf/1": plain, "hf/2": plain, "fit@hf/1": lambda: fitted(**batch)}
    variants.update({variant: functools.partial(_chain_step, run, fitted, batch) for variant, run in runs.items()})
    for variant in ("fit@hf/1", "fit@hf/2", "fit@least"):
        peaks[variant], losses[variant] = peak(model, variants[variant])
    times = {variant: [] for variant in variants}
    for _ in range(steps):
        for variant, loss in variants.items():
            every = int(variant[3:]) if variant.startswith("hf/") else None
            with checkpointed(model, every) if every else contextlib.nullcontext():
                times[variant].append(clock.seconds(lambda: one_step(model, loss)))
    return dict(name=name, stages=len(stages), fit_seconds=fit_seconds, peaks=peaks,
                times={variant: statistics.median(values) for variant, values in times.items()},
                same_loss=all(loss == plain_loss for loss in losses.values()))


def _chain_step(run, fitted, batch):
    return run(*fitted.discovery.chain_inputs((), batch))


def mib(count: int) -> str:
    return f"{count / 2**20:7.2f} MiB"


def print_rows(rows) -> None:
    print(f"{'model':6s} {'stages':>6s} {'fit s':>6s}  " + "  ".join(f"{v:>22s}" for v in VARIANTS))
    for row in rows:
        cells = [f"{mib(row['peaks'][v])} {1e3 * row['times'][v]:8.1f} ms" for v in VARIANTS]
        print(f"{row['name']:6s} {row['stages']:6d} {row['fit_seconds']:6.1f}  " + "  ".join(cells))
    print()
    print("fit against Hugging Face's checkpointing of every layer (hf/1) and of every second layer (hf/2), each at "
          "the budget of hf's measured peak: peak and time ratios; fit's least peak over hf/1's; fit's losses equal "
          "to the unmodified model's")
    for row in rows:
        p, t = row["peaks"], row["times"]
        print(f"  {row['name']:6s} " + "   ".join(f"@hf/{k} peak {p[f'fit@hf/{k}'] / p[f'hf/{k}']:.3f} time "
                                               f"{t[f'fit@hf/{k}'] / t[f'hf/{k}']:.3f}" for k in (1, 2))
              + f"   least peak {p['fit@least'] / p['hf/1']:.3f}   same loss: {row['same_loss']}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--wall-clock", action="store_true")
    parser.add_argument("--models", nargs="*", default=["gpt2", "llama", "bert"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pinned = pin_malloc()
    clock = Clock("cpu", wall=args.wall_clock)
    print(f"discovery bench: {args.layers} layers, width {WIDTH}, sequence {SEQUENCE}, batch {BATCH}; "
          f"{args.threads} thread(s), {clock.label}, malloc pinned: {pinned}; load {load_average()}")
    from transformers.utils import logging

    logging.set_verbosity_error()
    builders = models(args.layers)
    print_rows([run_model(name, builders[name], args.steps, clock) for name in args.models])
    print(f"load {load_average()}")


if __name__ == "__main__":
    main()
