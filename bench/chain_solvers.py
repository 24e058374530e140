"""Chain solver benchmark: Rotor's compiled dynamic program against the same recurrence in plain Python,
and Rotor's plans against Chen's √n segments at equal memory, and the hierarchical solver on identical
blocks. Everything is measured in this one run.

    python bench/chain_solvers.py [--lengths 20 50 100 200] [--slots 500] [--plain-up-to 50] [--repeats 3]
                                  [--blocks 48]

Chains are synthetic and heterogeneous (profiles.synthetic.random_chain, with temporaries and parameter
gradients); the budget is halfway between the least feasible memory and the store-all peak.
"""

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from planner import Chain, ChainSimulator  # noqa: E402
from profiles.synthetic import random_chain  # noqa: E402
from solvers import solve, store_all_peak  # noqa: E402
from solvers.minimum import minimum_budget  # noqa: E402
from solvers.rotor import compute_table, discretise  # noqa: E402
from solvers.rotor_plain import compute_table_plain  # noqa: E402
from solvers.sqrt import segments_schedule  # noqa: E402


def best_of(repeats, function):
    """Least wall-clock seconds of ``repeats`` calls (and the last result)."""
    best, result = float("inf"), None
    for _ in range(repeats):
        started = time.perf_counter()
        result = function()
        best = min(best, time.perf_counter() - started)
    return best, result


def solve_times(lengths, slots, plain_up_to, repeats):
    started = time.perf_counter()
    warm = random_chain(4, 0)
    solve(warm, store_all_peak(warm) - 1, "rotor", slots=slots)
    print(f"first call (compiling, or loading numba's cache): {time.perf_counter() - started:.2f} s\n")
    print(f"{'L':>4} {'slots':>5} {'solve() s':>10} {'DP table s':>11} {'plain DP s':>11} {'plain/table':>12} "
          f"{'overhead':>9}")
    for length in lengths:
        chain = random_chain(length, seed=length, tmp=True, params=True)
        budget = (minimum_budget(chain) + store_all_peak(chain)) // 2
        end_to_end, plan = best_of(repeats, lambda: solve(chain, budget, "rotor", slots=slots))
        _, arrays, top = discretise(chain, budget, slots)
        table_seconds, table = best_of(repeats, lambda: compute_table(arrays, top))
        if length <= plain_up_to:
            plain_seconds, plain = best_of(1, lambda: compute_table_plain(arrays, top))
            assert plain[0][length][top] == table[0, length, top], "plain and compiled tables disagree"
            plain_text, ratio = f"{plain_seconds:11.2f}", f"{plain_seconds / table_seconds:11.0f}x"
        else:
            plain_text, ratio = f"{'-':>11}", f"{'-':>12}"
        print(f"{length:4d} {slots:5d} {end_to_end:10.3f} {table_seconds:11.3f} {plain_text} {ratio} "
              f"{plan.predicted.overhead:8.1%}")


def rotor_against_sqrt(length, seeds):
    """At the peak of each √n-style segment count, Rotor's overhead against Chen's."""
    print(f"\nRotor vs Chen's segments at Chen's own peak (L = {length}, {len(seeds)} chains)")
    print(f"{'seed':>4} {'segments':>8} {'budget':>12} {'sqrt overhead':>14} {'rotor overhead':>15} "
          f"{'rotor/sqrt time':>16}")
    for seed in seeds:
        chain = random_chain(length, seed=seed, tmp=True, params=True)
        simulator = ChainSimulator(chain)
        for segments in (round(length ** 0.5), length // 2):
            chen = simulator.run(segments_schedule(length, segments))
            rotor_plan = solve(chain, chen.peak_bytes, "rotor")
            baseline = rotor_plan.predicted.baseline_time
            print(f"{seed:4d} {segments:8d} {chen.peak_bytes:12d} {chen.time / baseline - 1:14.1%} "
                  f"{rotor_plan.predicted.overhead:15.1%} {rotor_plan.predicted.time / chen.time:16.3f}")


def identical_blocks(blocks, repeats):
    """The hierarchical solver on ``blocks`` identical blocks of six options each (a profiled transformer's):
    seconds against Rotor's on the same chain (tests/solvers/test_hierarchical.py checks the plans; it asked
    for 5 s at 48 blocks)."""
    seed = next(seed for seed in range(1000)
                if len(random_chain(1, seed, tmp=True, params=True, options=6).stages[0].options) == 6)
    one = random_chain(1, seed, tmp=True, params=True, options=6).stages[0]
    base = random_chain(blocks, 7, tmp=True, params=True)
    chain = Chain(name="blocks", device="d", input_bytes=base.input_bytes, stages=(one,) * blocks, loss=base.loss)
    budget = (minimum_budget(chain) + store_all_peak(chain)) // 3
    hierarchical, _ = best_of(repeats, lambda: solve(chain, budget, "hierarchical"))
    rotor, _ = best_of(repeats, lambda: solve(chain, budget, "rotor"))
    print(f"\n{blocks} identical blocks, 6 options each: hierarchical {hierarchical:.2f} s, rotor {rotor:.2f} s")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[20, 50, 100, 200])
    parser.add_argument("--slots", type=int, default=500)
    parser.add_argument("--plain-up-to", type=int, default=50, help="longest chain to run the plain DP on")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--blocks", type=int, default=48, help="identical blocks for the hierarchical solver")
    args = parser.parse_args()
    print(f"cores: {os.cpu_count()}")
    solve_times(args.lengths, args.slots, args.plain_up_to, args.repeats)
    rotor_against_sqrt(30, seeds=range(4))
    identical_blocks(args.blocks, args.repeats)


if __name__ == "__main__":
    main()
