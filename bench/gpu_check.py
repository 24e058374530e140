"""GPU check: memsched's executor on CUDA, in one short run (written to be run once on a borrowed GPU).

    python bench/gpu_check.py [SPEC] [--steps N] [--warmup N] [--budgets 25,50,75] [--skip-offload]

On ``cuda``, for one model (default: a gpt-tiny whose store-all peak is about 1 GiB, dropout on), after
profiling it there:

1. store-all: the profile's predicted peak and step time against the plain step's measured ones;
2. (a) executor overhead: the store_all plan through ``apply_plan`` against the plain step, and their peaks;
3. rotor at 25%, 50% and 75% of the store-all peak: measured against predicted peak and step time, the
   measured overhead over the plain step against the predicted one, and the largest gradient difference
   from the plain step (same seed, so dropout draws the same masks);
4. (b), (c) as bench/executor.py: checkpoint_sequential for every segment count, and rotor at the measured
   peak of the fastest one within 2-3 budgets.
5. offload (skipped with ``--skip-offload``): the copy channel, as profile_chain measured it (``chain.transfer``)
   against one 256 MiB copy each way to / from pinned memory timed here with CUDA events (alone, and both
   directions at once, which the model assumes run at full speed each); then the ``offload`` solver (exact,
   CP-SAT for at most 10 s, on the store-all compute schedule) at 50% and 75% of the store-all peak, and
   ``pofo`` at 30% of the way from the least feasible budget to the store-all peak, all over the profiled
   channel. Each plan runs through ``apply_plan`` with the same plan stripped of its Offload / Release /
   Prefetch (its compute schedule alone, a plain chain plan whose peak is higher), interleaved: measured
   against predicted peak and step time, the stall (measured: offload step minus compute-only step, so the
   executor's cost of the transfers counts as stall; predicted: the offload simulator's ``stall_time``), the
   bytes moved, and the largest gradient difference from the plain step. A plan that fails prints its
   traceback and the others still run; an infeasible budget is reported, not failed.

First, the device plan (bench/gpu_device_plan.py): the cuBLAS workspaces one step leaves allocated against
planner/blas_workspace.py's rule, and ``memsched plan gpt-tiny... --device-spec <this GPU's built-in spec> --batch
auto``, its chosen plan trained here for 3 steps, measured beside the estimate (peak and time).

Times are CUDA events around each step (median of ``--steps`` after ``--warmup``); peaks are
``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, minus what was allocated before the
step, plus the inputs' bytes (as on CPU). Gradients are set to None and the seed reset before each step.
Without CUDA it prints one line and exits with status 2; a check that fails prints its traceback, the
others still run, and the exit status is 1. Expected to take about a minute on an H200 without the offload
section (most of it loading torch, initialising CUDA and compiling the Rotor kernel with numba); the offload
section adds about 30 s, most of it CP-SAT (up to 10 s per offload plan) and compiling POFO's kernel.
"""

import argparse
import dataclasses
import importlib.util
import os
import statistics
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
from planner.execute.chain import apply_plan  # noqa: E402
from planner.ops import TRANSFER_OPS
from planner.plan import Predicted  # noqa: E402
from planner.simulate import simulate  # noqa: E402
from planner.simulate.chain import ChainSimulator  # noqa: E402
from profiles.chain_profiler import profile_chain  # noqa: E402
from solvers import solve, store_all_peak  # noqa: E402
from solvers.minimum import minimum_budget  # noqa: E402


def _load_bench(name: str):
    """bench/NAME.py, loaded by path (bench/ is not a package)."""
    path = Path(__file__).resolve().parent / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"memsched_bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench_executor = _load_bench("executor")
bench_device_plan = _load_bench("gpu_device_plan")

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


# The offload section: the exact offload solver on the store-all compute schedule at these fractions of the
# store-all peak (CP-SAT for at most OFFLOAD_TIME_LIMIT seconds each), and POFO at POFO_POSITION of the way from
# the least feasible budget to the store-all peak; the channel timed with one CHANNEL_BYTES copy each way.
OFFLOAD_FRACTIONS = (0.50, 0.75)
OFFLOAD_TIME_LIMIT = 10.0
POFO_POSITION = 0.30
CHANNEL_BYTES = 256 * MIB
CHANNEL_REPEATS = 5


