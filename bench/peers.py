"""memsched against what users pick instead, each at the other's own measured peak: CPU time per step.

    python bench/peers.py [gpt2 llama] [--layers 6] [--width 512] [--batch 4] [--sequence 256] [--pairs 8]
                          [--peers plain,hf,sac,compile] [--fractions 0.05,0.2,0.4,0.6,0.8] [--threads 1]

For each Hugging Face model (``GPT2LMHeadModel`` / ``LlamaForCausalLM`` / ``BertForMaskedLM``, random weights,
dropout as configured, ``--layers`` layers of width ``--width``, a batch of ``--batch`` x ``--sequence`` token ids
with labels; the masked LM's labels are the ids themselves), each peer
runs its own training step (``out = model(**batch); out.loss.backward()``, ``out`` and its logits held through
the backward) on its own copy of the model:

* ``plain``: the model as it is (everything stored);
* ``hf``: Hugging Face's ``gradient_checkpointing_enable()`` (every layer recomputed, non-reentrant);
* ``sac``: the same per layer with selective activation checkpointing's "save the matmuls" policy
  (``torch.utils.checkpoint.create_selective_checkpoint_contexts``: matrix products and attention kept, the rest
  recomputed), through ``gradient_checkpointing_kwargs``;
* ``compile f``: ``torch.compile(model)`` compiled with ``activation_memory_budget = f`` for each ``--fractions``
  (its peak is not monotone in f: each is measured).

Each peer's peak is measured (the live-memory tracker around the step for eager peers, torch.profiler's memory
events for compiled ones, the batch's bytes added), then ``fit(model, batch, that peak)`` (``compile=True`` for
a compiled peer) plans a fresh copy, and the two steps are timed in ``--pairs`` interleaved pairs (process CPU
time, one torch thread by default, glibc's heap thresholds pinned: bench/executor.py). Each row: the peer's peak,
memsched's predicted and measured peak over the budget, the median of memsched / peer per pair and its range.
Figures in docs/benchmarks.md ("memsched against its peers at equal memory").
"""

import argparse
import copy
import statistics
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from executor import Clock, load_average, pin_malloc  # noqa: E402 (bench/ is the script's folder)

from planner.errors import MemschedError  # noqa: E402
from profiles.fit import fit  # noqa: E402
from profiles.memory import memory_meter, storage_bytes  # noqa: E402

MIB = 2**20
VOCAB = 8000


def build(name: str, args):
    """``(model, batch)``: the Hugging Face model, training mode, random weights, and its batch with labels."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if name == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=8, vocab_size=VOCAB,
                                           n_positions=args.sequence, bos_token_id=0, eos_token_id=0))
    elif name == "llama":
        model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=args.layers, hidden_size=args.width,
                                             intermediate_size=args.width * 8 // 3, num_attention_heads=8,
                                             num_key_value_heads=8, vocab_size=VOCAB,
                                             max_position_embeddings=args.sequence, bos_token_id=0, eos_token_id=0))
    elif name == "bert":
        from transformers import BertConfig, BertForMaskedLM

        model = BertForMaskedLM(BertConfig(num_hidden_layers=args.layers, hidden_size=args.width, num_attention_heads=8,
                                           intermediate_size=args.width * 4, vocab_size=VOCAB,
                                           max_position_embeddings=args.sequence))
    else:
        raise SystemExit(f"unknown model {name!r}: gpt2, llama or bert")
    ids = torch.randint(0, VOCAB, (args.batch, args.sequence), generator=torch.Generator().manual_seed(1))
    return model.train(), {"input_ids": ids, "labels": ids.clone()}


def save_matmuls():
    """The "save the matmuls" context of selective activation checkpointing."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    aten = torch.ops.aten
    kept = [aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default,
            aten._scaled_dot_product_efficient_attention.default, aten._scaled_dot_product_flash_attention.default]
    return create_selective_checkpoint_contexts(kept)


def peer_model(model, peer: str):
    """A copy of ``model`` set up as ``peer`` runs it (``compile`` compiles at its first step)."""
    copied = copy.deepcopy(model)
    if peer == "hf":
        copied.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif peer == "sac":
        copied.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False,
                                                                            "context_fn": save_matmuls})
    elif peer.startswith("compile"):
        copied = torch.compile(copied)
    return copied


