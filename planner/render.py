"""Text for the command line: plan summaries, the compact schedule, the ASCII memory timeline, the Pareto table.

Pure text, no matplotlib (planner/plot.py draws the PNGs). Sizes are bytes
and durations seconds on input; the text shows both bytes and a binary-unit
form (planner.units.format_bytes).
"""

import shutil
import statistics
import sys
import time

from planner.ops import FORWARD_OPS, TRANSFER_OPS
from planner.units import describe_bytes, format_bytes

# Categories of operations, with the letter the ASCII timeline uses for each.
CATEGORY_LETTERS = {"forward": "F", "recomputed forward": "R", "loss": "L", "backward": "B", "transfer": "T"}


def format_seconds(seconds: float) -> str:
    """Seconds with six significant digits: ``0.416284 s``."""
    return f"{seconds:.6g} s"


def format_percent(fraction: float) -> str:
    """A fraction as a percentage with one decimal: 0.1503 -> ``15.0%``."""
    # Adding 0.0 turns the -0.0 that rounding a tiny negative float gives into 0.0.
    return f"{round(fraction * 100, 1) + 0.0:.1f}%"


def op_categories(ops) -> list:
    """Per operation: 'forward' (first forward of its stage), 'recomputed forward', 'loss', 'backward' or
    'transfer' (Offload, Release, Prefetch)."""
    seen, categories = set(), []
    for op in ops:
        if op.kind in TRANSFER_OPS:
            categories.append("transfer")
        elif op.kind in FORWARD_OPS:
            categories.append("recomputed forward" if op.stage in seen else "forward")
            seen.add(op.stage)
        else:
            categories.append("loss" if op.kind == "Loss" else "backward")
    return categories


def graph_op_categories(schedule, graph) -> list:
    """Per graph operation: 'forward', 'recomputed forward', 'backward' (a backward node, computed or recomputed)
    or 'free'."""
    seen, categories = set(), []
    for op in schedule:
        if op.kind == "free":
            categories.append("free")
        else:
            categories.append("backward" if graph.nodes[op.node].backward
                              else "recomputed forward" if op.node in seen else "forward")
            seen.add(op.node)
    return categories


