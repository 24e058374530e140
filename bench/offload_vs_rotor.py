"""Recomputation, offloading, and both: step time at equal budgets, and offload plans executed on this machine.

    python bench/offload_vs_rotor.py [--lengths 20 50] [--models] [--points 0.1 0.3 0.6] [--factors 0.5 1 2]
                                     [--time-limit 20] [--execute]

Part 1 (the simulator): for each chain (examples/example-L24, random heterogeneous chains of ``--lengths``
stages, and with ``--models`` the built-in gpt-tiny and resnet-tiny profiled here), budgets at ``--points``
of the way from the least memory of any schedule to the store-all peak, and channels that copy one stage's
saved activation in ``--factors`` of its forward time (both directions, 10 µs latency): the step-time overhead
over the compute-only time of

* ``rotor``: recomputation alone;
* ``pofo``: recomputation and offloading in one dynamic program;
* ``off/sa``: the exact offload plan of the store-all schedule; ``off/r+``: of Rotor's schedule for a budget
  halfway between this one and the store-all peak (recomputation for half the way, offloading for the rest);
* ``all``: the hand policy (every saved activation offloaded, prefetched one stage ahead) on store-all.

``-`` means no plan fits (for ``all``: its plan peaks above the budget). The last columns are the ratios
pofo / rotor and best offload / rotor (below 1: faster at the same memory).

Part 2 (``--execute``): offload plans run by the executor on this CPU (host copies are synchronous NumPy
copies on the compute thread, so the measured time includes them where the model overlaps them; the peak is
the point): measured peak over predicted, measured step time (median of 5) over predicted, and gradient
equality with the plain step.
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.chains import bench_chains  # noqa: E402
from planner.errors import MemschedError  # noqa: E402
from planner.simulate import simulate  # noqa: E402
from planner.transfer import Transfer  # noqa: E402
from solvers import solve, store_all_peak  # noqa: E402
from solvers.minimum import minimum_budget  # noqa: E402
from solvers.offload import offload_all_policy  # noqa: E402

MODELS = ("gpt-tiny", "resnet-tiny", "mlp")


def channel(chain, factor: float) -> Transfer:
    """Both directions copy one stage's mean saved activation in ``factor`` of its mean forward time."""
    saved = sum(s.saved_bytes for s in chain.stages) / chain.length
    forward = sum(s.fwd_time for s in chain.stages) / chain.length
    return Transfer(saved / (factor * forward), saved / (factor * forward), 1e-5)


def overhead(chain, budget, name, **params):
    """``(overhead fraction or None, solve seconds)`` of ``name``'s plan within ``budget``."""
    started = time.perf_counter()
    try:
        plan = solve(chain, budget, name, **params)
    except MemschedError:
        return None, time.perf_counter() - started
    return plan.predicted.time / chain.compute_time - 1, time.perf_counter() - started


def hand_overhead(chain, budget, transfer):
    result = simulate(chain, offload_all_policy(chain, budget, transfer).schedule, transfer)
    return None if result.peak_bytes > budget else result.time / chain.compute_time - 1


def text(value) -> str:
    return f"{'-':>7}" if value is None else f"{value:7.2%}"


def ratio(value, reference) -> str:
    if value is None or reference is None:
        return f"{'-':>6}"
    return f"{(1 + value) / (1 + reference):6.3f}"


def chains(args):
    return bench_chains(args.lengths, MODELS if args.models else (), estimate=False)


