"""``fit(..., graph=True)``: the discovered model planned as one joint graph, and the chain's refusal that offers it.

A chain is cut only where one tensor carries the step on: a model whose blocks keep several tensors live (outputs
appended to a list and summed at the end, U-Net skips) has few cuts, and its chain may need nearly its store-all
peak whatever the schedule. The joint forward+backward graph of the same step has no such limit: its solvers
(Checkmate's MILP, Moccasin's CP) may drop and recompute any node. :func:`fit_graph` profiles that graph
(:func:`profiles.graph_profiler.profile_graph` on the discovered stages), solves it (:func:`solvers.solve_graph`,
time-limited) and returns the module that runs the plan (:class:`planner.execute.graph.GraphExecutor`).
:func:`offer_graph` is the chain path's check: a budget below the chain's least feasible one, that the joint
graph meets (or may meet), fails in one line naming ``fit(..., graph=True)``.

Budgets are on :func:`profiles.fit.fit`'s footing for both paths: the bytes a step allocates plus its batch, the
parameters and buffers left out (as a chain's budget leaves them out). A graph plan counts its ``fixed_bytes``
(parameters, buffers, batch) in its own budget and peak, so the parameters' and buffers' bytes
(:func:`resident_bytes`) are added to the budget given, and taken off the prediction ``fitted.predicted``.
"""

import dataclasses
import re
import time

import torch

import solvers
from planner.errors import MemschedError
from planner.execute.graph import GraphExecutor
from planner.units import format_bytes, parse_budget
from profiles.discover import returned_loss
from profiles.graph_profiler import profile_graph
from profiles.memory import storage_bytes
from solvers.minimum import minimum_budget
from solvers.rotor import check_length

GRAPH_NODES = 60  # nodes of the captured step (planner/execute/capture.py): small enough for the MILP
GRAPH_TIME_LIMIT = 60.0  # seconds for the graph solver; a plan stopped there is still a valid schedule
HINT_TIME_LIMIT = 5.0  # seconds to search the graph's least memory when the chain cannot meet a budget


def resident_bytes(graph, inputs) -> int:
    """Bytes of ``graph.fixed_bytes`` that are not the batch ``inputs``: the parameters, buffers and constants,
    resident before the step and left out of fit's budgets."""
    return graph.fixed_bytes - storage_bytes(list(inputs))


def fit_graph(staged, budget, solver: str, options: dict, *, warmup: int, repeats: int, say=None) -> tuple:
    """``(graph, plan, run, predicted)`` for the discovered ``staged`` model within ``budget`` (as :func:`fit` takes
    it; a percentage is of the graph's store-all peak on fit's footing). ``options``: ``nodes`` (default
    :data:`GRAPH_NODES`), ``time_limit`` (seconds, default :data:`GRAPH_TIME_LIMIT`) and the graph solver's
    parameters. ``run(a_0, *shared)`` returns the loss computed under the plan; its backward delivers the
    gradients. ``say(line)`` is told the graph's figures and the solve's time limit before it starts (before: a
    minute and more of silence when no schedule fits)."""
    options = {key: value for key, value in options.items() if key not in ("optimizer", "lr")}  # (for updates)
    nodes = options.pop("nodes", GRAPH_NODES)
    time_limit = options.pop("time_limit", GRAPH_TIME_LIMIT)
    inputs, started = staged.example_inputs, time.perf_counter()
    graph = profile_graph(staged.stages, inputs, returned_loss, nodes=nodes, warmup=warmup, repeats=repeats,
                          name=staged.name)
    resident = resident_bytes(graph, inputs)
    step_peak = solvers.store_all_graph_peak(graph) - resident
    wanted = parse_budget(str(budget), step_peak, what="fit budget")
    if say is not None:
        lower = max(0, solvers.graph_lower_bound(graph) - resident)
        say(f"{staged.name}: joint graph of {graph.size} nodes profiled in {time.perf_counter() - started:.1f} s: "
            f"store-all peak {format_bytes(step_peak)}, any schedule needs at least {format_bytes(lower)}; solving "
            f"for {format_bytes(wanted)} ({solver}, at most {time_limit:g} s: time_limit= to change)...")
    try:
        plan = solvers.solve_graph(graph, wanted + resident, solver, time_limit=time_limit, **options)
    except MemschedError as exc:  # its bytes are the graph's: say so, in fit's keywords
        raise MemschedError(f"{staged.name} on the joint graph (whose bytes count the parameters and buffers, "
                            f"{format_bytes(resident)}, which fit's budget leaves out): {as_keywords(exc)}") from None
    predicted = dataclasses.replace(plan.predicted, peak_bytes=plan.predicted.peak_bytes - resident)
    if say is not None:
        say(f"{staged.name}: planned in {plan.solve_seconds:.1f} s ({plan.solver} on the joint graph): predicted "
            f"peak {format_bytes(predicted.peak_bytes)}, {100 * plan.predicted.overhead:.1f}% slower than storing "
            "everything")
    return graph, plan, GraphStep(GraphExecutor(staged, plan, graph)), predicted


