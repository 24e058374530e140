"""Solve time and optimality gap of the graph solvers on the built-in models' training graphs of 100 to 300 nodes.

    python bench/graph_solvers.py [GRAPH.json ...] [--model SPEC ...] [--nodes 100,200,300] [--synthetic]
                                  [--budgets 50,75]
                                  [--solvers greedy,checkmate-highs,checkmate-cbc,checkmate-lp,moccasin]
                                  [--time-limit 60] [--gap 0.01] [--save DIR]

Without graph files it profiles each ``--model`` (default: the built-in gpt-tiny, resnet-tiny and unet-tiny,
sized so that their joint graphs have enough operations) with ``profiles.graph_profiler.profile_graph(...,
nodes=N, estimate=True)`` for each N of ``--nodes``: the coarsened graph has at most N nodes, fewer when the
model has fewer operations (a graph already benched is not benched again). ``--synthetic`` draws
``profiles.synthetic.random_graph`` transformer-like graphs of each size instead; ``--save DIR`` writes the
graphs there. Budgets are percentages of the store-all peak. Each solve runs once with the time limit, one
after the other; the table gives the wall-clock seconds (model building and the warm-start heuristic
included), whether the solver proved its schedule optimal, the gap between the schedule's step time and the
solver's bound on it, and the step-time overhead of the simulated plan.
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from planner.errors import MemschedError  # noqa: E402
from planner.graph import load_graph, save_graph  # noqa: E402
from planner.simulate.graph import GraphSimulator, schedule_with_frees  # noqa: E402
from solvers import solve_graph, store_all_graph_peak  # noqa: E402
from solvers.graph_heuristic import greedy_order  # noqa: E402

SOLVERS = {
    "checkmate-highs": ("checkmate", {"backend": "highs"}),
    "checkmate-cbc": ("checkmate", {"backend": "cbc"}),
    "checkmate-lp": ("checkmate-lp", {"backend": "cbc"}),  # CLP solves these LPs far faster than HiGHS
    "moccasin": ("moccasin", {}),
}
# built-in models with enough operations for 300-node graphs (unet-tiny: about 8 per level, 98 at 11 levels)
MODELS = ("gpt-tiny:layers=10", "resnet-tiny:blocks=32", "unet-tiny:levels=11,size=2048,channels=1,batch=8")


def model_graphs(specs, sizes):
    """The coarsened joint graphs of each model at each size (estimated: no allocation, times from FLOPs)."""
    from profiles.graph_profiler import profile_graph
    from profiles.spec import load_model

    seen = set()
    for spec in specs:
        model, _ = load_model(spec)
        for size in sizes:
            graph = profile_graph(model.stages, model.example_inputs, model.loss_fn, nodes=size, estimate=True,
                                  name=spec.split(":")[0])
            if graph.fingerprint() not in seen:
                seen.add(graph.fingerprint())
                yield graph


def greedy_row(graph, budget: int, percent: str) -> None:
    """The warm-start heuristic alone (solvers.graph_heuristic.greedy_order), as a table row."""
    started = time.perf_counter()
    order = greedy_order(graph, budget)
    seconds = time.perf_counter() - started
    if order is None:
        print(f"| {graph.name} | {graph.size} | {percent}% | greedy | {seconds:.1f} | — | — | no schedule found |")
        return
    result = GraphSimulator(graph).run(schedule_with_frees(graph, order))
    print(f"| {graph.name} | {graph.size} | {percent}% | greedy | {seconds:.1f} | no | — | "
          f"{result.time / graph.compute_time - 1:.2%} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("graphs", nargs="*", metavar="GRAPH.json")
    parser.add_argument("--model", action="append", help="built-in model SPEC (repeatable)")
    parser.add_argument("--nodes", "--sizes", dest="nodes", default="100,200,300")
    parser.add_argument("--synthetic", action="store_true", help="synthetic transformer-like graphs instead")
    parser.add_argument("--budgets", default="50,75", help="percentages of the store-all peak")
    parser.add_argument("--solvers", default=",".join(("greedy",) + tuple(SOLVERS)),
                        help="comma-separated: greedy (the warm start alone), " + ", ".join(SOLVERS))
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--gap", type=float, default=0.0,
                        help="checkmate: stop at this relative gap (default 0: prove optimality)")
    parser.add_argument("--save", metavar="DIR", help="write the graphs there")
    args = parser.parse_args()
    sizes = [int(size) for size in args.nodes.split(",")]
    if args.graphs:
        graphs = (load_graph(path) for path in args.graphs)
    elif args.synthetic:
        from profiles.synthetic import random_graph

        graphs = (random_graph(0, size, shape="transformer") for size in sizes)
    else:
        graphs = model_graphs(args.model or MODELS, sizes)
    print("| graph | nodes | budget | solver | seconds | optimal | gap | overhead |")
    print("|---|---:|---:|---|---:|---|---:|---:|")
    for graph in graphs:
        if args.save:
            save_graph(graph, Path(args.save) / f"{graph.name}-{graph.size}.graph.json")
        peak = store_all_graph_peak(graph)
        for percent in args.budgets.split(","):
            budget = peak * int(percent) // 100
            for label in args.solvers.split(","):
                if label == "greedy":
                    greedy_row(graph, budget, percent)
                    continue
                name, params = SOLVERS[label]
                if name == "checkmate" and args.gap:
                    params = {**params, "gap": args.gap}
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