def simulated_table(args) -> None:
    print(f"{'chain':>14} {'L':>3} {'point':>5} {'copy':>5} | {'rotor':>7} {'pofo':>7} {'off/sa':>7} {'off/r+':>7} "
          f"{'all':>7} | {'pofo/r':>6} {'off/r':>6} | pofo s")
    for chain in chains(args):
        low, high = minimum_budget(chain), store_all_peak(chain)
        for point in args.points:
            budget = int(low + point * (high - low))
            rotor, _ = overhead(chain, budget, "rotor")
            for factor in args.factors:
                transfer = channel(chain, factor)
                pofo, pofo_s = overhead(chain, budget, "pofo", transfer=transfer)
                store_all, _ = overhead(chain, budget, "offload", transfer=transfer, time_limit=args.time_limit)
                on_rotor, _ = overhead(chain, budget, "offload", transfer=transfer, schedule="rotor",
                                       schedule_budget=(budget + high) // 2, time_limit=args.time_limit)
                hand = hand_overhead(chain, budget, transfer)
                offloads = [v for v in (store_all, on_rotor) if v is not None]
                best = min(offloads) if offloads else None
                print(f"{chain.name[:14]:>14} {chain.length:3d} {point:5.0%} {factor:4.1f}x | {text(rotor)} "
                      f"{text(pofo)} {text(store_all)} {text(on_rotor)} {text(hand)} | {ratio(pofo, rotor)} "
                      f"{ratio(best, rotor)} | {pofo_s:5.2f}", flush=True)


def executed_table(args) -> None:
    import torch

    from planner.execute.chain import apply_plan
    from planner.execute.stages import default_loss, named_stages, run_stages
    from profiles.chain_profiler import profile_chain
    from profiles.memory import memory_meter
    from profiles.spec import load_model
    from profiles.training import input_bytes

    print(f"\n{'model':>12} {'solver':>8} {'point':>6} | {'measured/predicted peak':>24} {'time meas/pred':>17} "
          f"{'offloads':>8} {'grads equal':>11}")
    for spec in MODELS:
        model, _ = load_model(spec)
        chain = profile_chain(model.stages, model.example_inputs, loss_fn=model.loss_fn, name=spec)
        transfer = channel(chain, 1.0)
        low, high = minimum_budget(chain), store_all_peak(chain)
        loss_fn = model.loss_fn or default_loss
        stages = named_stages(model.stages)
        parameters = [p for _, m in stages if isinstance(m, torch.nn.Module) for p in m.parameters() if p.requires_grad]

        def step(module):
            for p in parameters:
                p.grad = None
            torch.manual_seed(0)
            with memory_meter("cpu") as meter:
                loss_fn(module(*model.example_inputs)).backward()
            return meter.peak + input_bytes(model.example_inputs), [p.grad.clone() for p in parameters]

        def seconds(module, repeats=5):
            times = []
            for _ in range(repeats):
                for p in parameters:
                    p.grad = None
                started = time.perf_counter()
                loss_fn(module(*model.example_inputs)).backward()
                times.append(time.perf_counter() - started)
            return sorted(times)[repeats // 2]

        _, reference = step(lambda *xs: run_stages(stages, xs))
        for name, point in (("pofo", 0.3), ("offload", 0.5), ("offload", 0.8)):
            budget = int(low + point * (high - low))
            try:
                plan = solve(chain, budget, name, transfer=transfer)
            except MemschedError as exc:
                print(f"{spec:>12} {name:>8} {point:6.0%} | {str(exc)[:70]}")
                continue
            planned = apply_plan(stages, plan, chain)
            peak, grads = step(planned)
            equal = all(torch.equal(a, b) for a, b in zip(grads, reference))
            print(f"{spec:>12} {name:>8} {point:6.0%} | {peak / plan.predicted.peak_bytes:24.4f} "
                  f"{seconds(planned) / plan.predicted.time:17.2f} "
                  f"{sum(op.kind == 'Offload' for op in plan.schedule):8d} "
                  f"{str(equal):>11}", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="*", default=[20, 50])
    parser.add_argument("--models", action="store_true", help="also the built-in models, profiled here")
    parser.add_argument("--points", type=float, nargs="+", default=[0.1, 0.3, 0.6],
                        help="budgets, as fractions of the way from the least memory to the store-all peak")
    parser.add_argument("--factors", type=float, nargs="+", default=[0.5, 1.0, 2.0],
                        help="copy time of one stage's saved activation, in forward times")
    parser.add_argument("--time-limit", type=float, default=20.0, help="CP-SAT seconds per offload solve")
    parser.add_argument("--execute", action="store_true", help="also run offload plans on this CPU (part 2)")
    args = parser.parse_args(argv)
    simulated_table(args)
    if args.execute:
        executed_table(args)


if __name__ == "__main__":
    main()
