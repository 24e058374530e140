"""PNG plots: a simulated plan's memory timeline and the overhead-against-budget Pareto front.

matplotlib is imported inside the functions (Agg canvas, no pyplot state), so
the command line loads it only for ``--plot``. Inputs are bytes and seconds;
the axes show MiB, seconds and percent.
"""

import math

from planner.jsonio import write_atomic
from planner.render import op_categories
from planner.units import format_bytes

MIB = 2**20
_CATEGORY_COLOURS = {"forward": "tab:blue", "recomputed forward": "tab:orange", "loss": "tab:purple",
                     "backward": "tab:green", "transfer": "tab:gray"}


def _figure():
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 4.5), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _save(figure, path) -> None:
    write_atomic(path, lambda handle: figure.savefig(handle, format="png", dpi=120), binary=True)


def plot_timeline(result, budget_bytes: int, path, title: str, categories=None) -> None:
    """Save a PNG of memory (MiB) against time (seconds) for a :class:`planner.simulate.chain.SimResult`.

    Each operation is drawn as a step from the memory before it to its peak,
    held for its duration, then down to the memory after it; the area under
    each peak is coloured by kind (first forward, recomputed forward, loss,
    backward, transfer; a chain's by default, ``categories`` per operation
    otherwise, as :func:`planner.render.graph_op_categories` gives them for a
    graph plan). A dashed line marks ``budget_bytes``, a triangle the peak; an
    offload plan's copies are bars below zero (to the host, then back).
    """
    figure = _figure()
    axes = figure.add_subplot()
    steps = result.timeline
    top = max(budget_bytes, result.peak_bytes)
    times, memory = [], []
    for step in steps:
        times += [step.start, step.start, step.end, step.end]
        memory += [step.memory_before / MIB, step.peak / MIB, step.peak / MIB, step.memory_after / MIB]
    categories = categories or op_categories(step.op for step in steps)
    for category, colour in _CATEGORY_COLOURS.items():
        spans = [step for step, kind in zip(steps, categories) if kind == category]
        if spans:
            axes.bar([s.start for s in spans], [s.peak / MIB for s in spans], width=[s.end - s.start for s in spans],
                     align="edge", color=colour, alpha=0.35, linewidth=0, label=category)
    axes.plot(times, memory, color="black", linewidth=0.8)
    axes.axhline(budget_bytes / MIB, color="tab:red", linestyle="--", label=f"budget {format_bytes(budget_bytes)}")
    peak = max(steps, key=lambda step: step.peak)
    axes.plot([(peak.start + peak.end) / 2], [peak.peak / MIB], marker="v", color="tab:red", linestyle="none",
              label=f"peak {format_bytes(peak.peak)} ({peak.op})")
    for copy in getattr(result, "copies", ()):  # an offload plan: each copy as a bar under the axis
        level = -0.03 if copy.direction == "d2h" else -0.06
        axes.plot([copy.start, copy.end], [level * top / MIB] * 2, color="tab:gray" if copy.direction == "d2h"
                  else "tab:brown", linewidth=3, solid_capstyle="butt")
    if getattr(result, "copies", ()):
        axes.plot([], [], color="tab:gray", linewidth=3, label="copy to host")
        axes.plot([], [], color="tab:brown", linewidth=3, label="copy to device")
    axes.set_xlim(0, result.time)
    axes.set_ylim(-0.08 * top / MIB if getattr(result, "copies", ()) else 0, top / MIB * 1.08)
    axes.set_xlabel("time (s)")
    axes.set_ylabel("memory (MiB)")
    axes.set_title(title)
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    _save(figure, path)


def plot_pareto(rows, solver_names, path, title: str) -> None:
    """Save a PNG of step-time overhead (%) against budget (MiB), one line per solver.

    ``rows`` holds ``(budget_bytes, {solver: overhead fraction or None})``;
    a None (no schedule within that budget) leaves a gap in the solver's line.
    """
    figure = _figure()
    axes = figure.add_subplot()
    budgets = [budget / MIB for budget, _ in rows]
    for name in solver_names:
        overheads = [math.nan if values[name] is None else values[name] * 100 for _, values in rows]
        axes.plot(budgets, overheads, marker="o", label=name)
    axes.set_xlabel("budget (MiB)")
    axes.set_ylabel("overhead over no recomputation (%)")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend()
    _save(figure, path)
