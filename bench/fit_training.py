"""``fit`` in the training loops people write: each step's measured peak against its prediction, and the losses
against the unmodified model's, in one run.

    python bench/fit_training.py [MODEL ...] [--budget 50%] [--steps N] [--threads N]

For each model (default: Hugging Face ``gpt2`` and ``llama`` from the tiny configs of tests/discovery_models.py,
no weights), fitted at ``--budget`` (a recomputing plan) and trained beside an untouched copy with the same
seeds, in five loops:

* ``fp32``: ``out = fitted(**batch); out.loss.backward(); optimizer.step()``, ``--steps`` steps;
* ``bf16``: the forward under ``torch.autocast("cpu", dtype=torch.bfloat16)`` (fitted under it), the backward
  after it;
* ``accumulate 4``: four micro-batches (other token ids each) add their gradients before each optimizer step,
  every micro-batch measured against its own prediction (the first starts without gradients);
* ``eval between``: an evaluation (``fitted.eval()`` under ``torch.no_grad()``) between training steps, its loss
  against the unmodified model's in eval mode, and the training step after it measured;
* ``Trainer``: Hugging Face's ``Trainer`` given the fitted model as it is, ``--steps`` steps on a tiny in-memory
  data set, its logged losses and the parameters after against the same Trainer's on the unmodified model (peaks
  not measured: the Trainer's step is its own).

A step's measured peak is what the user's call and backward allocate (the live-memory tracker around
``fitted(**batch)`` and the backward, the prelude's masks and positions included) plus the batch tensors the
chain reads as they are, and, from the second micro-batch on, the gradients held from the earlier ones. Each
row prints the measured/predicted ratio of every step (micro-batch) and whether every loss (for the Trainer, every
logged loss and parameter after its steps) equals the unmodified model's (``torch.equal``), else the largest
relative difference.
"""

import argparse
import copy
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the tiny Hugging Face configs the tests build

from discovery_models import MODELS, _token_batch  # noqa: E402
from planner import fit  # noqa: E402
from planner.execute.live_memory import LiveMemoryTracker  # noqa: E402
from profiles.memory import storage_bytes  # noqa: E402

LR = 1e-3


class Agreement:
    """Whether every loss equals the unmodified model's, else the largest relative difference."""

    def __init__(self):
        self.largest = 0.0

    def add(self, loss, expected) -> None:
        if not torch.equal(loss, expected):
            self.largest = max(self.largest, float(((loss - expected).abs() / expected.abs()).max()))

    def __str__(self) -> str:
        return "yes" if self.largest == 0 else f"no: {self.largest:.1e} relative"


def _loss(output):
    return output.loss if hasattr(output, "loss") else output


def measured_step(fitted, batch, autocast=None, held: int = 0) -> tuple:
    """``(loss, measured peak bytes)`` of one user step ``fitted(**batch)`` and its backward (see the module
    docstring); ``autocast``: the dtype the forward runs under."""
    inputs = fitted.discovery.chain_inputs((), batch)
    batch_storages = {t.untyped_storage()._cdata for t in batch.values() if isinstance(t, torch.Tensor)}
    read_as_given = storage_bytes([t for t in inputs if isinstance(t, torch.Tensor)
                                   and t.untyped_storage()._cdata in batch_storages])
    del inputs
    with LiveMemoryTracker() as tracker:
        with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            output = fitted(**batch)
        loss = _loss(output)
        loss.backward()
        del output
    return loss.detach(), tracker.peak + read_as_given + held


def reference_step(twin, batch, autocast=None):
    with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
        loss = twin(**batch, use_cache=False).loss
    loss.backward()
    return loss.detach()


def batches(count: int, seed: int) -> list:
    """``count`` batches laid out as the model's example batch, other token ids each."""
    return [_token_batch(seed + k) for k in range(count)]