class Step:
    """One training step of a model on the batch, gradients cleared first."""

    def __init__(self, model, batch, compiled: bool, fraction: float = None):
        self.model, self.batch, self.compiled, self.fraction = model, batch, compiled, fraction
        self.parameters = list(model.parameters())
        self.held = storage_bytes(list(batch.values()))

    def __call__(self):
        for parameter in self.parameters:
            parameter.grad = None
        output = self.model(**self.batch)  # held through the backward, as a loop holding ``out`` holds it
        output.loss.backward()

    def warm(self, steps: int = 2) -> None:
        """``steps`` steps, compiling first (at :attr:`fraction`, read when it compiles)."""
        import torch._functorch.config as functorch_config

        with functorch_config.patch({} if self.fraction is None else {"activation_memory_budget": self.fraction}):
            for _ in range(steps):
                self()

    def peak(self) -> int:
        """Bytes at the step's peak: what it allocates (the meter of eager or compiled code) and the batch."""
        for parameter in self.parameters:
            parameter.grad = None
        with memory_meter("cpu", self.compiled) as meter:
            self()
        return meter.peak + self.held


def pairs(peer: Step, ours: Step, count: int, clock) -> list:
    """Seconds of ``(peer, ours)`` in ``count`` interleaved pairs, after one untimed pair."""
    found = []
    for round_ in range(count + 1):
        times = (clock.seconds(peer), clock.seconds(ours))
        if round_:
            found.append(times)
    return found


def bench_model(name: str, args, clock) -> list:
    model, batch = build(name, args)
    peers = [p for p in args.peers if p != "compile"]
    if "compile" in args.peers:
        peers += [f"compile {f}" for f in args.fractions]
    lines = [f"## {name}: {args.layers} layers, width {args.width}, batch {args.batch} x {args.sequence}, torch "
             f"threads {torch.get_num_threads()}, load average {load_average()}", "",
             "| peer | peer's peak MiB | memsched predicted / budget | measured / budget | memsched / peer "
             "(median, range) | peer s/step | memsched plan |", "|---|---:|---:|---:|---:|---:|---|"]
    for peer in peers:
        compiled = peer.startswith("compile")
        fraction = float(peer.split()[1]) if compiled else None
        theirs = Step(peer_model(model, peer), batch, compiled, fraction)
        theirs.warm()
        budget = theirs.peak()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a compiled plan's note on its peak: measured here
                fitted = fit(copy.deepcopy(model), batch, budget, compile=compiled, progress=False)
        except MemschedError as error:
            lines.append(f"| {peer} | {budget / MIB:.1f} | refused: {error} | | | | |")
            continue
        ours = Step(fitted, batch, compiled)
        ours.warm()
        measured = ours.peak()
        timed = pairs(theirs, ours, args.pairs, clock)
        ratios = [b / a for a, b in timed]
        plan = fitted.plan
        options = sum(op.option is not None for op in plan.schedule)
        lines.append(f"| {peer} | {budget / MIB:.1f} | {fitted.predicted.peak_bytes / budget:.3f} | "
                     f"{measured / budget:.3f} | {statistics.median(ratios):.3f} ({min(ratios):.3f}-"
                     f"{max(ratios):.3f}) | {statistics.median(a for a, _ in timed):.2f} | {plan.solver}, "
                     f"{plan.recomputed_forwards} recomputed forwards, {options} stage options |")
        print(lines[-1], flush=True)
        del theirs, ours, fitted
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*", default=["gpt2", "llama"])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--sequence", type=int, default=256)
    parser.add_argument("--pairs", type=int, default=8, help="timed pairs per peer (default 8)")
    parser.add_argument("--peers", type=lambda text: text.split(","), default=["plain", "hf", "sac", "compile"])
    parser.add_argument("--fractions", type=lambda text: [float(f) for f in text.split(",")],
                        default=[0.05, 0.2, 0.4, 0.6, 0.8])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pinned = pin_malloc()
    clock = Clock("cpu")
    print(f"clock: {clock.label}; glibc heap thresholds pinned: {pinned}", flush=True)
    for name in args.models:
        print("\n".join(bench_model(name, args, clock)), flush=True)


if __name__ == "__main__":
    main()
