"""GPU check: memsched's executor on CUDA, in one short run (written to be run once on a borrowed GPU).

    python bench/gpu_check.py [SPEC] [--steps N] [--warmup N] [--budgets 25,50,75]

On ``cuda``, for one model (default: a gpt-tiny whose store-all peak is about 1 GiB, dropout on), after
profiling it there:

1. store-all: the profile's predicted peak and step time against the plain step's measured ones;
2. (a) executor overhead: the store_all plan through ``apply_plan`` against the plain step, and their peaks;
3. rotor at 25%, 50% and 75% of the store-all peak: measured against predicted peak and step time, the
   measured overhead over the plain step against the predicted one, and the largest gradient difference
   from the plain step (same seed, so dropout draws the same masks);
4. (b), (c) as bench/executor.py: checkpoint_sequential for every segment count, and rotor at the measured
   peak of the fastest one within 2-3 budgets.

Times are CUDA events around each step (median of ``--steps`` after ``--warmup``); peaks are
``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, minus what was allocated before the
step, plus the inputs' bytes (as on CPU). Gradients are set to None and the seed reset before each step.
Without CUDA it prints one line and exits with status 2; a check that fails prints its traceback, the
others still run, and the exit status is 1. Expected to take about a minute on an H200 (most of it loading
torch, initialising CUDA and compiling the Rotor kernel with numba).
"""

import argparse
import importlib.util
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# Before numba loads (solvers): its default OpenMP threads spin after each Rotor solve, taking the CPU
# that launches the GPU's kernels; workqueue threads sleep instead.
os.environ.setdefault("NUMBA_THREADING_LAYER", "workqueue")

import torch  # noqa: E402

from planner.errors import MemschedError  # noqa: E402
from planner.executor import apply_plan  # noqa: E402
from profiles.chain_profiler import profile_chain  # noqa: E402
from solvers import solve, store_all_peak  # noqa: E402
from solvers.minimum import minimum_budget  # noqa: E402


