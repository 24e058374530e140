"""``--batch auto`` against measured training speed, on this CPU as the device (issue 31).

    python bench/batch_auto.py [SPEC] [--device-memory 16MiB] [--threads N] [--steps 11]

The model (default: the Hugging Face GPT-2 tiny fixture, tests/fixtures/hf_gpt2.py) is planned for this CPU as a
device (profiles/cpu_rates.py's measured spec, ``--device-spec cpu``) with ``--device-memory`` bytes, small enough
that the larger micro-batches must recompute: ``plan_for_device(..., "auto")`` tries micro-batches of 1, 2, 4, ...
and predicts each one's samples per second. Then each micro-batch it tried that fits is trained for real: that
plan applied to the real model built at that batch (planner.execute.chain.apply_plan), Adam, and the median of
``--steps`` timed steps (forward, backward, optimizer step, after two untimed), the micro-batches' steps taken in
turns so that the load of a shared machine falls on all alike. Prints per micro-batch the solver,
the recomputed forwards, the predicted peak, the predicted and measured samples per second, and the micro-batch
``--batch auto`` chose with its measured samples per second over the best measured among those tried (the
acceptance: 0.9 or more). Nothing is fitted: the rates are measured once, before.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from planner.execute.chain import apply_plan  # noqa: E402
from planner.execute.stages import named_stages, trainable_parameters  # noqa: E402
from planner.units import describe_bytes, format_bytes, parse_budget  # noqa: E402
from profiles.cpu_rates import cpu_device_spec  # noqa: E402
from profiles.device_plan import best, plan_for_device  # noqa: E402
from profiles.spec import load_model  # noqa: E402

GPT2_TINY = str(Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "hf_gpt2.py") + ":build"
WARMUP = 2  # untimed steps before the timed ones


class Trained:
    """One candidate's plan applied to the real model built at its micro-batch, with Adam: :meth:`step` trains one
    optimizer step (its ``accumulate`` micro-batches, then the update) and returns its seconds."""

    def __init__(self, spec: str, candidate):
        self.candidate = candidate
        self.model, _ = load_model(spec, batch=candidate.batch)
        self.planned = apply_plan(self.model.stages, candidate.plan, candidate.estimate.chain)
        self.optimizer = torch.optim.Adam(trainable_parameters(named_stages(self.model.stages)), lr=1e-3)

    def step(self) -> float:
        started = time.perf_counter()
        for _ in range(self.candidate.accumulate):
            self.model.loss_fn(self.planned(*self.model.example_inputs)).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - started


def measured_samples_per_second(spec: str, fits: list, steps: int) -> dict:
    """``{micro-batch: samples per second}`` of each candidate in ``fits`` trained for real: the median of
    ``steps`` timed steps after :data:`WARMUP` untimed, the candidates' steps taken in turns (one each, then the
    next round), so that a shared machine's load falls on all of them alike."""
    trained = [Trained(spec, c) for c in fits]
    for _ in range(WARMUP):
        for run in trained:
            run.step()
    seconds = {run.candidate.batch: [] for run in trained}
    for _ in range(steps):
        for run in trained:
            seconds[run.candidate.batch].append(run.step())
    return {run.candidate.batch: run.candidate.batch * run.candidate.accumulate / statistics.median(
        seconds[run.candidate.batch]) for run in trained}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spec", nargs="?", default=GPT2_TINY)
    parser.add_argument("--device-memory", default="16MiB", help="the device's memory (default: 16MiB)")
    parser.add_argument("--threads", type=int, help="torch threads for the rates and the steps (default: torch's)")
    parser.add_argument("--steps", type=int, default=11, help="timed steps per micro-batch (default: 11)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    memory = parse_budget(args.device_memory, what="--device-memory")
    device = cpu_device_spec(memory)
    print(f"{device.name} at {torch.get_num_threads()} threads, {describe_bytes(memory)}: "
          f"{device.rates().describe()}")
    tried = plan_for_device(args.spec, device, "auto")
    chosen = best(tried)
    print(f"{'batch':>6} {'solver':<10} {'recomputed':>10} {'peak':>11} {'predicted/s':>12} {'measured/s':>11}")
    measured = measured_samples_per_second(args.spec, [c for c in tried if c.plan is not None], args.steps)
    for c in tried:
        if c.plan is None:
            print(f"{c.batch:>6} does not fit: {c.why}")
        else:
            print(f"{c.batch:>6} {c.plan.solver:<10} {c.plan.recomputed_forwards:>10} {format_bytes(c.peak):>11} "
                  f"{c.samples_per_second:>12.0f} {measured[c.batch]:>11.0f}")
    fastest = max(measured, key=measured.get)
    print(f"chosen micro-batch {chosen.batch}: measured {measured[chosen.batch]:.0f} samples/s; best measured "
          f"{measured[fastest]:.0f} at micro-batch {fastest}; chosen / best = "
          f"{measured[chosen.batch] / measured[fastest]:.3f}")


if __name__ == "__main__":
    main()
