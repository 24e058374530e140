"""One step of a chain plan: the loop that runs each operation, holding what the chain model holds.

:class:`StepRun` runs the operation at a schedule position (:meth:`StepRun.run`) for a
:class:`planner.execute.chain.PlannedChain`, which calls it from its autograd functions; bytes follow
planner/simulate/chain.py (docs/execution.md, "Chain executor"). A variant changes where activations live by
overriding the hooks only (the methods under "Hooks"; planner/execute/offload.py holds items in boxes), so that
every reference the loop drops is dropped at one place for all variants.
"""

import contextlib
import functools

import torch
from torch.autograd.graph import get_gradient_edge
from torch.utils._pytree import tree_flatten, tree_map

from planner.errors import MemschedError
from planner.execute.autograd import (
    TiedGradients,
    accumulate_grads,
    any_requires_grad,
    autocast_as,
    autocast_state,
    detached,
    differentiate,
    fresh_leaf,
    rng_devices,
    rng_state,
    running_statistics_kept,
    set_rng_state,
    writes_statistics,
)
from planner.execute.selective import run_with_option
from planner.ops import TRANSFER_OPS


class StageGraph:
    """The autograd graph of stages ``first..last``: its leaf inputs, and its output while still read.

    Once the output is read no more, only its gradient edges are kept (the graph frees it unless saved).
    """

    def __init__(self, leaf, extra, output, stages):
        self.leaf, self.extra, self.output, self.stages = leaf, extra, output, stages
        self._edges = None

    def extend(self, stage, output) -> None:
        """Stage ``stage`` ran on this graph's output: the graph now ends with it."""
        self.output, self.stages = output, self.stages + (stage,)

    def release_output(self) -> None:
        self._edges, self.output = self.edges, None

    @property
    def edges(self) -> list:
        if self.output is None:
            return self._edges
        return [get_gradient_edge(t) if t.requires_grad else None
                for t in tree_flatten(self.output)[0] if isinstance(t, torch.Tensor)]


