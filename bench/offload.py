"""Offload benchmark: the exact CP-SAT offload plan against the greedy and the hand policy (offload every saved
activation, ``saved_tensors_hooks`` style), on the store-all compute schedule.

    python bench/offload.py [--lengths 20 50 100] [--budgets 0.5 0.75] [--factors 0.5 1 2] [--time-limit 60]
                            [--seed 0] [--example]

Chains are synthetic and heterogeneous (profiles.synthetic.random_chain, with temporaries, parameter gradients
and own_saved_bytes); ``--example`` adds the profiled examples/example-L24.chain.json. Budgets are fractions of
the store-all peak; for each *factor* the channel (both directions, 10 µs latency) copies one stage's saved
activation (the chain's mean) in that many of its forward times (the mean). Each row gives, per solver, the
step-time overhead over the compute-only time (``-`` when its plan does not fit the budget, ``x`` when it found
none) and its solve seconds; for the exact model its status (``opt``; ``opt*`` when the greedy's plan has no
stall, so CP-SAT is not run; ``gap x%`` to CP-SAT's bound at the time limit; ``timeout`` when CP-SAT found
nothing and the greedy's plan is shown) and its size (window candidates / variables / constraints).
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from planner.chain import load_chain  # noqa: E402
from planner.errors import MemschedError  # noqa: E402
from planner.simulate import simulate  # noqa: E402
from planner.transfer import Transfer  # noqa: E402
from profiles.synthetic import random_chain  # noqa: E402
from solvers import store_all_peak  # noqa: E402
from solvers.offload import offload, offload_all_policy  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "example-L24.chain.json"


def channel(chain, factor: float) -> Transfer:
    saved = sum(s.saved_bytes for s in chain.stages) / chain.length
    forward = sum(s.fwd_time for s in chain.stages) / chain.length
    bandwidth = saved / (factor * forward)
    return Transfer(bandwidth, bandwidth, 1e-5)


def timed(function):
    started = time.perf_counter()
    try:
        return function(), time.perf_counter() - started
    except MemschedError:
        return None, time.perf_counter() - started


def overhead(chain, solution, transfer, budget) -> str:
    if solution is None:
        return f"{'x':>8}"
    result = simulate(chain, solution.schedule, transfer)
    if result.peak_bytes > budget:
        return f"{'-':>8}"
    return f"{result.time / chain.compute_time - 1:8.2%}"


def row(chain, fraction: float, factor: float, time_limit: float) -> None:
    budget = int(fraction * store_all_peak(chain))
    transfer = channel(chain, factor)
    exact, exact_s = timed(lambda: offload(chain, budget, transfer, time_limit=time_limit, method="exact"))
    greedy, greedy_s = timed(lambda: offload(chain, budget, transfer, method="greedy"))
    hand, hand_s = timed(lambda: offload_all_policy(chain, budget, transfer))
    if exact is None:
        status, size = "infeasible", ""
    elif exact.params["method"] != "exact":
        status, size = "timeout", ""
    else:
        if exact.optimal:
            status = "opt*" if "greedy" in exact.stats["status"] else "opt"
        else:
            status = f"gap {exact.gap:.2%}"
        size = f"{exact.stats['candidates']}/{exact.stats.get('variables', '-')}/{exact.stats.get('constraints', '-')}"
    print(f"{chain.name[:22]:>22} {chain.length:4d} {fraction:5.0%} {factor:5.1f} | "
          f"{overhead(chain, exact, transfer, budget)} {exact_s:7.2f} {status:>10} {size:>20} | "
          f"{overhead(chain, greedy, transfer, budget)} {greedy_s:6.2f} | "
          f"{overhead(chain, hand, transfer, budget)} {hand_s:6.2f}", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[20, 50, 100])
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.5, 0.75], help="fractions of the store-all peak")
    parser.add_argument("--factors", type=float, nargs="+", default=[0.5, 1.0, 2.0],
                        help="copy time of one stage's saved activation over its forward time")
    parser.add_argument("--time-limit", type=float, default=60.0, help="CP-SAT seconds per exact solve")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--example", action="store_true", help=f"also {EXAMPLE.name}")
    args = parser.parse_args(argv)
    chains = [random_chain(length, args.seed + length, tmp=True, params=True, own_saved=True)
              for length in args.lengths]
    if args.example:
        chains.append(load_chain(EXAMPLE))
    print(f"{'chain':>22} {'L':>4} {'budg':>5} {'copy':>5} | {'exact':>8} {'solve s':>7} {'status':>10} "
          f"{'cands/vars/constraints':>20} | {'greedy':>8} {'s':>6} | {'hand':>8} {'s':>6}")
    for chain in chains:
        for fraction in args.budgets:
            for factor in args.factors:
                row(chain, fraction, factor, args.time_limit)


if __name__ == "__main__":
    main()
