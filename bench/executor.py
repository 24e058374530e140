"""Executor benchmark: memsched's executor against the plain model and against torch's checkpoint_sequential.

    python bench/executor.py [SPEC ...] [--steps N] [--warmup N] [--device cpu|cuda] [--threads N] [--adaptive-malloc]

For each model (default: the built-in models at their default sizes), in one run, after profiling it:

(a) overhead: the store_all plan run through ``apply_plan`` against the plain step
    (``loss_fn(stages in order).backward()``); median step time of ``--steps`` steps after
    ``--warmup``, the two interleaved step by step (target: ratio <= 1.03), and both measured peaks;
(b) equal memory: ``torch.utils.checkpoint.checkpoint_sequential(nn.Sequential(*modules), s, input,
    use_reentrant=False)`` for every segment count s = 1..L (measured peak, step time); at budgets B =
    the measured peaks of s = 2, 4 and round(sqrt(L)) (and s = L when these coincide), the fastest
    segment count s* whose peak is within B is compared with rotor solved for s*'s peak (target: rotor /
    checkpoint_sequential time < 1). Rotor's budget is s*'s measured peak, or the simulator's peak for
    s*'s own schedule when that is higher (by a few bytes to 0.2% here: torch frees a few tensors earlier
    than the model says), so that both schedules are judged by one model; the table shows both measured
    peaks. ``--slots`` (default 10000: these chains are short) is rotor's discretisation;
(c) for each rotor plan run: measured / predicted step time and peak, and the largest gradient
    difference from the plain step (same seed).

Peaks count as ``profiles.reference_step.measured_peak`` does: the inputs plus everything the step
allocates (live-memory tracker on CPU, the CUDA allocator's statistics on a GPU). Times are the process's
CPU time on CPU with one thread (see ``Clock``; ``--wall-clock`` for wall clock), wall clock synchronised
on CUDA. Every step starts with gradients set to None and the same seed. Parts (b) and (c)
need stages that are modules taking only the activation (no extra inputs); other models get (a) only.

On CPU torch runs one thread unless ``--threads`` says otherwise: when other processes share the cores,
OpenMP's spinning threads make a 2-thread step 20-50x slower, and erratically, which no median survives;
one thread keeps the ratios meaningful on a shared machine (``--threads 2`` on a quiet one). The header
and the last line print the load average. glibc's malloc gets fixed thresholds (``--adaptive-malloc`` to
keep its default): see ``pin_malloc``. Even so, single steps on a shared VM vary by a few percent (cache
and memory bandwidth are shared too): the steps compared are interleaved, but read differences of a few
percent as noise.
bench/gpu_check.py runs the same checks on a GPU with CUDA events.
"""

import argparse
import ctypes
import ctypes.util
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# Before numba loads (solvers): its default OpenMP threads keep spinning after each Rotor solve and, for
# seconds on a busy machine, slow the torch steps timed next by up to 20x; workqueue threads sleep instead.
os.environ.setdefault("NUMBA_THREADING_LAYER", "workqueue")

import torch  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402
from torch.utils.checkpoint import checkpoint_sequential  # noqa: E402

from planner.errors import MemschedError  # noqa: E402
from planner.execute.chain import apply_plan  # noqa: E402
from planner.simulate.chain import ChainSimulator  # noqa: E402
from profiles.chain_profiler import profile_chain  # noqa: E402
from profiles.memory import memory_meter, storage_bytes  # noqa: E402
from profiles.spec import load_model  # noqa: E402
from solvers import solve, store_all_peak  # noqa: E402
from solvers.sqrt import checkpoint_sequential_bounds, segments_schedule  # noqa: E402

DEFAULT_SPECS = ["mlp", "gpt-tiny", "resnet-tiny"]
SEED = 0
MIB = 2 ** 20


# --------------------------------------------------------------------------------------------------
# Measuring


