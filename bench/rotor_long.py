"""Rotor on long chains (issue 19) against Chen's √n segments and Revolve at equal memory, in one run.

    python bench/rotor_long.py [--lengths 500 1000 2000] [--tight 0.1]

Chains are synthetic and heterogeneous (profiles.synthetic.random_chain(L, seed=L) with temporaries and
parameter gradients); the budgets are halfway between the least feasible memory and the store-all peak, and a
tighter one (``--tight`` of the way). Step times are the simulator's predictions. Each Rotor solve runs in a
fresh process, so that its peak RSS (VmHWM, or ``resource.getrusage``) is its own: the solve seconds are the plan's
``solve_seconds`` (Rotor alone; ``solve()`` also computes the exact least memory, timed apart), and the RSS
before the solve (Python, numpy, numba, the chain, the least-memory table) is printed beside the peak.

Revolve's advance table (solvers.revolve.advance_table, a numpy loop of L² steps) would take about half an
hour at L = 2000, so it is filled here by a compiled loop with the same arithmetic and tie rule, checked
equal to revolve's own at a small size, and handed to revolve's cache: ``solve(..., "revolve")`` then runs
as it is, with its own search and schedule.
"""

import argparse
import importlib
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numba  # noqa: E402
import numpy as np  # noqa: E402

from planner import MemschedError  # noqa: E402
from profiles.synthetic import random_chain  # noqa: E402
from solvers import solve, store_all_peak  # noqa: E402
from solvers.minimum import minimum_budget  # noqa: E402

revolve_module = importlib.import_module("solvers.revolve")  # `solvers.revolve` is the solver function


@numba.njit(cache=True)
def _advance_table(max_length, max_snapshots):
    """revolve.advance_table's loop, compiled: same sums in the same order, first minimum kept."""
    cost = np.full((max_snapshots + 1, max_length + 1), np.inf)
    split = np.zeros((max_snapshots + 1, max_length + 1), dtype=np.int64)
    cost[:, 1] = 0
    for s in range(1, max_snapshots + 1):
        for length in range(2, max_length + 1):
            best, argument = np.inf, 0
            for m in range(1, length):
                total = float(m) + cost[s - 1, length - m] + cost[s, m]
                if total < best:
                    best, argument = total, m - 1
            cost[s, length], split[s, length] = best, argument + 1
    return cost, split


def install_revolve_table(length):
    revolve_module._table_cache.clear()
    own = revolve_module.advance_table(60, 30)
    compiled = _advance_table(60, 30)
    assert np.array_equal(own[0], compiled[0]) and np.array_equal(own[1], compiled[1]), "tables differ"
    revolve_module._table_cache["table"] = _advance_table(length, length)


def rss_mib():
    """Peak RSS of this process so far, MiB: /proc's VmHWM where there is one (getrusage's ru_maxrss in a child
    started by subprocess also counts the parent's memory at the fork), else getrusage."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def child(length, fraction):
    """One Rotor solve in this fresh process; prints its figures as JSON."""
    warm = random_chain(4, 0)
    solve(warm, store_all_peak(warm) - 1, "rotor")  # compile or load numba's cache before measuring
    chain = random_chain(length, seed=length, tmp=True, params=True)
    started = time.perf_counter()
    low = minimum_budget(chain)
    minimum_seconds = time.perf_counter() - started
    high = store_all_peak(chain)
    budget = int(low + fraction * (high - low))
    before = rss_mib()
    plan = solve(chain, budget, "rotor")
    print(json.dumps({"time": plan.predicted.time, "peak": plan.predicted.peak_bytes, "budget": budget,
                      "solve_seconds": plan.solve_seconds, "minimum_seconds": minimum_seconds,
                      "rss_before": before, "rss_peak": rss_mib(), "params": plan.params,
                      "optimal": plan.optimal}))


def ratio(rotor_time, chain, budget, name):
    """``(rotor's time over the solver's, as text, solve seconds)``; "-" when the solver's plan does not fit."""
    started = time.perf_counter()
    try:
        other = solve(chain, budget, name).predicted.time
    except MemschedError:
        return "-", time.perf_counter() - started
    return f"{rotor_time / other:.3f}", time.perf_counter() - started


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[500, 1000, 2000])
    parser.add_argument("--tight", type=float, default=0.1, help="the tighter budget, as a fraction of the way")
    parser.add_argument("--child", nargs=2, metavar=("L", "FRACTION"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(int(args.child[0]), float(args.child[1]))
        return
    print(f"cores: {os.cpu_count()}")
    header = (f"{'L':>5} {'budget':>8} {'rotor/sqrt':>10} {'rotor/revolve':>13} {'rotor s':>8} {'RSS MiB':>8} "
              f"{'(before)':>8} {'minimum s':>9} {'sqrt s':>7} {'revolve s':>9}  rotor's params")
    print(header)
    for length in args.lengths:
        chain = random_chain(length, seed=length, tmp=True, params=True)
        low, high = minimum_budget(chain), store_all_peak(chain)
        install_revolve_table(length)
        for label, fraction in (("half", 0.5), (f"{args.tight:.0%}", args.tight)):
            budget = int(low + fraction * (high - low))
            output = subprocess.run([sys.executable, __file__, "--child", str(length), str(fraction)],
                                    check=True, capture_output=True, text=True).stdout
            rotor = json.loads(output.strip().splitlines()[-1])
            assert rotor["budget"] == budget and rotor["peak"] <= budget
            (sqrt_ratio, sqrt_seconds), (revolve_ratio, revolve_seconds) = (
                ratio(rotor["time"], chain, budget, name) for name in ("sqrt", "revolve"))
            print(f"{length:5d} {label:>8} {sqrt_ratio:>10} {revolve_ratio:>13} "
                  f"{rotor['solve_seconds']:8.1f} {rotor['rss_peak']:8.0f} {rotor['rss_before']:8.0f} "
                  f"{rotor['minimum_seconds']:9.1f} {sqrt_seconds:7.1f} {revolve_seconds:9.1f}  "
                  f"{rotor['params']}{'' if rotor['optimal'] else ', not optimal'}", flush=True)


if __name__ == "__main__":
    main()