def graph_timeline(result, plan, categories, width: int = 60) -> list:
    """:func:`ascii_timeline` for a graph plan, its letters those of graph operations (the operation peaking in
    each column, as there)."""
    lines = ascii_timeline(result, plan.budget_bytes, width=width)
    letter = {"forward": "F", "recomputed forward": "R", "backward": "B", "free": "."}
    steps = result.timeline
    count = len(steps)
    columns = []
    for c in range(width):
        first = c * count // width
        columns.append(max(steps[first:max(first + 1, (c + 1) * count // width)], key=lambda step: step.peak))
    lines[-3] = lines[-3][:len(lines[-3]) - width] + "".join(letter[categories[step.index]] for step in columns)
    lines[-1] = "F forward, R recomputed forward, B backward (computed or recomputed), . free (the operation peaking " \
                "in each column)"
    return lines


def _ranges(items, steps=(1, -1)) -> list:
    """``(kind, index, what)`` items as ranges: consecutive items of one kind and ``what`` whose index moves by
    one of ``steps``, always the same way, become one (``F_all 5-19``, ``B 19-5``); an index of None stands
    alone (``Loss``)."""
    groups = []  # [kind, first index, last index, direction (a step, or 0 while single), what]
    for new_kind, index, new_what in items:
        if groups and index is not None:
            kind, first, last, direction, what = groups[-1]
            step = index - last if last is not None else None
            if (kind, what) == (new_kind, new_what) and step in steps and direction in (0, step):
                groups[-1] = [kind, first, index, step, what]
                continue
        groups.append([new_kind, index, index, 0, new_what])
    return [(kind if first is None else f"{kind} {first}" if first == last else f"{kind} {first}-{last}")
            + (f" {what}" if what else "") for kind, first, last, _, what in groups]


def compact_schedule(schedule, width: int = None) -> str:
    """The schedule as ranges: ``F_ck 0, F_none 1-4, F_all 5-19, Loss, B 19-5, F_all 0-4, B 4-0``; an ``F_all``
    with stage option ``k`` is ``F_all[k]``.

    One line, or with ``width`` lines of at most ``width`` characters broken between ranges.
    """
    return _wrapped(_ranges((op.kind if op.option is None else f"{op.kind}[{op.option}]", op.stage, op.what)
                            for op in schedule), width)


def compact_graph_schedule(schedule, width: int = None) -> str:
    """A graph schedule as ascending ranges: ``compute 0-5, free 2, compute 6, free 0-1``, as
    :func:`compact_schedule` breaks them."""
    return _wrapped(_ranges(((op.kind, op.node, None) for op in schedule), steps=(1,)), width)


def _wrapped(items, width) -> str:
    lines, line = [], ""
    for item in items:
        candidate = f"{line}, {item}" if line else item
        if width is not None and line and len(candidate) + 1 > width:
            lines.append(line + ",")
            candidate = item
        line = candidate
    return "\n".join(lines + [line])


def _solver_text(plan, requested: str = None) -> str:
    params = ", ".join(f"{key}={value}" for key, value in plan.params.items())
    chosen = f" (chosen by {requested})" if requested not in (None, plan.solver) else ""
    return f"{plan.solver}{chosen}" + (f", {params}" if params else "")


def optimality(plan, gap: bool = False) -> str:
    """``yes`` or ``no``; with ``gap``, ``no (gap 1.5% to the solver's bound)`` when the solver reported one."""
    if plan.optimal:
        return "yes"
    return "no" if not gap or plan.gap is None else f"no (gap {format_percent(plan.gap)} to the solver's bound)"


def solve_summary(plan, requested: str, result=None) -> list:
    """Lines describing a fresh chain plan: solver, peak against budget, step time, overhead, recomputations,
    solve time (and for an offload plan its channel, with its simulation ``result`` the copies and stalls)."""
    return _summary(plan, requested, "chain", f"{plan.recomputed_forwards} forwards",
                    transfer_lines(plan, result) + update_lines(plan), optimality(plan))


def graph_solve_summary(plan, requested: str) -> list:
    """:func:`solve_summary` for a fresh graph plan: its recomputations, and the gap of a plan not proven optimal."""
    return _summary(plan, requested, "graph", f"{plan.recomputed_forwards} computations", [],
                    optimality(plan, gap=True))


def _summary(plan, requested, problem: str, recomputed: str, transfers: list, optimal: str) -> list:
    predicted = plan.predicted
    return [
        f"{problem:<10} {plan.problem_name}",
        f"solver     {_solver_text(plan, requested)}",
        f"budget     {describe_bytes(plan.budget_bytes)}",
        f"peak       {describe_bytes(predicted.peak_bytes)}, "
        f"{format_percent(predicted.peak_bytes / plan.budget_bytes)} of the budget",
        f"step time  {format_seconds(predicted.time)} per training step "
        f"(no recomputation: {format_seconds(predicted.baseline_time)})",
        f"overhead   {format_percent(predicted.overhead)} over no recomputation",
        f"recomputed {recomputed}",
        *transfers,
        f"solved in  {format_seconds(plan.solve_seconds)}, optimal: {optimal}",
    ]


def transfer_lines_for_channel(channel, what: str) -> list:
    """One line naming a copy channel (:class:`planner.transfer.Transfer`) and what uses it; none without one."""
    if channel is None:
        return []
    return [f"channel    {format_bytes(round(channel.d2h_bandwidth))}/s to host, "
            f"{format_bytes(round(channel.h2d_bandwidth))}/s back, {format_seconds(channel.latency)} latency "
            f"per copy ({what})"]


def transfer_lines(plan, result=None) -> list:
    """For an offload plan: its channel, and with a simulation (an :class:`OffloadResult`) its copies and stalls."""
    if not plan.moves_data:
        return []
    offloads = sum(op.kind == "Offload" for op in plan.schedule)
    lines = transfer_lines_for_channel(plan.transfer, f"{offloads} offloads")
    if result is not None:
        moved = sum(copy.nbytes for copy in result.copies if copy.direction == "d2h")
        lines.append(f"copies     {format_bytes(moved)} each way; stalls {format_seconds(result.stall_time)} "
                     f"({format_percent(result.stall_time / result.time if result.time else 0.0)} of the step)")
    return lines


def update_lines(plan) -> list:
    """For a chain plan whose optimizer updates inside the backward: when, where, and over which channel; for one
    accumulating gradients over micro-batches, how many."""
    if plan.accumulate > 1:
        return [f"accumulate {plan.accumulate} micro-batches per optimizer step: the peak is each one's after the "
                "first (every gradient held from its start), the time each micro-batch's"]
    if plan.update == "after":
        return []
    where = "" if plan.update != "on-host" or plan.host_stages is None else (
        f" for stages {', '.join(map(str, plan.host_stages))} (the others on the device)")
    return [f"update     {plan.update}{where}: each stage's parameters updated, and gradients freed, after its "
            "backward",
            *(transfer_lines_for_channel(plan.transfer, "gradients out, parameters back") if plan.transfer else [])]


def plan_header(plan) -> list:
    """Lines naming a stored chain plan's problem and solver, with its budget and predicted peak, time and
    overhead, and its optimizer update when inside the backward."""
    header = _header(plan, " (optimal)" if plan.optimal else "", f"{plan.recomputed_forwards} forwards recomputed")
    return header[:-1] + update_lines(plan) + header[-1:]  # the last line introduces the schedule


def graph_plan_header(plan) -> list:
    """:func:`plan_header` for a stored graph plan: optimal or not (with its gap), and its recomputations."""
    return _header(plan, f" (optimal: {optimality(plan, gap=True)})", f"{plan.recomputed_forwards} recomputations")


def _header(plan, optimal: str, recomputed: str) -> list:
    predicted = plan.predicted
    return [
        f"plan for   {plan.problem_name} ({plan.fingerprint[:19]}...)",
        f"solver     {_solver_text(plan)}{optimal}",
        f"budget     {describe_bytes(plan.budget_bytes)}",
        f"peak       {describe_bytes(predicted.peak_bytes)} predicted",
        f"step time  {format_seconds(predicted.time)} predicted, overhead {format_percent(predicted.overhead)}",
        *transfer_lines(plan),
        f"schedule   {len(plan.schedule)} operations, {recomputed}:",
    ]


def plan_lines(plan, result=None) -> list:
    """A stored chain plan: :func:`plan_header` and the schedule; with its re-simulation ``result``, the simulated
    peak and time, the copies and stalls of an offload plan, and the ASCII memory timeline."""
    lines = plan_header(plan) + ["  " + line for line in compact_schedule(plan.schedule, width=76).splitlines()]
    if result is not None:
        lines += [""] + simulation_lines(plan, result) + transfer_lines(plan, result)[1:]
        lines += [""] + ascii_timeline(result, plan.budget_bytes)
    return lines


def graph_plan_lines(plan, graph=None, result=None) -> list:
    """A stored graph plan: :func:`graph_plan_header` and the schedule; with its ``graph`` and re-simulation
    ``result``, the simulated peak and time and the memory timeline (:func:`graph_timeline`)."""
    lines = graph_plan_header(plan)
    lines += ["  " + line for line in compact_graph_schedule(plan.schedule, width=76).split("\n")]
    if result is not None:
        categories = graph_op_categories(plan.schedule, graph)
        lines += [""] + simulation_lines(plan, result) + [""] + graph_timeline(result, plan, categories)
    return lines


def shown_plan_lines(plan, graph=None, result=None) -> list:
    """``memsched show``: :func:`plan_lines`, :func:`graph_plan_lines` or :func:`pipeline_lines` by the plan's kind;
    with its re-simulation ``result`` (and, for a graph plan, its ``graph``), what the simulation adds."""
    if plan.kind == "graph":
        return graph_plan_lines(plan, graph, result)
    if plan.kind != "pipeline":
        return plan_lines(plan, result)
    if result is None:
        return pipeline_lines(plan)
    return pipeline_lines(plan) + [""] + simulation_lines(plan, result) + [""] + pipeline_memory_lines(result)


def pipeline_memory_lines(result) -> list:
    """Per device of a simulated pipeline (planner.simulate.pipeline.PipelineResult), what its peak is made of
    (bytes): the resident state (parameters, master copy, optimizer state), the step's buffers (inputs and
    received gradients), the parameter gradients, one micro-batch held between forward and backward, the
    forwards before the first backward, and the step's peak above resident state and buffers."""
    lines = [f"{'device':>6} {'resident':>12} {'buffers':>12} {'gradients':>12} {'held/micro':>12} {'in flight':>9} "
             f"{'step peak':>12} {'peak':>12}"]
    for index, device in enumerate(result.devices):
        lines.append(f"{index:>6} {format_bytes(device.resident_bytes):>12} {format_bytes(device.buffer_bytes):>12} "
                     f"{format_bytes(device.gradient_bytes):>12} {format_bytes(device.micro.held):>12} "
                     f"{device.in_flight:>9} {format_bytes(device.step_peak):>12} "
                     f"{format_bytes(device.peak_bytes):>12}")
    return lines


def simulation_lines(plan, result) -> list:
    """Lines on a re-simulation (peak in bytes, time in seconds), flagging a plan whose stored prediction differs."""
    lines = [f"simulated  peak {describe_bytes(result.peak_bytes)}, step time {format_seconds(result.time)}"]
    if (result.peak_bytes, result.time) != (plan.predicted.peak_bytes, plan.predicted.time):
        lines.append("note       the plan's stored prediction differs from this simulation; "
                     "the plan file was edited or comes from another simulator")
    return lines


def ascii_timeline(result, budget_bytes: int, width: int = 60, height: int = 10) -> list:
    """Memory over the operations of a simulation, as ``height`` rows of ``width`` columns of ASCII.

    Each column covers one or more consecutive operations and rises to their
    highest peak (bytes). The row holding ``budget_bytes`` is drawn with ``-``
    where no bar reaches, ``v`` above the chart marks the column of the peak,
    and the letters under the axis say which kind of operation peaks in each
    column (F first forward, R recomputed forward, L loss, B backward).
    """
    steps = result.timeline
    count = len(steps)
    columns = []  # per column, the step with the highest peak among those it covers
    for c in range(width):
        first = c * count // width
        covered = steps[first:max(first + 1, (c + 1) * count // width)]
        columns.append(max(covered, key=lambda step: step.peak))
    top = max(budget_bytes, result.peak_bytes)
    budget_row = height - max(1, -(-budget_bytes * height // top))  # the row whose band holds the budget
    peak_step = max(steps, key=lambda step: step.peak)
    peak_column = next(c for c, step in enumerate(columns) if step.peak == peak_step.peak)
    letters = [CATEGORY_LETTERS[category] for category in op_categories(step.op for step in steps)]
    label_width = max(len(format_bytes(top)), len("0 B"))
    lines = [
        f"memory over {count} operations: peak {format_bytes(result.peak_bytes)} at operation {peak_step.index} "
        f"({peak_step.op}), budget {format_bytes(budget_bytes)}",
        " " * (label_width + 2) + " " * peak_column + "v peak",
    ]
    for row in range(height):
        floor = top * (height - row - 1) / height  # a bar fills this row when its peak is above the band's floor
        blank = "-" if row == budget_row else " "
        cells = "".join("#" if step.peak > floor else blank for step in columns)
        label = format_bytes(top * (height - row) // height)
        suffix = " budget" if row == budget_row else ""
        lines.append(f"{label:>{label_width}} |{cells}{suffix}".rstrip())
    lines += [
        f"{'0 B':>{label_width}} +" + "-" * width,
        " " * (label_width + 2) + "".join(letters[step.index] for step in columns),
        " " * (label_width + 2) + f"op 0{f'op {count - 1}':>{width - 4}}",
        "F forward, R recomputed forward, L loss, B backward" + (", T transfer" if "T" in letters else "")
        + " (the operation peaking in each column)",
    ]
    return lines


def pareto_table(rows, solver_names, store_all_peak: int) -> list:
    """The overhead table: one row per budget (bytes, % of ``store_all_peak``), per solver the overhead or ``—``.

    ``rows`` holds ``(budget_bytes, {solver: overhead fraction or None})``;
    None means that solver has no schedule within the budget.
    """
    header = f"{'budget':>22} {'% peak':>7}" + "".join(f" {name:>10}" for name in solver_names)
    lines = [header]
    for budget, overheads in rows:
        cells = "".join(f" {'—' if overheads[name] is None else format_percent(overheads[name]):>10}"
                        for name in solver_names)
        lines.append(f"{format_bytes(budget):>10} {budget:>11} {format_percent(budget / store_all_peak):>7}{cells}")
    return lines


def pareto_report(chain, sweep, channel=None) -> list:
    """``memsched pareto``'s text for a :class:`solvers.budgets.Sweep` of ``chain`` (over ``channel``, if any)."""
    low, high = sweep.rows[0][0], sweep.rows[-1][0]  # the minimum feasible budget, the store-all peak
    return [
        f"chain {chain.name}: step-time overhead over no recomputation ({format_seconds(chain.compute_time)})",
        f"budgets from the minimum feasible {describe_bytes(low)} to the store-all peak {describe_bytes(high)}",
        *transfer_lines_for_channel(channel, "pofo: its table, not re-timed; offload_greedy: on store-all"),
        "",
        *pareto_table(sweep.rows, sweep.solvers, high),
        "",
        "— : that solver has no schedule within the budget",
    ]


def chain_table(chain) -> list:
    """A chain's stages as a table: times in milliseconds, sizes in binary units."""
    header = (f"{'stage':<14} {'fwd ms':>8} {'bwd ms':>8} {'out':>10} {'saved':>10} {'fwd tmp':>10} {'bwd tmp':>10} "
              f"{'params':>10}")
    lines = [header]
    for stage in chain.stages:
        lines.append(
            f"{stage.name[:14]:<14} {stage.fwd_time * 1e3:8.3f} {stage.bwd_time * 1e3:8.3f} "
            f"{format_bytes(stage.out_bytes):>10} {format_bytes(stage.saved_bytes):>10} "
            f"{format_bytes(stage.fwd_tmp_bytes):>10} {format_bytes(stage.bwd_tmp_bytes):>10} "
            f"{format_bytes(stage.param_bytes):>10}"
        )
    lines.append(f"{'loss':<14} {'':>8} {chain.loss.bwd_time * 1e3:8.3f} {'':>10} {'':>10} {'':>10} "
                 f"{format_bytes(chain.loss.tmp_bytes):>10}")
    lines.append(f"input {format_bytes(chain.input_bytes)}; one step without recomputation "
                 f"{format_seconds(chain.compute_time)} on {chain.device}")
    with_options = [stage for stage in chain.stages if stage.options]
    if with_options:
        widest = max(with_options, key=lambda stage: len(stage.options))
        least = min(widest.options, key=lambda option: option.saved_bytes)
        extra = least.fwd_time + least.bwd_time - widest.fwd_time - widest.bwd_time
        lines.append(f"stage options: {sum(len(s.options) for s in with_options)} on {len(with_options)} stages; "
                     f"{widest.name} keeps down to {format_bytes(least.saved_bytes)} of "
                     f"{format_bytes(widest.saved_bytes)} for {format_seconds(extra)} more")
    return lines


def graph_summary(graph, store_all_peak: int, heaviest: int = 8) -> list:
    """A graph profile in a few lines: node counts, memory and time, and its heaviest nodes by held bytes."""
    nodes = graph.nodes
    backward = sum(node.backward for node in nodes)
    lines = [f"graph {graph.name}: {len(nodes)} nodes ({len(nodes) - backward} forward, {backward} backward; "
             f"{sum(node.keep for node in nodes)} kept to the end, {sum(node.random for node in nodes)} random)",
             f"fixed {format_bytes(graph.fixed_bytes)} (parameters, buffers, inputs); store-all peak "
             f"{format_bytes(store_all_peak)}; one step without recomputation {format_seconds(graph.compute_time)} "
             f"on {graph.device} ({graph.source})",
             f"{'node':<28} {'ms':>8} {'out':>10} {'tmp':>10} {'reads':>6}"]
    for index in sorted(range(len(nodes)), key=lambda k: -nodes[k].out_bytes)[:heaviest]:
        node = nodes[index]
        lines.append(f"{index:>4} {node.name[:23]:<23} {node.time * 1e3:8.3f} {format_bytes(node.out_bytes):>10} "
                     f"{format_bytes(node.tmp_bytes):>10} {len(node.deps):>6}")
    return lines


def progress_bar(done: int, total: int, label: str, width: int = 30) -> str:
    """``[#########.........] 12/40 block11`` for ``done`` of ``total`` items."""
    filled = width * done // max(total, 1)
    return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label}"


def say_on_stderr(line: str) -> None:
    """What a command is doing, told on stderr (its results go to stdout)."""
    print(line, file=sys.stderr, flush=True)


def seconds_since(started: float) -> str:
    """The seconds since ``started`` (a ``time.perf_counter()`` reading), for a progress line."""
    return f"{time.perf_counter() - started:.1f} s"


class ProgressLine:
    """A :func:`progress_bar` of ``total`` items redrawn in place on ``stream`` when it is a terminal or ``total`` is
    over 20: call it with each item's index (from 0) and label as it starts; :meth:`say` redraws it with a line
    for label (what has come of the work: ``profile_chain``'s ``say``); :meth:`end` ends its line (when done, or
    when an error or Ctrl-C stopped it), so that what follows has its own."""

    def __init__(self, total: int, stream):
        self.total, self.stream, self.open, self.done, self.drawn = total, stream, False, 0, 0

    def __call__(self, done: int, label: str) -> None:
        self.done = done + 1
        self.say(label)

    def say(self, label: str) -> None:
        if self.stream.isatty() or self.total > 20:
            text = progress_bar(self.done, self.total, label)[:shutil.get_terminal_size().columns - 1]
            print("\r" + text.ljust(self.drawn), end="", file=self.stream, flush=True)
            self.open, self.drawn = True, len(text)

    def end(self) -> None:
        if self.open:
            print(file=self.stream, flush=True)
            self.open = False


def training_table(plan, comparison) -> list:
    """Per step of a :class:`profiles.training.Comparison`: measured against predicted peak and time; then the
    planned steps against the unmodified model's (measured alternately with them): the largest peak of each, the
    median time with its range, and :func:`time_comparison`."""
    predicted = plan.predicted
    measured, plain = comparison.planned, comparison.plain
    step_time = predicted.time * plan.accumulate  # a step is each micro-batch's schedule in turn
    lines = [f"{'step':>4} {'loss':>9} {'measured peak':>15} {'predicted':>11} {'ratio':>6} {'budget':>6} "
             f"{'measured s':>11} {'predicted s':>11}"]
    for number, step in enumerate(measured, 1):
        lines.append(f"{number:4d} {step.loss:9.4f} {format_bytes(step.peak_bytes):>15} "
                     f"{format_bytes(predicted.peak_bytes):>11} "
                     f"{step.peak_bytes / predicted.peak_bytes:6.3f} {step.peak_bytes / plan.budget_bytes:6.3f} "
                     f"{step.seconds:11.4f} {step_time:11.4f}")
    lines += micro_batch_lines(measured, comparison.predicted_micro_batches)
    peak = max(step.peak_bytes for step in measured)
    plain_peak = max(step.peak_bytes for step in plain)
    seconds, plain_seconds = [step.seconds for step in measured], [step.seconds for step in plain]
    lines.append(f"unmodified model: peak {format_bytes(plain_peak)}, {_step_times(plain_seconds)}")
    lines.append(f"with the plan:    peak {format_bytes(peak)} ({1 - peak / plain_peak:.1%} less memory, "
                 f"{peak / predicted.peak_bytes:.3f} of predicted), {_step_times(seconds)}")
    lines.append(f"time:             {time_comparison(seconds, plain_seconds, predicted.overhead)}")
    return lines


def micro_batch_lines(measured, predicted) -> list:
    """Per step whose gradients accumulated over micro-batches (:class:`profiles.training.StepMeasure` s with
    ``micro_batch_peaks``), each micro-batch's measured peak against its ``predicted`` one (bytes, in order)."""
    lines = []
    for number, step in enumerate(measured, 1):
        if step.micro_batch_peaks:
            lines.append(f"step {number} by micro-batch (measured/predicted peak): " + ", ".join(
                f"{format_bytes(peak)}/{format_bytes(expected)} {peak / expected:.3f}"
                for peak, expected in zip(step.micro_batch_peaks, predicted)))
    return lines


def _step_times(seconds) -> str:
    if len(seconds) == 1:
        return f"{seconds[0]:.4f} s per step (one step)"
    return (f"{statistics.median(seconds):.4f} s per step (median of {len(seconds)}, "
            f"{min(seconds):.4f}-{max(seconds):.4f})")


def time_spread(seconds) -> float:
    """The relative spread of some step times: half their range over their median (``±`` that fraction)."""
    return (max(seconds) - min(seconds)) / (2 * statistics.median(seconds))


def time_comparison(seconds, plain_seconds, predicted_overhead: float) -> str:
    """The planned steps' time against the unmodified model's, beside the predicted overhead (a fraction).

    The measured difference is the ratio of the median times less one. It is
    stated only when the noise is not above what is being checked: the
    larger :func:`time_spread` of the two sets must be at most the measured
    difference or the predicted one, whichever is larger (else either could
    be noise: the machine is too loaded, or too variable, for the figures to
    say anything). One step of each has no spread: the difference is stated as
    such.
    """
    difference = statistics.median(seconds) / statistics.median(plain_seconds) - 1
    if len(seconds) < 2 or len(plain_seconds) < 2:
        return (f"{difference:+.1%} with the plan (one step of each: no spread measured), "
                f"predicted {predicted_overhead:+.1%}")
    spread = max(time_spread(seconds), time_spread(plain_seconds))
    if spread > max(abs(difference), abs(predicted_overhead)):
        return (f"not comparable on this machine now (spread ±{spread:.1%}; medians {difference:+.1%}, "
                f"predicted {predicted_overhead:+.1%})")
    return f"{difference:+.1%} with the plan (spread ±{spread:.1%}), predicted {predicted_overhead:+.1%}"


def pipeline_lines(plan, device_memory: int = None) -> list:
    """A pipeline plan (kind ``pipeline``): its schedule, iteration time, and per device the stages, the
    checkpoint schedule in brief, seconds per micro-batch and peak bytes (against ``device_memory`` if given)."""
    pipeline = plan.pipeline
    setup = ", ".join(f"{key}={value}" for key, value in pipeline.setup.items())
    channel = "free" if pipeline.bandwidth is None else f"{format_bytes(round(pipeline.bandwidth))}/s"
    lines = [
        f"pipeline   {plan.problem_name} on {len(pipeline.devices)} devices, {pipeline.schedule}, "
        f"{pipeline.micro_batches} micro-batches; {setup}",
        f"iteration  {format_seconds(plan.predicted.time)} predicted (no recomputation on this split: "
        f"{format_seconds(plan.predicted.baseline_time)}); boundary transfers {channel}",
        f"peak       {describe_bytes(plan.predicted.peak_bytes)} on the fullest device"
        + ("" if device_memory is None else f", {format_percent(plan.predicted.peak_bytes / device_memory)} of "
                                             f"{format_bytes(device_memory)}"),
        f"solved in  {format_seconds(plan.solve_seconds)}, optimal: {'yes' if plan.optimal else 'no'}",
        f"{'device':>6} {'stages':>9} {'s/micro-batch':>14} {'peak':>12}  schedule",
    ]
    for index, device in enumerate(pipeline.devices):
        recomputed = sum(op.kind in FORWARD_OPS for op in device.schedule) - (device.last - device.first)
        brief = "store-all" if recomputed == 0 else f"{recomputed} forwards recomputed"
        lines.append(f"{index:>6} {f'{device.first}-{device.last - 1}':>9} {format_seconds(device.time):>14} "
                     f"{format_bytes(device.peak_bytes):>12}  {brief}")
    return lines