def compute_only_plan(chain, plan):
    """``plan`` without its Offload / Release / Prefetch: the same compute schedule, everything kept on the device.

    Its predicted figures are the chain simulator's for that schedule (its peak is higher than the offload
    plan's: nothing is released); ``transfer`` is None, so ``apply_plan`` runs it as a plain chain plan."""
    schedule = tuple(op for op in plan.schedule if op.kind not in TRANSFER_OPS)
    result = ChainSimulator(chain).run(schedule)
    return dataclasses.replace(plan, schedule=schedule, transfer=None,
                               predicted=Predicted(peak_bytes=result.peak_bytes, time=result.time,
                                                   baseline_time=chain.compute_time))


def time_pinned_copies(device, nbytes, repeats) -> dict:
    """Seconds (median of ``repeats``, CUDA events) of one ``nbytes`` copy between the device and pinned host
    memory: ``"d2h"`` and ``"h2d"`` alone, each on its own side stream, and ``"both d2h"`` / ``"both h2d"`` with
    the two issued at once (each measured from a common start, so an engine that waits for the other shows)."""
    device = torch.device(device)
    compute = torch.cuda.current_stream(device)
    streams = {"d2h": torch.cuda.Stream(device), "h2d": torch.cuda.Stream(device)}
    buffers = {"d2h": (torch.empty(nbytes, dtype=torch.uint8, pin_memory=True),
                       torch.ones(nbytes, dtype=torch.uint8, device=device)),
               "h2d": (torch.empty(nbytes, dtype=torch.uint8, device=device),
                       torch.ones(nbytes, dtype=torch.uint8).pin_memory())}

    def once(directions) -> dict:
        torch.cuda.synchronize(device)
        start = torch.cuda.Event(enable_timing=True)
        start.record(compute)
        ends = {}
        for direction in directions:
            stream = streams[direction]
            stream.wait_event(start)
            destination, source = buffers[direction]  # noqa: F821 (closure, later del)
            with torch.cuda.stream(stream):
                destination.copy_(source, non_blocking=True)
            ends[direction] = torch.cuda.Event(enable_timing=True)
            ends[direction].record(stream)
        torch.cuda.synchronize(device)
        return {direction: start.elapsed_time(end) / 1000.0 for direction, end in ends.items()}

    samples = {"d2h": [], "h2d": [], "both d2h": [], "both h2d": []}
    for run in range(repeats + 1):  # the first of each is a warm-up
        alone = {**once(["d2h"]), **once(["h2d"])}
        both = once(["d2h", "h2d"])
        if run:
            for direction in ("d2h", "h2d"):
                samples[direction].append(alone[direction])
                samples[f"both {direction}"].append(both[direction])
    del buffers
    return {key: statistics.median(values) for key, values in samples.items()}


def gbps(rate) -> str:
    return f"{rate / 1e9:.2f} GB/s"


def mib(count) -> str:
    return f"{count / MIB:.1f}"


def ms(seconds) -> str:
    return f"{seconds * 1e3:.2f}"


