"""How long ``fit`` takes to plan GPT-2 small on this CPU, phase by phase.

    python bench/fit_planning.py [--layers N] [--budget B] [--threads N] [--compare] [--cprofile FILE]

Builds Hugging Face ``GPT2LMHeadModel(GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257,
n_positions=256))`` with random weights (nothing downloaded), a batch of 2 × 256 token ids with labels, and
plans it as ``fit(model, batch, budget)`` does, timing each phase: ``discover`` (torch.export and the cut),
``stages`` (each stage measured), ``options`` (the stages' options measured), ``solve``; then ``fit`` itself,
whole, at an infeasible budget. Seconds are wall clock and process CPU time; the load average is printed too
(the machine is shared: wall clock moves with it; at ``--threads 1`` the CPU time is an idle core's wall clock).
Figures in docs/benchmarks.md, section "fit's planning time on GPT-2 small".
"""

import argparse
import cProfile
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import solvers  # noqa: E402
from planner.errors import MemschedError  # noqa: E402
from profiles import chain_profiler  # noqa: E402
from profiles.chain_profiler import profile_chain  # noqa: E402
from profiles.discover import discover, returned_loss  # noqa: E402
from profiles.fit import fit  # noqa: E402
from profiles.fit_budget import budget_bytes  # noqa: E402
from profiles.options import DEFAULT_OPTIONS  # noqa: E402

BATCH, SEQUENCE, VOCAB = 2, 256, 50257


def gpt2_small(layers: int):
    """``(model, batch)``: GPT-2 small (``layers`` layers, width 768) with random weights, training mode, and a
    batch of ``BATCH`` × ``SEQUENCE`` token ids with labels."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=layers, n_embd=768, n_head=12, vocab_size=VOCAB, n_positions=SEQUENCE)
    model = GPT2LMHeadModel(config).train()
    ids = torch.randint(0, VOCAB, (BATCH, SEQUENCE), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids.clone()}


def load() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


class Clock:
    """Wall-clock and process CPU seconds since it was made (CPU: both torch threads together, so on an idle
    machine the wall clock is between half of it and all of it; on a loaded one the CPU figure is the fair one)."""

    def __init__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def read(self) -> tuple:
        return time.perf_counter() - self.wall, time.process_time() - self.cpu


def phases(model, batch, budget, share: bool = True) -> dict:
    """``(wall, cpu)`` seconds per phase of planning ``model`` on ``batch`` for ``budget``, as fit plans (its
    defaults); ``share``: identical stages measured once (profiles/identical.py), else each on its own (as
    before issue 29)."""
    seconds = {"options": (0.0, 0.0)}
    measure_options = chain_profiler._Runner.with_options

    def timed_options(self, *args, **kwargs):  # the options' share of profiling
        clock = Clock()
        try:
            return measure_options(self, *args, **kwargs)
        finally:
            seconds["options"] = tuple(a + b for a, b in zip(seconds["options"], clock.read()))

    clock = Clock()
    discovery = discover(model, batch, name="gpt2-small")
    seconds["discover"] = clock.read()
    staged = discovery.staged
    chain_profiler._Runner.with_options = timed_options
    try:
        clock = Clock()
        chain = profile_chain(staged.stages, staged.example_inputs, loss_fn=returned_loss, warmup=1, repeats=3,
                              name=staged.name, options=DEFAULT_OPTIONS, share_identical=share)
        profiled = clock.read()
    finally:
        chain_profiler._Runner.with_options = measure_options
    seconds["stages"] = tuple(a - b for a, b in zip(profiled, seconds["options"]))
    clock = Clock()
    plan = solvers.solve(chain, budget_bytes(budget, chain), "auto")
    seconds["solve"] = clock.read()
    print(f"  {len(chain.stages)} stages; store-all peak {solvers.store_all_peak(chain) / 2**20:.1f} MiB; "
          f"{plan.solver} at {budget}: predicted peak {plan.predicted.peak_bytes / 2**20:.1f} MiB")
    return seconds


def whole_fit(model, batch, budget) -> str:
    """``fit`` at ``budget``, timed: its seconds (wall, CPU) and what came of it (the predicted peak, or the
    refusal)."""
    clock = Clock()
    try:
        fitted = fit(model, batch, budget)
        outcome = f"planned, predicted peak {fitted.predicted.peak_bytes / 2**20:.1f} MiB"
    except MemschedError as error:
        outcome = f"refused: {error}"
    wall, cpu = clock.read()
    return f"{wall:.1f} s wall, {cpu:.1f} s CPU, {outcome}"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--budget", default="80%", help="the budget planned for phase by phase (default 80%%)")
    parser.add_argument("--infeasible", default="50%", help="a budget below the least, given to fit whole")
    parser.add_argument("--cprofile", metavar="FILE", help="write cProfile statistics of the phases to FILE")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--compare", action="store_true",
                        help="then plan again with every stage measured on its own (identical ones too), as before")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, batch = gpt2_small(args.layers)
    print(f"GPT-2 small, {args.layers} layers, batch {BATCH} x {SEQUENCE}; torch threads "
          f"{torch.get_num_threads()}; load average before: {load()}", flush=True)
    print(f"fit(..., {args.infeasible!r}): {whole_fit(model, batch, args.infeasible)}; load average {load()}",
          flush=True)
    for share in (True, False) if args.compare else (True,):
        profiler = cProfile.Profile() if args.cprofile else None
        if profiler:
            profiler.enable()
        seconds = phases(model, batch, args.budget, share)
        if profiler:
            profiler.disable()
            profiler.dump_stats(args.cprofile + ("" if share else ".unshared"))
        print(f"planned for {args.budget} with identical stages {'measured once' if share else 'each measured'}:")
        print(f"  {'phase':<10} {'wall s':>8} {'CPU s':>8}")
        for name, (wall, cpu) in seconds.items():
            print(f"  {name:<10} {wall:8.1f} {cpu:8.1f}")
        wall, cpu = (sum(values) for values in zip(*seconds.values()))
        print(f"  {'total':<10} {wall:8.1f} {cpu:8.1f}   (load average after: {load()})", flush=True)


if __name__ == "__main__":
    main()