def _load_bench_executor():
    """bench/executor.py, loaded by path (bench/ is not a package)."""
    path = Path(__file__).resolve().parent / "executor.py"
    spec = importlib.util.spec_from_file_location("memsched_bench_executor", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench_executor = _load_bench_executor()

# Store-all peak about 1.15 GiB (activations about 1 GiB, parameter gradients 86 MiB); the least feasible
# budget is about 16% of it, so 25% leaves rotor room. (The suggested layers=12,d=1024,heads=16,seq=512,
# vocab=8192,batch=8 peaks at about 8.3 GiB; with seq=256,batch=4 at 1.5 GiB, but its 0.63 GiB of parameter
# gradients put the least feasible budget at 58% of the peak.)
DEFAULT_SPEC = "gpt-tiny:layers=12,d=384,heads=6,seq=512,vocab=2048,batch=3"
GIB = 2 ** 30
MIB = 2 ** 20


class CudaEvents:
    """Step seconds by CUDA events; peak bytes by the allocator's statistics."""

    def __init__(self, device):
        self.device = torch.device(device)

    def synchronize(self):
        torch.cuda.synchronize(self.device)

    def seconds(self, work) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(self.device)
        start.record()
        work()
        end.record()
        torch.cuda.synchronize(self.device)
        return start.elapsed_time(end) / 1000.0

    def allocated_peak(self, work) -> int:
        """Peak bytes ``work()`` allocates above what was allocated when it started."""
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        work()
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - before


def mib(count) -> str:
    return f"{count / MIB:.1f}"


def ms(seconds) -> str:
    return f"{seconds * 1e3:.2f}"


class Checks:
    """The checks on one model; each records its verdict lines, a failing one its traceback."""

    def __init__(self, spec, device, measure, steps, warmup, fractions):
        self.spec, self.device, self.fractions = spec, device, fractions
        self.model = bench_executor.load(spec, device)
        self.bench = bench_executor.Bench(self.model, measure, steps, warmup)
        self.chain = None
        self.reference = None
        self.summary = []
        self.failures = 0

    def section(self, title, function):
        print(f"\n== {title}", flush=True)
        started = time.perf_counter()
        try:
            function()
        except Exception:  # a borrowed machine runs this once: report, and go on with the other checks
            self.failures += 1
            traceback.print_exc(file=sys.stdout)
            self.summary.append(f"{title}: FAILED (traceback above)")
        print(f"   ({time.perf_counter() - started:.1f} s)", flush=True)

    def profile(self):
        started = time.perf_counter()
        self.chain = profile_chain(self.model.stages, self.model.example_inputs, loss_fn=self.model.loss_fn,
                                   name=self.model.name, device=self.device, repeats=5)
        peak, least = store_all_peak(self.chain), minimum_budget(self.chain)
        print(f"{self.spec}: {self.chain.length} stages, profiled in {time.perf_counter() - started:.1f} s")
        print(f"store-all peak predicted {peak} bytes ({peak / GIB:.3f} GiB), of which parameter gradients "
              f"{mib(sum(s.param_bytes for s in self.chain.stages))} MiB; least feasible budget {mib(least)} MiB "
              f"({least / peak:.0%}); step {ms(self.chain.compute_time)} ms predicted")
        if not 0.75 * GIB <= peak <= 1.5 * GIB:
            print(f"note: the store-all peak is {peak / GIB:.2f} GiB, not about 1 GiB as intended")
        self.reference = self.bench.grads(self.bench.plain)

    def store_all(self):
        peak = self.bench.peak(self.bench.plain)
        seconds = self.bench.times({"plain": self.bench.plain})["plain"]
        predicted_peak, predicted_s = store_all_peak(self.chain), self.chain.compute_time
        print(f"plain step measured: peak {mib(peak)} MiB, {ms(seconds)} ms; predicted {mib(predicted_peak)} MiB, "
              f"{ms(predicted_s)} ms; measured / predicted: peak {peak / predicted_peak:.4f}, "
              f"time {seconds / predicted_s:.3f}")
        self.summary.append(f"store-all measured / predicted: peak {peak / predicted_peak:.4f}, "
                            f"time {seconds / predicted_s:.3f}")

    def overhead(self):
        row = bench_executor.overhead(self.bench, self.chain)
        plan = solve(self.chain, store_all_peak(self.chain), "store_all")
        worst, relative = bench_executor.grad_difference(
            self.reference, self.bench.grads(self.bench.planned(apply_plan(self.model.stages, plan, self.chain))))
        print(f"plain {ms(row['plain_s'])} ms, store_all through apply_plan {ms(row['planned_s'])} ms: "
              f"ratio {row['ratio']:.3f} (target <= 1.03)")
        print(f"peaks: plain {mib(row['plain_peak'])} MiB, store_all plan {mib(row['planned_peak'])} MiB, "
              f"predicted {mib(row['predicted_peak'])} MiB; gradients vs plain: max |diff| {worst:.2e} "
              f"(relative {relative:.1e})")
        self.summary.append(f"(a) executor store_all / plain step time {row['ratio']:.3f} "
                            f"({'met' if row['ratio'] <= 1.03 else 'MISSED'}: target <= 1.03); "
                            f"peak store_all plan / plain {row['planned_peak'] / row['plain_peak']:.4f}; "
                            f"gradient relative difference {relative:.1e}")

    def budgets(self):
        peak = store_all_peak(self.chain)
        print(f"{'budget':>7} {'MiB':>8} {'meas MiB':>9} {'pred MiB':>9} {'peak m/p':>8} {'in budget':>9} "
              f"{'meas ms':>8} {'pred ms':>8} {'time m/p':>8} {'ovh meas':>8} {'ovh pred':>8} {'recomp':>6} "
              f"{'max|dgrad|':>10} {'rel':>8}")
        peak_ratios, time_ratios, relatives, over, ran = [], [], [], 0, []
        for fraction in self.fractions:
            budget = int(peak * fraction)
            try:
                plan = solve(self.chain, budget, "rotor")
            except MemschedError as exc:
                print(f"{fraction:>7.0%} {mib(budget):>8}  rotor: {exc}")
                self.summary.append(f"rotor at {fraction:.0%}: infeasible ({exc})")
                continue
            planned = self.bench.planned(apply_plan(self.model.stages, plan, self.chain))
            measured_peak = self.bench.peak(planned)
            times = self.bench.times({"plain": self.bench.plain, "rotor": planned})
            worst, relative = bench_executor.grad_difference(self.reference, self.bench.grads(planned))
            peak_ratio, time_ratio = measured_peak / plan.predicted.peak_bytes, times["rotor"] / plan.predicted.time
            ran.append(fraction)
            peak_ratios.append(peak_ratio)
            time_ratios.append(time_ratio)
            relatives.append(relative)
            over += measured_peak > budget
            print(f"{fraction:>7.0%} {mib(budget):>8} {mib(measured_peak):>9} {mib(plan.predicted.peak_bytes):>9} "
                  f"{peak_ratio:8.4f} {'yes' if measured_peak <= budget else 'NO':>9} {ms(times['rotor']):>8} "
                  f"{ms(plan.predicted.time):>8} {time_ratio:8.3f} {times['rotor'] / times['plain'] - 1:8.1%} "
                  f"{plan.predicted.overhead:8.1%} {plan.recomputed_forwards:>6} {worst:10.2e} {relative:8.1e}")
        if peak_ratios:
            self.summary.append(
                f"rotor at {', '.join(f'{f:.0%}' for f in ran)}: measured / predicted peak "
                f"{bench_executor.span(peak_ratios, 4)}, time {bench_executor.span(time_ratios)}; measured peak "
                f"above the budget in {over}/{len(peak_ratios)}; largest gradient relative difference "
                f"{max(relatives):.1e}")

    def segments(self):
        swept = bench_executor.sweep(self.bench)
        bench_executor.print_sweep(swept)
        rows = bench_executor.compare(self.bench, self.chain, swept, self.reference, slots=10000)
        bench_executor.print_compare(rows)
        done = [row for row in rows if "error" not in row]
        ratios = [row["rotor_s"] / row["cs_s"] for row in done]
        self.summary.append(
            f"(b) rotor / checkpoint_sequential at equal measured peak: {bench_executor.span(ratios)} over "
            f"{len(done)} budgets, below 1 in {sum(r < 1 for r in ratios)}/{len(done)}; rotor's peak within "
            f"checkpoint_sequential's in {sum(row['rotor_peak'] <= row['cs_peak'] for row in done)}/{len(done)}"
            + (f"; rotor infeasible at {len(rows) - len(done)}" if len(rows) > len(done) else ""))
        if done:
            self.summary.append(
                f"(c) rotor measured / predicted: time {bench_executor.span([r['rotor_s'] / r['predicted_s'] for r in done])}"
                f", peak {bench_executor.span([r['rotor_peak'] / r['predicted_peak'] for r in done], 4)}")

    def run(self):
        self.section("profile on the device", self.profile)
        if self.chain is None:
            return
        self.section("store-all: plain step against the profile", self.store_all)
        self.section("(a) executor overhead: store_all plan vs plain step", self.overhead)
        self.section(f"rotor at {', '.join(f'{f:.0%}' for f in self.fractions)} of the store-all peak", self.budgets)
        self.section("(b), (c) rotor vs checkpoint_sequential at equal measured peak", self.segments)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spec", nargs="?", default=DEFAULT_SPEC, metavar="SPEC")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per measurement, median kept (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    parser.add_argument("--budgets", default="25,50,75", help="rotor budgets, percent of the store-all peak")
    args = parser.parse_args()
    try:
        fractions = [float(text) / 100 for text in args.budgets.split(",")]
    except ValueError:
        parser.error(f"--budgets: expected percentages such as 25,50,75, got {args.budgets!r}")
    if args.steps < 1 or args.warmup < 0 or not all(0 < f <= 1 for f in fractions):
        parser.error("--steps must be >= 1, --warmup >= 0, budgets in (0, 100]")
    if not torch.cuda.is_available():
        print("bench/gpu_check.py: CUDA is not available on this machine (torch "
              f"{torch.__version__}, built with CUDA {torch.version.cuda}); nothing was measured", file=sys.stderr)
        sys.exit(2)
    started = time.perf_counter()
    device = torch.device("cuda", torch.cuda.current_device())
    properties = torch.cuda.get_device_properties(device)
    print(f"gpu check on {torch.cuda.get_device_name(device)} ({properties.total_memory / GIB:.0f} GiB), "
          f"torch {torch.__version__}, CUDA {torch.version.cuda}; median of {args.steps} steps after {args.warmup}, "
          f"CUDA events; peaks from max_memory_allocated")
    checks = Checks(args.spec, device, CudaEvents(device), args.steps, args.warmup, fractions)
    checks.run()
    print("\nsummary")
    for line in checks.summary:
        print(line)
    print(f"total {time.perf_counter() - started:.0f} s; {checks.failures} check(s) failed")
    sys.exit(1 if checks.failures else 0)


if __name__ == "__main__":
    main()
