"""Budget benchmark: hierarchical plans (eager and compiled) against what users pick instead, at equal budgets.

    python bench/compile_budget.py [MODEL ...] [--budgets N] [--steps N] [--fractions F,F,...] [--no-compile]

For each model (default: gpt-tiny, mlp, resnet-tiny; ``gpt2`` is Hugging Face's GPT-2 cut by discovery), the
chain is profiled with its stage options, and at ``--budgets`` budgets from the least feasible (the
hierarchical solver's) to the plain step's peak, in one run:

* ``rotor``: Rotor's plan (stages whole), eager;
* ``hier``: the hierarchical solver's plan (each stage with one of its options), eager;
* ``hier+c``: the same plan with every stage call through ``torch.compile``;
* ``ckseq``: ``torch.utils.checkpoint.checkpoint_sequential`` at its fastest segment count whose measured peak
  fits (every count from 1 to the stage count measured once);
* ``tc``: ``torch.compile`` of the plain step at the fastest ``activation_memory_budget`` fraction of
  ``--fractions`` whose measured peak fits (one compile per fraction, counted; the fraction is of activation
  bytes, not of peak bytes, so a byte budget takes a sweep).

Peaks are what a step allocates plus its inputs: eager steps by the live-memory tracker, compiled ones by
torch.profiler's memory events (the tracker cannot see inside compiled code; the two are compared on the plain
eager step first and the ratio printed, and the hierarchical eager step's profiler peak is added to its cell
where it differs by more than 1%: the profiler also sees scratch memory inside kernels, convolutions' on
CPU). Each cell is ``peak / budget`` and the step time over the plain eager step's (medians of ``--steps``
steps, the variants of a budget interleaved step by step, on bench/executor.py's clock); ``-`` where the
variant has no plan or nothing it tried fits.
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from executor import Clock, load_average, pin_malloc  # noqa: E402 (bench/ is the script's folder)

from planner.errors import MemschedError  # noqa: E402
from planner.execute.chain import apply_plan  # noqa: E402
from planner.execute.stages import run_stages  # noqa: E402
from profiles.chain_profiler import profile_chain  # noqa: E402
from profiles.memory import memory_meter, storage_bytes  # noqa: E402
from profiles.options import DEFAULT_OPTIONS  # noqa: E402
from profiles.zoo import MODELS  # noqa: E402
from solvers import solve, store_all_peak  # noqa: E402
from solvers.minimum import minimum_budget  # noqa: E402

VARIANTS = ("rotor", "hier", "hier+c", "ckseq", "tc")
MIB = 2**20


def staged(name):
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        from profiles.discover import discover

        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=1000, n_positions=128,
                                           bos_token_id=0, eos_token_id=0)).train()
        ids = torch.randint(0, 1000, (8, 128), generator=torch.Generator().manual_seed(1))
        return discover(model, {"input_ids": ids, "labels": ids.clone()}, name="gpt2").staged
    return MODELS[name]()


class Step:
    """One training step of a variant: forward, loss, backward, gradients cleared first."""

    def __init__(self, forward, model, compiled: bool, fraction: float = None):
        self.forward, self.model, self.compiled, self.fraction = forward, model, compiled, fraction
        self.parameters = [p for _, m in model.stages for p in m.parameters()]
        self.inputs = storage_bytes([t for t in model.example_inputs if isinstance(t, torch.Tensor)])

    def __call__(self):
        for parameter in self.parameters:
            parameter.grad = None
        self.model.loss_fn(self.forward(*self.model.example_inputs)).backward()

    def peak(self) -> int:
        import torch._functorch.config as functorch_config

        # the fraction is read when it compiles, which it does here, outside the window
        with functorch_config.patch({} if self.fraction is None else {"activation_memory_budget": self.fraction}):
            self()
        for parameter in self.parameters:
            parameter.grad = None
        with memory_meter("cpu", self.compiled) as meter:
            self()
        return meter.peak + self.inputs


def checkpoint_sequential_step(model, segments: int):
    from torch.utils.checkpoint import checkpoint_sequential

    sequence = torch.nn.Sequential(*[module for _, module in model.stages])

    def forward(first, *extra):
        return checkpoint_sequential(sequence, segments, first, use_reentrant=False)

    return forward


def compiled_plain_step(model):
    """The plain step through one ``torch.compile`` (a new code object each time: compiled afresh, with the
    fraction :meth:`Step.peak` sets)."""
    stages = list(model.stages)
    return torch.compile(eval("lambda *inputs: run_stages(stages, inputs)", {"run_stages": run_stages,
                                                                            "stages": stages}))


def timed(steps: dict, rounds: int, clock) -> dict:
    """Median seconds of each step, the steps interleaved round by round (one untimed round first)."""
    samples = {name: [] for name in steps}
    for round_ in range(rounds + 1):
        for name, step in steps.items():
            seconds = clock.seconds(step)
            if round_:
                samples[name].append(seconds)
    return {name: statistics.median(values) for name, values in samples.items()}


def predicted_sweep(chain, points: int = 10) -> list:
    """The simulator's overheads of rotor and hierarchical at ``points`` budgets from rotor's least feasible to
    the store-all peak, and their mean over the budgets between 30% and 70% of that range."""
    low, high = minimum_budget(chain), store_all_peak(chain)
    rows, middle = [], []
    for k in range(points):
        budget = int(low + (high - low) * k / (points - 1))
        rotor, hier = (solve(chain, budget, solver).predicted.overhead for solver in ("rotor", "hierarchical"))
        rows.append(f"{budget / MIB:.2f}: {rotor:.3f} / {hier:.3f}")
        if 0.3 <= k / (points - 1) <= 0.7:
            middle.append((rotor, hier))
    rotor_mean = statistics.mean(r for r, _ in middle)
    hier_mean = statistics.mean(h for _, h in middle)
    return [f"predicted overhead, rotor / hierarchical, MiB: {'; '.join(rows)}",
            f"mean over 30-70% of the range: rotor {rotor_mean:.3f}, hierarchical {hier_mean:.3f} "
            f"({1 - hier_mean / rotor_mean:.0%} lower); least feasible: rotor {low / MIB:.2f} MiB, "
            f"hierarchical {minimum_budget(chain, options=True) / MIB:.2f} MiB"]


def bench_model(name: str, args, clock) -> list:
    model = staged(name)
    chain = profile_chain(model.stages, model.example_inputs, loss_fn=model.loss_fn, name=name,
                          options=args.options)
    plain = Step(lambda *xs: run_stages(model.stages, xs), model, False)
    eager_plain, profiled_plain = plain.peak(), None
    plain.compiled = True
    profiled_plain = plain.peak()
    plain.compiled = False
    lines = [f"## {name}: {chain.length} stages, {sum(len(s.options) for s in chain.stages)} options; plain step "
             f"peak {eager_plain / MIB:.2f} MiB (torch.profiler / tracker on it: {profiled_plain / eager_plain:.4f})"]
    lines += predicted_sweep(chain)
    if args.predicted_only:
        return lines
    low, high = minimum_budget(chain, options=True), store_all_peak(chain)
    budgets = [int(low + (high - low) * k / max(1, args.budgets - 1)) for k in range(args.budgets)]
    sequential = {}
    for segments in range(1, chain.length + 1) if len(model.example_inputs) == 1 else ():  # one input only
        step = Step(checkpoint_sequential_step(model, segments), model, False)
        sequential[segments] = (step.peak(), step)
    fractions = {}
    if not args.no_compile:
        for fraction in args.fractions:
            step = Step(compiled_plain_step(model), model, True, fraction)
            fractions[fraction] = (step.peak(), step)
    header = "| budget MiB | " + " | ".join(VARIANTS) + " |"
    lines += [f"rotor's least feasible budget {minimum_budget(chain) / MIB:.2f} MiB, hierarchical's {low / MIB:.2f} "
              f"MiB; torch.compile: {len(fractions)} compiles ({', '.join(map(str, args.fractions))}), peaks "
              + ", ".join(f"{f}: {p / MIB:.2f}" for f, (p, _) in fractions.items()) + " MiB", "", header,
              "|" + "---|" * (len(VARIANTS) + 1)]
    wins = []
    for budget in budgets:
        steps, peaks, notes = {"plain": plain}, {}, {}
        for solver, variant in (("rotor", "rotor"), ("hierarchical", "hier")):
            try:
                plan = solve(chain, budget, solver)
            except MemschedError:
                continue
            steps[variant] = Step(apply_plan(model.stages, plan, chain), model, False)
            if variant == "hier" and not args.no_compile:
                steps["hier+c"] = Step(apply_plan(model.stages, plan, chain, compile=True), model, True)
        for variant in [v for v in ("rotor", "hier", "hier+c") if v in steps]:
            peaks[variant] = steps[variant].peak()
        if "hier" in steps:  # the same eager step by the compiled steps' meter (it also sees kernels' scratch)
            steps["hier"].compiled = True
            profiled = steps["hier"].peak()
            steps["hier"].compiled = False
            if abs(profiled / peaks["hier"] - 1) > 0.01:
                notes["hier"] = f" (torch.profiler: {profiled / budget:.3f})"
        for variant, tried, label in (("ckseq", sequential, "{} seg"), ("tc", fractions, "f={}")):
            fitting = {setting: step for setting, (peak, step) in tried.items() if peak <= budget}
            if fitting:  # the fastest setting whose measured peak fits
                times = timed(fitting, max(1, args.steps // 2), clock)
                best = min(times, key=times.get)
                steps[variant], peaks[variant] = fitting[best], tried[best][0]
                notes[variant] = f" ({label.format(best)})"
        times = timed(steps, args.steps, clock)
        cells = []
        for variant in VARIANTS:
            if variant not in steps:
                cells.append("-")
                continue
            cells.append(f"{peaks[variant] / budget:.3f} {times[variant] / times['plain']:.3f}{notes.get(variant, '')}")
        if "hier+c" in times and "tc" in times:
            wins.append(times["hier+c"] <= times["tc"])
        lines.append(f"| {budget / MIB:.2f} | " + " | ".join(cells) + " |")
    if wins:
        lines.append(f"compiled hierarchical at least as fast as torch.compile's budget at {sum(wins)} of the "
                     f"{len(wins)} budgets both fit")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*", default=["gpt-tiny", "mlp", "resnet-tiny"], metavar="MODEL")
    parser.add_argument("--budgets", type=int, default=8, help="budgets from the least feasible to the plain peak")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per variant, median kept (default 6)")
    parser.add_argument("--options", type=int, default=DEFAULT_OPTIONS, help="stage options measured per stage")
    parser.add_argument("--fractions", type=lambda text: [float(f) for f in text.split(",")],
                        default=[1.0, 0.7, 0.5, 0.3, 0.1, 0.0], help="activation_memory_budget fractions swept")
    parser.add_argument("--no-compile", action="store_true", help="leave out the compiled variants")
    parser.add_argument("--predicted-only", action="store_true", help="the predicted sweep only (no step run)")
    parser.add_argument("--wall-clock", action="store_true", help="time by wall clock (default: process CPU time)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    pinned = pin_malloc()
    clock = Clock("cpu", wall=args.wall_clock)
    print(f"torch {torch.__version__}, 1 thread, {clock.label}, fixed malloc thresholds: {pinned}, "
          f"load {load_average()}")
    for name in args.models:
        print("\n".join(bench_model(name, args, clock)))
        print()


if __name__ == "__main__":
    main()