class Clock:
    """Seconds of a step and peaks by ``memory_meter``.

    On CUDA: wall clock, synchronised. On CPU: the process's CPU time (``time.process_time``) by default, the
    wall clock with ``--wall-clock``. With one torch thread the step runs on the calling thread (autograd's
    CPU work included), so its CPU time is its compute time, and time the scheduler gives to other processes
    on a shared machine is not counted, where a wall clock counts it (this machine's other jobs made wall
    clock medians vary by up to 30% between identical steps).
    """

    def __init__(self, device, wall=False):
        self.device = torch.device(device)
        self.now = time.perf_counter if wall or self.device.type == "cuda" else time.process_time

    @property
    def label(self) -> str:
        return "wall clock" if self.now is time.perf_counter else "process CPU time"

    def synchronize(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def seconds(self, work) -> float:
        self.synchronize()
        started = self.now()
        work()
        self.synchronize()
        return self.now() - started

    def allocated_peak(self, work) -> int:
        """Peak bytes ``work()`` allocates above what existed when it started."""
        with memory_meter(self.device) as meter:
            start = meter.current
            work()
            self.synchronize()
            return meter.peak - start


def load(spec, device):
    """The model ``spec`` names, built on ``device`` (so that targets closed over by its loss are there too)."""
    with torch.device(device):
        model, _ = load_model(spec)
    model.stages = [(name, module.to(device) if isinstance(module, torch.nn.Module) else module)
                    for name, module in model.stages]
    model.example_inputs = tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in model.example_inputs)
    if model.loss_fn is None:
        model.loss_fn = lambda out: [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)][0].float().mean()
    return model


class Bench:
    """Steps of one model (plain, planned, checkpoint_sequential) and how they are measured."""

    def __init__(self, model, measure, steps, warmup):
        self.model, self.measure, self.steps, self.warmup = model, measure, steps, warmup
        self.modules = [module for _, module in model.stages]
        self.parameters = [p for m in self.modules if isinstance(m, torch.nn.Module) for p in m.parameters()]
        self.input_bytes = storage_bytes([t for t in tree_flatten(model.example_inputs)[0]
                                          if isinstance(t, torch.Tensor)])
        self.sequential = torch.nn.Sequential(*self.modules) if self.single_input() else None

    def single_input(self) -> bool:
        return len(self.model.example_inputs) == 1 and all(isinstance(m, torch.nn.Module) for m in self.modules)

    # The steps. No step keeps a reference to the model's output across backward().

    def plain(self):
        self.model.loss_fn(self._plain_forward()).backward()

    def _plain_forward(self):
        activation, extra = self.model.example_inputs[0], self.model.example_inputs[1:]
        for module in self.modules:
            activation = module(activation, *extra)
        return activation

    def planned(self, planned):
        return lambda: self.model.loss_fn(planned(*self.model.example_inputs)).backward()

    def segments(self, count):
        def step():
            self.model.loss_fn(checkpoint_sequential(self.sequential, count, self.model.example_inputs[0],
                                                     use_reentrant=False)).backward()
        return step

    # Measurements: every step starts with gradients None and the same seed.

    def _fresh(self):
        for parameter in self.parameters:
            parameter.grad = None
        torch.manual_seed(SEED)

    def peak(self, step) -> int:
        """Measured peak bytes of one step: the inputs plus what it allocates."""
        self._fresh()
        peak = self.measure.allocated_peak(step)
        self._fresh()
        return peak + self.input_bytes

    def times(self, steps: dict, count=None, warmup=None) -> dict:
        """``{name: median seconds}``, the steps interleaved (order alternating) to share the machine's drift."""
        count = self.steps if count is None else count
        warmup = self.warmup if warmup is None else warmup
        samples = {name: [] for name in steps}
        names = list(steps)
        for run in range(warmup + count):
            for name in names if run % 2 == 0 else reversed(names):
                self._fresh()
                seconds = self.measure.seconds(steps[name])
                if run >= warmup:
                    samples[name].append(seconds)
        self._fresh()
        self.last_samples = samples
        return {name: statistics.median(values) for name, values in samples.items()}

    def grads(self, step) -> list:
        self._fresh()
        step()
        grads = [None if p.grad is None else p.grad.detach().clone() for p in self.parameters]
        self._fresh()
        return grads


def grad_difference(reference, other) -> tuple:
    """(largest absolute difference, that divided by the largest absolute reference gradient)."""
    worst, scale = 0.0, 0.0
    for a, b in zip(reference, other):
        if (a is None) != (b is None):
            return math.inf, math.inf
        if a is not None:
            worst = max(worst, (a - b).abs().max().item())
            scale = max(scale, a.abs().max().item())
    return worst, worst / scale if scale else worst


# --------------------------------------------------------------------------------------------------
# The three parts


def overhead(bench, chain) -> dict:
    """(a) The store_all plan through the executor against the plain step."""
    plan = solve(chain, store_all_peak(chain), "store_all")
    planned = bench.planned(apply_plan(bench.model.stages, plan, chain))
    # "again" is the plain step timed a second time in the same loop: its ratio to "plain" is the harness's
    # noise floor (an A/A control), against which the planned step's ratio can be read.
    def again():
        bench.plain()

    times = bench.times({"plain": bench.plain, "store_all": planned, "again": again})
    fastest = {name: min(values) for name, values in bench.last_samples.items()}
    return dict(plain_s=times["plain"], planned_s=times["store_all"], ratio=times["store_all"] / times["plain"],
                fastest_ratio=fastest["store_all"] / fastest["plain"], control=times["again"] / times["plain"],
                plain_peak=bench.peak(bench.plain), planned_peak=bench.peak(planned),
                predicted_peak=plan.predicted.peak_bytes, predicted_s=plan.predicted.time)


