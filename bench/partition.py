"""Pipeline partitioning: the exact DP (solvers/partition.py) against two hand partitions, in the pipeline model.

    python bench/partition.py [--lengths 32 64] [--devices 2 4 8] [--points 0 0.5 1 2] [--models]
                              [--bandwidth 25e9] [--latency 1e-5] [--slots 500]

For each chain (examples/example-L24, random heterogeneous chains of ``--lengths`` stages, and with
``--models`` the built-in models scaled up, estimated from fake tensors: sizes exact, times FLOPs / 1e12),
``P`` in ``--devices``, ``m = 2P`` and ``4P`` micro-batches and both schedules (1F1B, GPipe), at device memories
``--points`` of the way from the least memory any partition needs (with recomputation) to the least at which
some partition fits with store-all on every device (when the two are equal, a point adds that fraction of
10% of it), the iteration time of

* ``dp``: the optimum of the pipeline model (partition and per-device schedules chosen together);
* ``even``: stages split evenly by count (the first ``L mod P`` devices one more);
* ``time``: torchgpipe's ``balance_by_time``: the contiguous split minimising the largest per-device
  ``Σ (fwd_time + bwd_time)`` (its ``blockpartition.solve``, Bárány et al.), blind to memory, transfers and
  the bubble;

where each hand partition's devices use store-all when it fits and otherwise the recomputation schedule the
DP would give that range (the faster of Rotor's and the least-memory schedule whose exact device peak fits);
``-`` when some device does not fit even so. The columns ``even/dp`` and ``time/dp`` are the ratios (above 1:
slower than the DP). Training setup: Adam in fp32, no ZeRO (16 bytes per parameter with the gradients).
"""

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.chains import bench_chains  # noqa: E402
from planner.errors import MemschedError  # noqa: E402
from planner.simulate.pipeline import pipeline_time  # noqa: E402
from solvers.partition import PartitionProblem, least_device_memory, min_max_partition, solve_partition  # noqa: E402
from solvers.sqrt import segment_bounds  # noqa: E402

MODELS = ("gpt-tiny:layers=24,d=1024", "resnet-tiny:blocks=16,channels=64", "unet-tiny:levels=4,convs=2")


def chains(args):
    return bench_chains(args.lengths, MODELS if args.models else (), estimate=True)


def even_split(length: int, devices: int) -> list:
    bounds = segment_bounds(length, devices)
    return list(zip(bounds, bounds[1:]))


def balance_by_time(chain, devices: int) -> list:
    """The contiguous split with the least largest per-device Σ (fwd + bwd) (torchgpipe's blockpartition)."""
    size = chain.length + 1
    prefix = np.concatenate([[0.0], np.cumsum([s.fwd_time + s.bwd_time for s in chain.stages])])
    block = prefix[None, :] - prefix[:, None]
    values = np.full((devices, size, size), np.inf)
    for s in range(devices):
        for a in range(s, chain.length - (devices - 1 - s)):
            for b in range(a + 1, chain.length - (devices - 1 - s) + 1):
                values[s, a, b] = block[a, b]
    return min_max_partition(values)[1]


def evaluate(problem, parts):
    """Iteration time of a fixed partition, each device's schedule as the DP's option for its range; None if a
    device does not fit."""
    options = [problem.option(a, b, problem.in_flight(s)) for s, (a, b) in enumerate(parts)]
    if any(o is None for o in options):
        return None, None
    return pipeline_time([o.time for o in options], problem.micro_batches), options


def text(value) -> str:
    return f"{value:9.4f}" if value is not None else f"{'-':>9}"


def ratio(value, reference) -> str:
    return f"{value / reference:7.3f}" if value is not None else f"{'-':>7}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="*", default=[32, 64])
    parser.add_argument("--devices", type=int, nargs="*", default=[2, 4, 8])
    parser.add_argument("--points", type=float, nargs="*", default=[0.0, 0.5, 1.0, 2.0])
    parser.add_argument("--models", action="store_true")
    parser.add_argument("--bandwidth", type=float, default=25e9)
    parser.add_argument("--latency", type=float, default=1e-5)
    parser.add_argument("--slots", type=int, default=500)
    args = parser.parse_args(argv)
    print(f"iteration seconds; activations between devices at {args.bandwidth:.3g} B/s + {args.latency:g} s; "
          "setup adam fp32; options: s store-all, r rotor, l least-memory (per device)\n")
    print(f"{'chain':<28} {'P':>2} {'m':>3} {'sched':>5} {'point':>5} {'memory':>12} {'dp':>9} {'even':>9} "
          f"{'time':>9} {'even/dp':>7} {'time/dp':>7} {'solve s':>7}  dp options")
    worst = {"even": [], "time": []}
    for chain in chains(args):
        for devices in args.devices:
            if devices > chain.length:
                continue
            hand = {"even": even_split(chain.length, devices), "time": balance_by_time(chain, devices)}
            for micro in (2 * devices, 4 * devices):
                for schedule in ("1f1b", "gpipe"):
                    probe = PartitionProblem(chain, devices, 10**18, micro, schedule, args.bandwidth, args.latency,
                                             slots=args.slots)
                    low, high = least_device_memory(probe), least_device_memory(probe, store_all=True)
                    span = high - low if high > low else low // 10
                    for point in args.points:
                        memory = int(low + point * span)
                        problem = PartitionProblem(chain, devices, memory, micro, schedule, args.bandwidth,
                                                   args.latency, slots=args.slots)
                        started = time.perf_counter()
                        try:
                            solution = solve_partition(problem)
                        except MemschedError as exc:
                            print(f"{chain.name:<28} {devices:2d} {micro:3d} {schedule:>5} {point:5.2f}: {exc}")
                            continue
                        seconds = time.perf_counter() - started
                        best = solution.time
                        hands = {name: evaluate(problem, parts)[0] for name, parts in hand.items()}
                        for name, value in hands.items():
                            worst[name].append(value / best if value is not None else np.inf)
                        kinds = "".join(o.kind[0] for o in solution.options)
                        print(f"{chain.name:<28} {devices:2d} {micro:3d} {schedule:>5} {point:5.2f} {memory:12d} "
                              f"{text(best)} {text(hands['even'])} {text(hands['time'])} "
                              f"{ratio(hands['even'], best)} {ratio(hands['time'], best)} {seconds:7.2f}  {kinds}",
                              flush=True)
    for name, values in worst.items():
        fitted = [v for v in values if np.isfinite(v)]
        if values:
            print(f"\n{name}: no fitting partition in {len(values) - len(fitted)} of {len(values)} cases"
                  + (f"; where it fits, {name}/dp geometric mean {np.exp(np.mean(np.log(fitted))):.3f}, "
                     f"max {max(fitted):.3f}" if fitted else ""), end="")
    print()


if __name__ == "__main__":
    main()
