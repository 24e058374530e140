"""Solve time and optimality gap of the graph solvers on training graphs of 100 to 300 nodes.

    python bench/graph_solvers.py [GRAPH.json ...] [--sizes 100,200,300] [--shape transformer]
                                  [--budgets 50,75] [--solvers checkmate-highs,checkmate-cbc,checkmate-lp,moccasin]
                                  [--time-limit 60]

Without graph files it draws synthetic training graphs (profiles.synthetic.random_graph, a transformer- or
resnet-like forward part and its mirrored backward) of each size. Budgets are percentages of the store-all
peak. Each solve runs once with the time limit; the table gives the wall-clock seconds (model building
included), whether the solver proved its schedule optimal, the gap to its bound on the step time, and the
step-time overhead of the simulated plan.
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from planner.errors import MemschedError  # noqa: E402
from planner.graph import load_graph  # noqa: E402
from profiles.synthetic import random_graph  # noqa: E402
from solvers.graph import solve_graph, store_all_graph_peak  # noqa: E402

SOLVERS = {
    "checkmate-highs": ("checkmate", {"backend": "highs"}),
    "checkmate-cbc": ("checkmate", {"backend": "cbc"}),
    "checkmate-lp": ("checkmate-lp", {}),
    "moccasin": ("moccasin", {}),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("graphs", nargs="*", metavar="GRAPH.json")
    parser.add_argument("--sizes", default="100,200,300")
    parser.add_argument("--shape", default="transformer", choices=("random", "resnet", "transformer"))
    parser.add_argument("--budgets", default="50,75", help="percentages of the store-all peak")
    parser.add_argument("--solvers", default=",".join(SOLVERS))
    parser.add_argument("--time-limit", type=float, default=60.0)
    args = parser.parse_args()
    graphs = [load_graph(path) for path in args.graphs] or [
        random_graph(0, int(size), shape=args.shape) for size in args.sizes.split(",")]
    print("| graph | nodes | budget | solver | seconds | optimal | gap | overhead |")
    print("|---|---:|---:|---|---:|---|---:|---:|")
    for graph in graphs:
        peak = store_all_graph_peak(graph)
        for percent in args.budgets.split(","):
            budget = peak * int(percent) // 100
            for label in args.solvers.split(","):
                name, params = SOLVERS[label]
                started = time.perf_counter()
                try:
                    plan = solve_graph(graph, budget, name, time_limit=args.time_limit, minimum_time_limit=1, **params)
                except MemschedError as exc:
                    seconds = time.perf_counter() - started
                    print(f"| {graph.name} | {graph.size} | {percent}% | {label} | {seconds:.1f} | — | — | "
                          f"{str(exc)[:90]} |", flush=True)
                    continue
                seconds = time.perf_counter() - started
                gap = "—" if plan.gap is None else f"{plan.gap:.2%}"
                print(f"| {graph.name} | {graph.size} | {percent}% | {label} | {seconds:.1f} | "
                      f"{'yes' if plan.optimal else 'no'} | {gap} | {plan.predicted.overhead:.2%} |", flush=True)


if __name__ == "__main__":
    main()