def sweep(bench) -> dict:
    """``{s: (measured peak, seconds)}`` for checkpoint_sequential with s = 1..L segments.

    These times only pick the fastest segment count within a budget (which is then timed again, interleaved
    with rotor): half the steps, one warm-up, to keep the run short.
    """
    result = {}
    for count in range(1, len(bench.modules) + 1):
        step = bench.segments(count)
        result[count] = (bench.peak(step), bench.times({"s": step}, count=max(3, bench.steps // 2),
                                                       warmup=min(1, bench.warmup))["s"])
    return result


def budget_segments(length) -> list:
    """Segment counts whose peaks are the budgets: 2, round(sqrt(L)), 4; and L when fewer than 3 differ."""
    counts = sorted({min(length, s) for s in (2, round(math.sqrt(length)), 4)})
    if len(counts) < 3 and length not in counts:
        counts.append(length)
    return counts


def compare(bench, chain, swept, reference_grads, slots) -> list:
    """(b) and (c): at each budget, the fastest checkpoint_sequential within it against rotor at its peak."""
    rows = []
    simulator = ChainSimulator(chain)
    for budget_count in budget_segments(len(bench.modules)):
        budget = swept[budget_count][0]
        fitting = [s for s, (peak, _) in swept.items() if peak <= budget]
        best = min(fitting, key=lambda s: swept[s][1])
        length = len(bench.modules)
        modelled = simulator.run(segments_schedule(length, best, checkpoint_sequential_bounds(length, best)))
        row = dict(budget_count=budget_count, budget=budget, best=best, cs_peak=swept[best][0],
                   cs_predicted_peak=modelled.peak_bytes, cs_predicted_s=modelled.time)
        try:
            plan = solve(chain, max(row["cs_peak"], row["cs_predicted_peak"]), "rotor", slots=slots)
        except MemschedError as exc:
            row["error"] = str(exc)
            rows.append(row)
            continue
        planned = bench.planned(apply_plan(bench.model.stages, plan, chain))
        times = bench.times({"plain": bench.plain, "cs": bench.segments(best), "rotor": planned})
        row.update(plain_s=times["plain"], cs_s=times["cs"], rotor_s=times["rotor"], rotor_peak=bench.peak(planned),
                   predicted_peak=plan.predicted.peak_bytes, predicted_s=plan.predicted.time,
                   predicted_overhead=plan.predicted.overhead, recomputed=plan.recomputed_forwards)
        row["grad_diff"], row["grad_rel"] = grad_difference(reference_grads, bench.grads(planned))
        rows.append(row)
    return rows


# --------------------------------------------------------------------------------------------------
# Printing


def mib(count) -> str:
    return f"{count / MIB:.2f}"


def ms(seconds) -> str:
    return f"{seconds * 1e3:.1f}"


def print_overhead(row):
    print("  (a) executor overhead: store_all plan through apply_plan vs the plain step")
    print(f"      {'plain ms':>9} {'planned ms':>10} {'ratio':>7} {'fastest':>7} {'A/A':>6} {'pred ms':>8}   "
          f"{'plain MiB':>9} {'planned MiB':>11} {'pred MiB':>9}")
    print(f"      {ms(row['plain_s']):>9} {ms(row['planned_s']):>10} {row['ratio']:7.3f} {row['fastest_ratio']:7.3f} "
          f"{row['control']:6.3f} "
          f"{ms(row['predicted_s']):>8}   "
          f"{mib(row['plain_peak']):>9} {mib(row['planned_peak']):>11} {mib(row['predicted_peak']):>9}")


def print_sweep(swept):
    print("  (b) checkpoint_sequential(s segments) sweep, s: measured MiB / ms (half the steps)")
    cells = [f"{s:>3}: {mib(peak):>7} / {ms(seconds):>6}" for s, (peak, seconds) in swept.items()]
    for start in range(0, len(cells), 4):
        print("      " + "   ".join(cells[start:start + 4]))


def print_compare(rows):
    print("  (b) at budget B = the measured peak of checkpoint_sequential(s=k): the fastest segment count s* within B,"
          " against rotor solved for s*'s peak (the larger of measured and simulated);")
    print("      in the model: checkpoint_sequential(s*)'s schedule simulated (pred-meas: its simulated peak minus its"
          " measured one), and rotor's predicted time over it")
    print(f"      {'B':>5} {'s*':>3} {'cs MiB':>8} {'rotor MiB':>9} {'cs ms':>7} {'rotor ms':>8} {'rotor/cs':>8}"
          f"   in the model: {'cs MiB':>8} {'pred-meas':>10} {'cs ms':>7} {'rotor/cs':>8}")
    for row in rows:
        head = f"      {'s=' + str(row['budget_count']):>5} {row['best']:>3} {mib(row['cs_peak']):>8}"
        model = (f"{mib(row['cs_predicted_peak']):>8} {row['cs_predicted_peak'] - row['cs_peak']:>+10d} "
                 f"{ms(row['cs_predicted_s']):>7}")
        if "error" in row:
            print(f"{head} {'-':>9} {'-':>7} {'-':>8} {'-':>8}                  {model} {'-':>8}  "
                  f"rotor: {row['error']}")
            continue
        flag = "" if row["rotor_peak"] <= row["cs_peak"] else \
            f"  rotor's peak is {row['rotor_peak'] / row['cs_peak'] - 1:.3%} above cs's"
        print(f"{head} {mib(row['rotor_peak']):>9} {ms(row['cs_s']):>7} {ms(row['rotor_s']):>8} "
              f"{row['rotor_s'] / row['cs_s']:8.3f}                  {model} "
              f"{row['predicted_s'] / row['cs_predicted_s']:8.3f}{flag}")
    print("  (c) rotor measured / predicted (overhead: step time over the plain step's, measured in the same loop)")
    print(f"      {'B':>5} {'pred MiB':>9} {'peak m/p':>8} {'pred ms':>8} {'time m/p':>8} {'overhead m':>10} "
          f"{'overhead p':>10} {'recomp':>6} {'max|dgrad|':>10} {'rel':>8}")
    for row in rows:
        if "error" in row:
            continue
        print(f"      {'s=' + str(row['budget_count']):>5} {mib(row['predicted_peak']):>9} "
              f"{row['rotor_peak'] / row['predicted_peak']:8.4f} {ms(row['predicted_s']):>8} "
              f"{row['rotor_s'] / row['predicted_s']:8.3f} {row['rotor_s'] / row['plain_s'] - 1:10.1%} "
              f"{row['predicted_overhead']:10.1%} {row['recomputed']:>6} {row['grad_diff']:10.2e} "
              f"{row['grad_rel']:8.1e}")


def span(values, digits=3, percent=False) -> str:
    if not values:
        return "none"
    text = (lambda v: f"{v:.{digits}%}") if percent else (lambda v: f"{v:.{digits}f}")
    return f"{text(min(values))} to {text(max(values))}" if len(values) > 1 else text(values[0])


def print_summary(results):
    print("\nsummary")
    ratios = [(name, r["overhead"]["ratio"]) for name, r in results]
    worst = max(ratio for _, ratio in ratios)
    fastest = ", ".join(f"{name} {r['overhead']['fastest_ratio']:.3f}" for name, r in results)
    control = ", ".join(f"{name} {r['overhead']['control']:.3f}" for name, r in results)
    print("(a) executor store_all / plain step time (medians): "
          + ", ".join(f"{name} {ratio:.3f}" for name, ratio in ratios)
          + f"; worst {worst:.3f} (target <= 1.03: {'met' if worst <= 1.03 else 'MISSED'}); fastest steps: {fastest}; "
            f"A/A control, the plain step against itself in the same loop: {control}")
    rows = [row for _, r in results for row in r.get("compare", []) if "error" not in row]
    failed = [row for _, r in results for row in r.get("compare", []) if "error" in row]
    if rows or failed:
        time_ratios = [row["rotor_s"] / row["cs_s"] for row in rows]
        below = sum(ratio < 1 for ratio in time_ratios)
        within = sum(row["rotor_peak"] <= row["cs_peak"] for row in rows)
        excess = max([row["rotor_peak"] / row["cs_peak"] - 1 for row in rows] + [0.0])
        geomean = math.exp(statistics.fmean(math.log(r) for r in time_ratios)) if time_ratios else float("nan")
        model = [row["predicted_s"] / row["cs_predicted_s"] for row in rows]
        print(f"(b) rotor / checkpoint_sequential step time at equal peak: {span(time_ratios)} "
              f"(geometric mean {geomean:.3f}) over {len(rows)} budgets; below 1 in {below}/{len(rows)} "
              f"(target < 1); in the model {span(model)}; rotor's measured peak within checkpoint_sequential's in "
              f"{within}/{len(rows)} (at most {excess:.3%} above)"
              + (f"; rotor infeasible at {len(failed)} of {len(rows) + len(failed)} budgets" if failed else ""))
        if rows:
            print(f"(c) rotor measured / predicted: time "
                  f"{span([row['rotor_s'] / row['predicted_s'] for row in rows])}, "
                  f"peak {span([row['rotor_peak'] / row['predicted_peak'] for row in rows], 4)} "
                  f"over {len(rows)} plans; "
                  f"overhead over the plain step measured "
                  f"{span([row['rotor_s'] / row['plain_s'] - 1 for row in rows], 1, True)}"
                  f" vs predicted {span([row['predicted_overhead'] for row in rows], 1, True)}; "
                  f"largest relative gradient "
                  f"difference from the plain step {max(row['grad_rel'] for row in rows):.1e}")
        else:
            print("(c) no rotor plan ran")
    else:
        print("(b), (c) not run: no model with single-input stages")


# --------------------------------------------------------------------------------------------------


def run_model(spec, measure, device, steps, warmup, slots, overhead_only=False, profile_repeats=5) -> dict:
    model = load(spec, device)
    bench = Bench(model, measure, steps, warmup)
    started = time.perf_counter()
    chain = profile_chain(model.stages, model.example_inputs, loss_fn=model.loss_fn, name=model.name, device=device,
                          repeats=profile_repeats)
    profile_seconds = time.perf_counter() - started
    print(f"\n{spec}: {chain.length} stages on {device}, store-all peak predicted {mib(store_all_peak(chain))} MiB, "
          f"step {ms(chain.compute_time)} ms (profiled in {profile_seconds:.1f} s)")
    result = {"overhead": overhead(bench, chain)}
    print_overhead(result["overhead"])
    if overhead_only:
        return result
    if bench.sequential is None:
        print("  (b), (c) skipped: checkpoint_sequential needs stages that are modules taking only the activation")
        return result
    swept = sweep(bench)
    print_sweep(swept)
    result["compare"] = compare(bench, chain, swept, bench.grads(bench.plain), slots=slots)
    print_compare(result["compare"])
    return result


def pin_malloc() -> bool:
    """glibc: fixed mmap (32 MiB) and trim (1 GiB) thresholds instead of its adaptive ones; False elsewhere.

    By default glibc moves its thresholds as blocks come and go, returning memory to the system and faulting it
    back in later, at a cost that depends on which schedule ran before; on this project's VM those page faults
    were up to a quarter of a CPU step. Fixed thresholds make every variant reuse the same heap.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(libc.mallopt(m_mmap_threshold, 32 * MIB)) and bool(libc.mallopt(m_trim_threshold, 2 ** 30))
    except (OSError, AttributeError, TypeError):
        return False


def load_average() -> str:
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except (AttributeError, OSError):
        return "unknown"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("specs", nargs="*", default=DEFAULT_SPECS, metavar="SPEC")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per measurement, median kept (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default on cpu: 1; see above; on cuda: torch's default)")
    parser.add_argument("--slots", type=int, default=10000, help="rotor's memory slots (default 10000)")
    parser.add_argument("--overhead-only", action="store_true",
                        help="run part (a) only (more --steps for it: the ratio is a few percent, the noise too)")
    parser.add_argument("--wall-clock", action="store_true",
                        help="time CPU steps by wall clock (default with one thread: process CPU time; see Clock)")
    parser.add_argument("--adaptive-malloc", action="store_true",
                        help="leave glibc's adaptive malloc thresholds alone (default: fixed, see above)")
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.exit(2, "bench/executor.py: error: --device cuda: CUDA is not available on this machine\n")
    threads = args.threads or (1 if args.device == "cpu" else None)
    if threads:
        torch.set_num_threads(threads)
    malloc = "adaptive malloc" if args.adaptive_malloc or not pin_malloc() else "fixed malloc thresholds"
    started = time.perf_counter()
    clock = Clock(args.device, wall=args.wall_clock or torch.get_num_threads() > 1)
    print(f"executor benchmark on {args.device} (torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{malloc}, "
          f"load average {load_average()}): median of {args.steps} steps after {args.warmup} by {clock.label}, "
          f"times in ms, peaks in MiB")
    try:
        results = [(spec, run_model(spec, clock, args.device, args.steps, args.warmup, args.slots, args.overhead_only))
                   for spec in args.specs]
    except MemschedError as exc:
        parser.exit(2, f"bench/executor.py: error: {exc}\n")
    print_summary(results)
    print(f"total {time.perf_counter() - started:.0f} s, load average {load_average()}")


if __name__ == "__main__":
    main()