def plain_loop(name, budget, steps, autocast=None, evaluate: bool = False) -> tuple:
    """fp32 or bf16 (``autocast``): ``steps`` steps, each followed by an evaluation when ``evaluate`` (both models
    in eval mode under ``torch.no_grad()``, then back to training); ``(ratios, agreement)``."""
    model, example, _ = MODELS[name]()
    twin = copy.deepcopy(model)
    fitted = fit(model, example, budget, autocast=autocast if autocast is not None else False)
    ours, theirs = torch.optim.Adam(model.parameters(), lr=LR), torch.optim.Adam(twin.parameters(), lr=LR)
    ratios, equal = [], Agreement()
    evaluation = _token_batch(999)
    for step, batch in enumerate(batches(steps, 100)):
        torch.manual_seed(step)
        loss, peak = measured_step(fitted, batch, autocast)
        torch.manual_seed(step)
        expected = reference_step(twin, batch, autocast)
        for optimizer in (ours, theirs):
            optimizer.step()
            optimizer.zero_grad()
        ratios.append(peak / fitted.predicted.peak_bytes)
        equal.add(loss, expected)
        if evaluate:
            fitted.eval()
            twin.eval()
            with torch.no_grad():
                equal.add(_loss(fitted(**evaluation)), twin(**evaluation, use_cache=False).loss)
            fitted.train()
            twin.train()
    return ratios, equal


def accumulating_loop(name, budget, steps, micro_batches=4) -> tuple:
    model, example, _ = MODELS[name]()
    twin = copy.deepcopy(model)
    fitted = fit(model, example, budget, accumulate=micro_batches)
    predicted = fitted.micro_batch_peaks
    ours, theirs = torch.optim.Adam(model.parameters(), lr=LR), torch.optim.Adam(twin.parameters(), lr=LR)
    ratios, equal = [], Agreement()
    for step in range(steps):
        for micro, batch in enumerate(batches(micro_batches, 200 + micro_batches * step)):
            held = storage_bytes([p.grad for p in model.parameters() if p.grad is not None])
            torch.manual_seed(step * 100 + micro)
            loss, peak = measured_step(fitted, batch, held=held)
            torch.manual_seed(step * 100 + micro)
            expected = reference_step(twin, batch)
            ratios.append(peak / predicted[micro])
            equal.add(loss, expected)
        for optimizer in (ours, theirs):
            optimizer.step()
            optimizer.zero_grad()
    return ratios, equal


def trainer_loop(name, budget, steps) -> tuple:
    """Hugging Face's Trainer on the fitted model and on the unmodified one: ``(None, logged losses equal)``."""
    from transformers import default_data_collator

    from hf_trainer import trainer_losses  # tests/hf_trainer.py

    model, example, _ = MODELS[name]()
    twin = copy.deepcopy(model)
    rows = [{key: value[k % 4] for key, value in _token_batch(400 + k // 4).items()} for k in range(steps * 4)]
    fitted = fit(model, default_data_collator(rows[:4]), budget)
    logged = []
    for trained in (fitted, twin):
        with tempfile.TemporaryDirectory() as folder:
            logged.append(trainer_losses(trained, rows, folder, steps=steps, batch_size=4, lr=LR, seed=0,
                                         data_collator=default_data_collator))
    agreement = Agreement()
    if len(logged[0]) != steps:
        agreement.largest = float("inf")
    for ours, theirs in zip(*logged):
        agreement.add(torch.tensor(ours), torch.tensor(theirs))
    for (_, p), q in zip(model.named_parameters(), twin.parameters()):  # and the parameters Trainer stepped
        agreement.add(p.detach(), q.detach())
    return None, agreement


LOOPS = {
    "fp32": lambda name, budget, steps: plain_loop(name, budget, steps),
    "bf16": lambda name, budget, steps: plain_loop(name, budget, steps, torch.bfloat16),
    "accumulate 4": accumulating_loop,
    "eval between": lambda name, budget, steps: plain_loop(name, budget, steps, evaluate=True),
    "Trainer": trainer_loop,
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=["gpt2", "llama"])
    parser.add_argument("--budget", default="50%")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"budget {args.budget}, {args.steps} steps, {torch.get_num_threads()} threads")
    print(f"{'model':<8} {'loop':<14} {'measured/predicted peak per step (micro-batch)':<64} losses equal")
    for name in args.models:
        for loop, run in LOOPS.items():
            ratios, equal = run(name, args.budget, args.steps)
            shown = "not measured (Trainer's own step)" if ratios is None else \
                " ".join(f"{ratio:.4f}" for ratio in ratios)
            print(f"{name:<8} {loop:<14} {shown:<64} {equal}", flush=True)


if __name__ == "__main__":
    main()