class StepRun:
    """The state of one step: what is held, by activation index (bytes follow planner/simulate/chain.py)."""

    def __init__(self, planned, first, extra):
        self.planned = planned
        self.extra = extra
        self.acts = {0: first}  # standalone activations a_i
        self.graphs = {}  # i -> StageGraph of stage i: ā_{i+1}
        self.grads = {}  # i -> δ_i, one entry per tensor of a_i (None where none)
        self.extra_grads = [None] * len([t for t in tree_flatten(extra)[0] if isinstance(t, torch.Tensor)])
        self.held_inputs = {}  # (i, k) -> tensor k of a_i, read by a continued F_all i, until its gradient is made
        self.forwarded = set()  # stages whose first forward has run
        self.rng = {}  # stage -> generator states of its first forward (recomputed stages only)
        self.autocast = autocast_state()
        self.output_spec = None
        self.tied = TiedGradients(planned.first_readers)
        self.announcer = None  # under DDP, a planner.execute.ddp.GradientAnnouncer

    def run(self, position) -> None:
        """Execute the operation at ``position`` of the schedule, then release outputs no longer read; on any
        failure :meth:`abandon` first."""
        try:
            self._run(position)
        except BaseException:
            self.tied.put_back()
            self.abandon()
            raise

    def _run(self, position) -> None:
        planned = self.planned
        op = planned.schedule[position]
        if op.kind in TRANSFER_OPS:
            self.transfer(op)
            return
        self.before_compute(op)
        if position in planned.absorbed:  # done by the B of a later stage of the same graph
            if op.stage > 0:
                self.acts.pop(op.stage, None)
        elif op.kind == "B":
            self.before_backward(op.stage)
            self._backward(op.stage)
            self.after_backward(op.stage)
        elif position in planned.continued:
            self._continue(op.stage, position)
        elif op.kind != "Loss":
            self._forward(op, position)
        self.release(position)

    def release(self, position) -> None:
        """After the operation at ``position``: the outputs it was the last to read."""
        for i in self.planned.releases.get(position, ()):
            self.release_output(i)

    # NOTE [references dropped in the loop]
    # The measured peak equals the simulator's only because no frame keeps a tensor beyond the point the chain
    # model frees it: ``source`` goes before the stage runs on its leaf, ``output`` once it is held, ``incoming``
    # and ``graph`` before autograd runs, ``inputs`` before the gradients are added (``differentiate`` empties
    # ``pairs``, ``accumulate_grads`` its list). A hook keeps a tensor only in the run's state (``acts``,
    # ``graphs``, boxes), never in a frame or object that outlives its call.

    def _forward(self, op, position) -> None:
        i, module = op.stage, self.planned.modules_in_order[op.stage]
        source = self.activation(i)
        if op.kind == "F_all":  # grad mode is on (the schedule's autograd function)
            leaf = fresh_leaf(source, requires_grad=i > 0 or any_requires_grad(source))
            del source
            extra = fresh_leaf(self.extra, requires_grad=True) if any_requires_grad(self.extra) else self.extra
            with self.saving(i):
                output = self._call(i, module, leaf, *extra, forward_all=True)
            self.graphs[i] = StageGraph(leaf, extra, output, (i,))
            self.keep_output(i, output, position)
            del output
            self.after_forward_all(i, leaf)
        else:
            with torch.no_grad():
                output = self._call(i, module, source, *self.extra)
            del source
            self.hold_input(i + 1, output)
            del output
        if op.kind == "F_none" and i > 0:
            self.acts.pop(i, None)

    def _continue(self, i, position) -> None:
        """``F_all i`` on the output of stage i-1's graph itself, extending that graph to stage i; its input held
        until its gradient is made (:meth:`_hold_to_gradient`)."""
        graph = self.graphs.pop(i - 1)
        with self.saving(i):
            output = self._call(i, self.planned.modules_in_order[i], graph.output, *graph.extra, forward_all=True)
        self._hold_to_gradient(i, graph.output)
        graph.extend(i, output)
        self.graphs[i] = graph
        self.keep_output(i, output, position)

    def _hold_to_gradient(self, i, activation) -> None:
        """Hold the tensors of ``a_i`` until autograd has made their gradient, as the chain model holds ``a_i`` to
        ``B i``. Autograd alone frees a value no backward saves once the forward has read it: a 16-bit residual
        stream, of which only an fp32 cast is saved, is such a value. A tensor needing no gradient is held until
        its graph's backward has run. (A value a backward saves costs nothing more.)"""
        held = self.held_inputs
        for k, tensor in enumerate(t for t in tree_flatten(activation)[0] if isinstance(t, torch.Tensor)):
            held[i, k] = tensor
            if tensor.grad_fn is not None:
                tensor.grad_fn.register_prehook(functools.partial(_let_go, held, (i, k)))

    def _backward(self, i) -> None:
        graph = self.graphs.pop(i)
        incoming = self.grads.pop(i + 1)
        first = graph.stages[0]
        parameters = [p for p in self.planned.graph_parameters(graph.stages) if p.requires_grad]
        leaves = [t for t in tree_flatten(graph.leaf)[0] if isinstance(t, torch.Tensor)]
        extras = [t for t in tree_flatten(graph.extra)[0] if isinstance(t, torch.Tensor)]
        targets = [t for t in leaves + extras if t.requires_grad]
        pairs = [(edge, grad) for edge, grad in zip(graph.edges, incoming) if edge is not None and grad is not None]
        inputs = targets + self.gradient_inputs(graph, parameters)
        stages = graph.stages
        del incoming, graph
        self.tied.before_backward(stages, parameters)
        results = self.differentiate_stage(pairs, targets, inputs, parameters)
        del inputs
        for key in [key for key in self.held_inputs if key[0] in stages]:
            del self.held_inputs[key]
        self.tied.after_backward(stages)
        if self.announcer is not None:
            self.announcer.after_backward(stages, parameters)
        if self.planned.updates is not None:  # the optimizer update inside the backward (planner/execute/updates.py)
            self.planned.updates.after_backward(i)
        by_target = iter(results)
        self.grads[first] = [next(by_target) if t.requires_grad else None for t in leaves]
        for k, tensor in enumerate(extras):  # extra inputs (an encoder's output) gather gradients from every stage
            if tensor.requires_grad:
                grad = next(by_target)
                if grad is not None:
                    self.extra_grads[k] = grad if self.extra_grads[k] is None else self.extra_grads[k] + grad
        if i > 0:
            self.acts.pop(i, None)

    def _call(self, i, module, *args, forward_all=False):
        """``module(*args)`` for stage i, an ``F_all`` with an option recomputing that option's operations at
        its backward (planner/execute/selective.py). Its first forward records the random state (when the plan
        recomputes it); a recomputation replays that state and the autocast state, and keeps running
        statistics."""
        recompute = self.planned.recomputes.get(i) if forward_all else None
        if recompute is not None:
            call = functools.partial(run_with_option, module, recompute, compiled=self.planned.compiled)
        else:
            call = self.planned.compiled_stage(i) if self.planned.compiled else module
        if i not in self.forwarded:
            self.forwarded.add(i)
            if i in self.planned.recomputed:
                self.rng[i] = rng_state()
            return self.pass_on(call(*args), args)
        if self.planned.compiled and recompute is None and writes_statistics(module):
            call = module  # compiled code keeps reading the statistics swapped out below: this recomputation is eager
        with torch.random.fork_rng(devices=rng_devices()), autocast_as(self.autocast), running_statistics_kept(module):
            set_rng_state(self.rng[i])
            return self.pass_on(call(*args), args)

    # -- Hooks: what a variant (planner/execute/offload.py) overrides (docs/execution.md has the table).

    def activation(self, i):
        """``a_i`` for the operation reading it (the standalone one, else the output of stage i-1's graph)."""
        if i in self.acts:
            return self.acts[i]
        graph = self.graphs.get(i - 1)
        if graph is not None and graph.output is not None:
            return detached(graph.output)
        raise MemschedError(f"the plan needs a_{i}, which is not in memory: the plan is invalid "
                            f"(check it with memsched show PLAN --chain CHAIN)")

    def saving(self, i):
        """The context ``F_all i`` (or its continuation of a graph) runs the stage in: what autograd saves."""
        return contextlib.nullcontext()

    def keep_output(self, i, output, position) -> None:
        """``F_all i`` at ``position`` made ``output`` (``a_{i+1}``, in ``graphs[i]``, which holds it until its last
        reader has run)."""

    def after_forward_all(self, i, leaf) -> None:
        """``F_all i`` has run (not continuing a graph) on ``leaf``, a fresh leaf over ``a_i``."""

    def hold_input(self, i, output) -> None:
        """``F_ck`` / ``F_none`` i-1 made ``output``: the standalone ``a_i``."""
        self.acts[i] = output

    def release_output(self, i) -> None:
        """Stage i's output is read no more: its graph keeps only the gradient edges."""
        graph = self.graphs.get(i)
        if graph is not None and graph.output is not None:
            graph.release_output()

    def before_compute(self, op) -> None:
        """Before a compute operation (``F_*``, ``Loss``, ``B``) runs."""

    def before_backward(self, i) -> None:
        """Before ``B i`` differentiates stage i's graph."""

    def after_backward(self, i) -> None:
        """After ``B i`` has added its parameter gradients into ``.grad``."""

    def differentiate_stage(self, pairs, targets, inputs, parameters) -> list:
        """The gradients of ``targets`` (the graph's leaves needing them), once the gradients of ``parameters``
        (``inputs`` after the targets: :meth:`gradient_inputs`) are in their ``.grad``; ``pairs`` as
        :func:`differentiate` takes them."""
        results = differentiate(pairs, inputs) if pairs and inputs else [None] * len(inputs)
        parameter_grads, results[len(targets):] = results[len(targets):], []  # accumulate_grads' alone (it frees them)
        accumulate_grads(parameters, parameter_grads)
        return results

    def gradient_inputs(self, graph, parameters) -> list:
        """What ``autograd.grad`` differentiates for ``parameters`` (tensors, or gradient edges)."""
        return parameters

    def pass_on(self, output, args):
        """Stage ``output``, its tensors that are ``args``' own objects made views (see :func:`_passed_on_as_views`)."""
        return _passed_on_as_views(output, args)

    def transfer(self, op) -> None:
        """A transfer operation: this run moves no data."""
        raise MemschedError(f"{op}: a plan with transfers runs with planner.execute.offload.OffloadStepRun")

    def finish(self) -> None:
        """After the step's last operation."""

    def abandon(self) -> None:
        """A failed step: put back what the run changed outside itself."""


def _let_go(held, key, grad_outputs) -> None:
    """A gradient prehook: the tensor held under ``key`` is held no more (its gradient is made)."""
    held.pop(key, None)


def _passed_on_as_views(output, args):
    """``output`` with every tensor that is one of ``args``' own tensor objects replaced by a view of it.

    A stage that hands its input on (``nn.Identity``, ``x.contiguous()``, a skip returned beside its result)
    returns the very object the executor gave it: on a fresh leaf, that output *is* the leaf, its gradient edge
    the leaf's own accumulator, and differentiating the stage would drop the gradient the output receives. A
    view shares the storage (no memory) and carries the gradient through to the input, as in the plain step.
    """
    given = {id(t) for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)}
    if not given:
        return output
    return tree_map(lambda t: t.view_as(t) if isinstance(t, torch.Tensor) and id(t) in given else t, output)