def as_keywords(message) -> str:
    """A graph solver's ``message``, which names the command line's flags (``--time-limit 40``, ``--solver
    moccasin``), as ``fit``'s caller gives them: ``time_limit=40``, ``solver='moccasin'``."""
    def keyword(match):
        name, value = match.group(1).replace("-", "_"), match.group(2)
        return f"{name}={value}" if value.replace(".", "", 1).isdigit() else f"{name}={value!r}"

    text = re.sub(r"--([a-z][a-z-]*) ([A-Za-z0-9_.]+)", keyword, str(message))
    return re.sub(r"\(--([a-z][a-z-]*)\)", lambda match: f"({match.group(1).replace('-', '_')}=)", text)


class GraphStep(torch.nn.Module):
    """``step(a_0, *shared)``: the loss of one training step run by a graph plan; its backward hands autograd the
    gradients the plan computed (scaled by the gradient the loss receives), so that they accumulate into
    ``.grad`` as any backward's do. The step (forward and backward) runs in the call: its peak is the plan's."""

    def __init__(self, executor: GraphExecutor):
        super().__init__()
        self.executor = executor
        # the example batch is not kept beside every step: only its shapes and dtypes, to check the batch by
        specs = tuple(t.to("meta") for t in executor.example_inputs)
        executor.example_inputs = executor.joint.example_inputs = specs

    def forward(self, *inputs):
        loss, parameters, grads = self.executor.gradients(*inputs)
        return _Delivered.apply(loss, grads, *parameters)


class _Delivered(torch.autograd.Function):
    """The loss of a step already run, whose backward returns that step's parameter gradients."""

    @staticmethod
    def forward(ctx, loss, grads, *parameters):
        ctx.grads = grads
        return loss.clone()

    @staticmethod
    def backward(ctx, grad_output):
        grads, ctx.grads = ctx.grads, None
        if grads is None:
            raise MemschedError("a graph-planned loss gives its gradients once: call fitted(...) again for another "
                                "backward")
        if grad_output.item() != 1.0:  # (loss / n).backward() and the like
            grads = [None if g is None else g * grad_output for g in grads]
        return (None, None, *grads)


def offer_graph(staged, chain, budget: int, solver: str, setup, least: int = None) -> None:
    """Raise a one-line :class:`MemschedError` naming ``fit(..., graph=True)`` when ``budget`` (bytes) is below
    the chain's least feasible one and the joint graph of the step meets it, or may (its least not proven
    within :data:`HINT_TIME_LIMIT`, its lower bound within the budget); otherwise (a step the graph capture cannot
    take too) return, and the chain solver says what it says. Offloading (its solvers, host weights), updates in
    the backward and accumulation (``setup``, a :class:`planner.setup.TrainingSetup`) are left to it.
    ``least``: the chain's least feasible budget (bytes) or, while some stages' options are not measured yet, a
    lower bound of it (default: the chain's least as measured)."""
    if solver in solvers.OFFLOAD_SOLVERS or setup.host_weights is not None or setup.update != "after" or \
            setup.accumulate != 1 or budget >= solvers.store_all_peak(chain):
        return
    if solver in ("auto", "rotor", "hierarchical"):
        check_length(chain)
    if least is None:
        least = minimum_budget(chain, options=solver in ("auto", "hierarchical"))
    inputs = staged.example_inputs
    if budget >= least or budget < storage_bytes(list(inputs)):
        return
    try:
        graph = profile_graph(staged.stages, inputs, returned_loss, nodes=GRAPH_NODES, estimate=True,
                              name=staged.name)
    except MemschedError:  # a step the graph capture cannot take: the graph path cannot help
        return
    graph_least, exact = solvers.graph_minimum(graph, HINT_TIME_LIMIT)
    graph_least -= resident_bytes(graph, inputs)
    if graph_least > budget:
        return
    store_all = solvers.store_all_peak(chain)
    stages = f"the chain of {chain.length} stages (cut where one tensor carries the step on)"
    if least >= store_all:
        head = (f"{staged.name}: {stages} cannot save memory: its least feasible budget is its store-all peak, "
                f"{format_bytes(least)} ({least} bytes)")
    else:
        head = (f"{staged.name}: budget {format_bytes(budget)} ({budget} bytes) is below the least feasible "
                f"{format_bytes(least)} ({least} bytes) of {stages}")
    if exact:
        tail = f"the joint graph of the step fits it (its least: {format_bytes(graph_least)}): fit(..., graph=True)"
    else:
        tail = (f"the joint graph of the step may fit it (no schedule of it needs less than "
                f"{format_bytes(graph_least)}): try fit(..., graph=True)")
    raise MemschedError(f"{head}; {tail}")