class Checks:
    """The checks on one model; each records its verdict lines, a failing one its traceback."""

    def __init__(self, spec, device, measure, steps, warmup, fractions, offload=True):
        self.spec, self.device, self.fractions, self.offload = spec, device, fractions, offload
        self.measure = measure
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
                f"(c) rotor measured / predicted: time "
                f"{bench_executor.span([r['rotor_s'] / r['predicted_s'] for r in done])}"
                f", peak {bench_executor.span([r['rotor_peak'] / r['predicted_peak'] for r in done], 4)}")

    def profiled_channel(self):
        """The chain's copy channel, as profile_chain measured it on CUDA."""
        if self.chain.transfer is None:
            raise MemschedError("the profile has no copy channel (profile_chain measures one on CUDA)")
        return self.chain.transfer

    def channel(self):
        transfer = self.profiled_channel()
        print(f"profiled channel (profile_chain, 1 and 64 MiB copies, line fit): d2h {gbps(transfer.d2h_bandwidth)}, "
              f"h2d {gbps(transfer.h2d_bandwidth)}, latency {transfer.latency * 1e6:.1f} us")
        seconds = time_pinned_copies(self.device, CHANNEL_BYTES, CHANNEL_REPEATS)
        print(f"one {mib(CHANNEL_BYTES)} MiB copy to / from pinned memory, own stream, CUDA events, median of "
              f"{CHANNEL_REPEATS}:")
        print(f"{'':>18} {'meas ms':>8} {'pred ms':>8} {'achieved':>12} {'profile':>12} {'ach/prof':>8}")
        ratios = {}
        for key in ("d2h", "h2d", "both d2h", "both h2d"):
            direction = key.split()[-1]
            bandwidth = transfer.d2h_bandwidth if direction == "d2h" else transfer.h2d_bandwidth
            achieved = CHANNEL_BYTES / seconds[key]
            ratios[key] = achieved / bandwidth if bandwidth > 0 else float("nan")
            label = f"{direction} alone" if key == direction else f"{direction}, both at once"
            print(f"{label:>18} {ms(seconds[key]):>8} {ms(transfer.seconds(CHANNEL_BYTES, direction)):>8} "
                  f"{gbps(achieved):>12} {gbps(bandwidth):>12} {ratios[key]:8.3f}")
        self.summary.append(
            f"offload channel: one {mib(CHANNEL_BYTES)} MiB pinned copy, achieved / profiled bandwidth d2h "
            f"{ratios['d2h']:.3f}, h2d {ratios['h2d']:.3f}; both directions at once (the model assumes full speed "
            f"each): d2h {ratios['both d2h']:.3f}, h2d {ratios['both h2d']:.3f}")

    def offload_plans(self):
        transfer = self.profiled_channel()
        peak, least = store_all_peak(self.chain), minimum_budget(self.chain)
        cases = [(f"offload {fraction:.0%}", int(peak * fraction), "offload",
                  dict(schedule="store_all", method="exact", time_limit=OFFLOAD_TIME_LIMIT))
                 for fraction in OFFLOAD_FRACTIONS]
        pofo_budget = int(least + POFO_POSITION * (peak - least))
        cases.append((f"pofo {pofo_budget / peak:.0%}", pofo_budget, "pofo", {}))
        print("offload plans over the profiled channel; 'compute' is the same plan with its transfers stripped "
              "(same compute schedule, nothing moved, nothing released: its peak is higher); measured stall = "
              "offload step - compute step (executor cost of the transfers included); budgets in % of the "
              "store-all peak")
        print(f"{'plan':>12} {'budget':>7} {'pred MiB':>9} {'meas MiB':>9} {'peak m/p':>8} {'in bdgt':>7} "
              f"{'pred ms':>8} {'meas ms':>8} {'time m/p':>8} {'cmp pred':>8} {'cmp meas':>8} {'stall p':>8} "
              f"{'stall m':>8} {'moved MiB':>9} {'max|dgrad|':>10} {'rel':>8}")
        rows = []
        for label, budget, solver, params in cases:
            try:
                row = self._offload_case(label, budget, solver, params, transfer)
            except Exception:  # one plan failing must not stop the others
                self.failures += 1
                traceback.print_exc(file=sys.stdout)
                self.summary.append(f"{label}: FAILED (traceback above)")
                continue
            if row is not None:
                rows.append(row)
        if rows:
            self.summary.append(
                "offload plans " + ", ".join(row["label"] for row in rows) + ": measured / predicted peak "
                + bench_executor.span([row["peak"] / row["pred_peak"] for row in rows], 4)
                + ", time " + bench_executor.span([row["time"] / row["pred_time"] for row in rows])
                + f"; measured peak above the budget in {sum(row['peak'] > row['budget'] for row in rows)}/{len(rows)}"
                + "; stall measured / predicted ms: "
                + ", ".join(f"{ms(row['stall'])} / {ms(row['pred_stall'])}" for row in rows)
                + f"; largest gradient relative difference {max(row['rel'] for row in rows):.1e}")

    def _offload_case(self, label, budget, solver, params, transfer):
        """One offload plan solved, run and measured (see :meth:`offload_plans`); None when infeasible."""
        from planner.execute.offload import live_copies

        peak = store_all_peak(self.chain)
        started = time.perf_counter()
        try:
            plan = solve(self.chain, budget, solver, transfer=transfer, **params)
        except MemschedError as exc:
            print(f"{label:>12} {budget / peak:>7.0%}  infeasible: {exc}")
            self.summary.append(f"{label}: infeasible ({exc})")
            return None
        solve_s = time.perf_counter() - started
        predicted = simulate(self.chain, plan)  # an OffloadResult when the plan moves data
        copies = getattr(predicted, "copies", ())
        pred_stall = getattr(predicted, "stall_time", 0.0)
        compute = compute_only_plan(self.chain, plan)
        offload_step = self.bench.planned(apply_plan(self.model.stages, plan, self.chain))
        compute_step = self.bench.planned(apply_plan(self.model.stages, compute, self.chain))
        times = self.bench.times({"offload": offload_step, "compute": compute_step})
        measured_peak = self.bench.peak(offload_step)  # after the timed steps: pinned buffers and streams warm
        compute_peak = self.bench.peak(compute_step)
        worst, relative = bench_executor.grad_difference(self.reference, self.bench.grads(offload_step))
        self.measure.synchronize()
        left = live_copies()
        moved = {direction: sum(c.nbytes for c in copies if c.direction == direction) for direction in ("d2h", "h2d")}
        row = dict(label=label, budget=budget, peak=measured_peak, pred_peak=plan.predicted.peak_bytes,
                   time=times["offload"], pred_time=plan.predicted.time, stall=times["offload"] - times["compute"],
                   pred_stall=pred_stall, rel=relative)
        print(f"{label:>12} {budget / peak:>7.0%} {mib(plan.predicted.peak_bytes):>9} {mib(measured_peak):>9} "
              f"{measured_peak / plan.predicted.peak_bytes:8.4f} {'yes' if measured_peak <= budget else 'NO':>7} "
              f"{ms(plan.predicted.time):>8} {ms(times['offload']):>8} {times['offload'] / plan.predicted.time:8.3f} "
              f"{ms(compute.predicted.time):>8} {ms(times['compute']):>8} {ms(pred_stall):>8} {ms(row['stall']):>8} "
              f"{mib(moved['d2h']):>9} {worst:10.2e} {relative:8.1e}")
        status = "optimal" if plan.optimal else ("gap " + (f"{plan.gap:.1%}" if plan.gap is not None else "unknown"))
        print(f"{'':>12} solved in {solve_s:.1f} s ({plan.solver} {plan.params}, {status}); "
              f"{sum(op.kind == 'Offload' for op in plan.schedule)} offloads, {len(copies)} copies "
              f"(d2h {mib(moved['d2h'])} MiB, h2d {mib(moved['h2d'])} MiB), {plan.recomputed_forwards} recomputed "
              f"forwards; compute schedule alone: peak {mib(compute_peak)} MiB measured, "
              f"{mib(compute.predicted.peak_bytes)} predicted"
              + ("" if plan.moves_data else "; the plan moves nothing (compute and offload steps are the same plan)")
              + ("" if left == (0, 0) else f"; LEFT after the steps: {left[0]} boxed storages, {mib(left[1])} MiB "
                                            "of host copies"))
        del offload_step, compute_step
        return row

    def device_plan(self):
        line, matches = bench_device_plan.cublas_workspace_line(self.device)
        print(line)
        self.summary.append(line)
        for line in bench_device_plan.device_plan_lines(self.device):
            print(line)
            if line.startswith(("measured", "no built-in")):
                self.summary.append(line)
        if not matches:
            raise AssertionError("the cuBLAS workspaces measured differ from planner/blas_workspace.py's rule")

    def run(self):
        self.section("device plan: memsched plan's estimate for this GPU's spec, measured", self.device_plan)
        self.section("profile on the device", self.profile)
        if self.chain is None:
            return
        self.section("store-all: plain step against the profile", self.store_all)
        self.section("(a) executor overhead: store_all plan vs plain step", self.overhead)
        self.section(f"rotor at {', '.join(f'{f:.0%}' for f in self.fractions)} of the store-all peak", self.budgets)
        self.section("(b), (c) rotor vs checkpoint_sequential at equal measured peak", self.segments)
        if self.offload:
            self.section("offload: the copy channel, profiled and measured", self.channel)
            self.section("offload plans: measured against predicted peak, step time and stall", self.offload_plans)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spec", nargs="?", default=DEFAULT_SPEC, metavar="SPEC")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per measurement, median kept (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    parser.add_argument("--budgets", default="25,50,75", help="rotor budgets, percent of the store-all peak")
    parser.add_argument("--skip-offload", action="store_true",
                        help="skip the offload section (the copy channel and the offload / POFO plans)")
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
    checks = Checks(args.spec, device, CudaEvents(device), args.steps, args.warmup, fractions,
                    offload=not args.skip_offload)
    checks.run()
    print("\nsummary")
    for line in checks.summary:
        print(line)
    print(f"total {time.perf_counter() - started:.0f} s; {checks.failures} check(s) failed")
    sys.exit(1 if checks.failures else 0)


if __name__ == "__main__":
    main()
