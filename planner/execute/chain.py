"""The chain executor: runs a plan's schedule in a real training step, exactly, and nothing else.

``apply_plan(stages, plan)`` returns a drop-in module. Calling it runs the
plan's forward part (every operation before ``Loss``) and returns the last
stage's output with a ``grad_fn``; the caller computes the loss and calls
``backward()``, which runs the rest of the schedule (recomputations and
backwards) inside one custom ``autograd.Function``, in the plan's order.

What is held follows the simulator's model (planner/simulate/chain.py):

* ``F_all i`` runs stage i under autograd on a fresh leaf sharing ``a_i``'s
  storage and keeps its graph (``ā_{i+1}``); its output ``a_{i+1}`` is kept
  while a later operation reads it, then left to the graph (which frees it
  unless the stage saved it, as a plain backward would);
* ``F_ck i`` / ``F_none i`` run it under ``torch.no_grad()``; ``F_none`` then
  drops ``a_i`` (never the input);
* ``B i`` differentiates stage i's graph with the incoming gradient
  ``δ_{i+1}`` (handed to autograd, which frees it once used), accumulates the
  parameter gradients into ``.grad`` as autograd does, keeps ``δ_i``, and
  drops the graph and a standalone ``a_i``.

Stages run as one autograd graph where the plan allows it: when ``F_all i``
directly follows ``F_all i-1`` and ``B i-1`` directly follows ``B i`` (with no
forward of either stage between), stage i runs on stage i-1's output itself
rather than on a detached copy, and one ``autograd.grad`` call does both
backwards at ``B i``. Memory is the same (autograd frees each saved tensor and
gradient as a plain backward does); the per-stage bookkeeping is saved, so the
store-all plan runs as the plain step does.

Plans with transfers (offload plans: ``Offload`` / ``Release`` / ``Prefetch``
of ``saved i`` and ``input i``) run through planner/execute/offload.py, whose
docstring gives the semantics: every tensor ``F_all`` saves and every
activation the executor holds lives in the box of its item (saved-tensor
hooks; parameters, buffers and the caller's inputs excepted), ``Release``
frees the device copy, ``Prefetch`` allocates it and copies back at the
operation the plan names (on CUDA on a copy stream per direction, ordered by
events, from pinned host memory; on CPU synchronously, the host copy a NumPy
array outside the device accounting), and reading an item left on the host
fails with a one-line error. Plans may also move ``weights i`` / ``grads i``
(a *host-weight stage*: from ``apply_plan`` on, its parameters live on the
host between steps, the same ``Parameter`` objects with ``.data`` and
``.grad`` on the host, CPU tensors on CUDA, where the optimizer steps on
them; prefetched for the stage's operations, its gradients copied out after
``B i``; no fusion with such a stage, no tied weights). A transfer breaks
fusion where the fused graph would otherwise read an item or change memory at
another time than the plan says. ``apply_plan`` refuses a plan with transfers
that records no copy channel. A plan without transfers installs no hook and
runs exactly as before (parameters an earlier plan put on the host go back to
their device first).

Recomputed forwards replay the random numbers of the stage's first forward
(CPU and CUDA generators, as ``torch.utils.checkpoint`` does) and its autocast
state, and leave the running statistics of normalisation layers as the first
forward left them. Stage ``k`` is called ``module(a_k, *extra)`` as in the
profiler; outputs may be tensors or tuples/dicts of tensors. An output that is
the stage's own input object (``nn.Identity``, ``x.contiguous()``, a skip
returned beside the result) is taken as a view of it, so that its gradient
reaches the input whether or not the stage's backward runs alone (in offload
plans, a copy of any output sharing the input's storage: the chain model holds
``a_{i+1}`` in an item of its own). Hold no
reference to the returned output across ``backward()`` (write
``loss_fn(model(x)).backward()``): the plan releases it when the schedule says.
"""

import contextlib
import sys

import torch
from torch.autograd.graph import get_gradient_edge
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from planner.errors import MemschedError
from planner.measured_on import record_of
from planner.execute.stages import named_stages
from planner.ops import FORWARD_OPS, Op
from planner.plan import Plan, check_plan_matches
from planner.simulate.chain import check_schedule, planned_stages


def apply_plan(stages, plan: Plan, chain=None, fuse: bool = True) -> "PlannedChain":
    """A module running ``stages`` by ``plan``; with ``chain`` the plan's fingerprint and stage names are checked.

    What the chain was measured on (``chain.measured_on``, else the plan's copy of it) is checked too, when
    recorded: each stage's parameters here, the inputs at the module's first call with gradients; a
    difference is a one-line :class:`MemschedError` naming it (planner/measured_on.py).

    ``fuse=False`` runs every stage's backward as its own autograd call, never one for several stages: each
    stage's parameter gradients are then added into ``.grad`` before the next stage's are made, as the chain
    model's ``B`` counts them. A fused graph makes all its stages' gradients first, which costs nothing more
    when ``.grad`` is empty (they become it) but holds them beside ``.grad`` when gradients accumulate over
    several backwards (a pipeline's micro-batches). Plans with transfers always fuse as their executor decides.
    """
    pairs = named_stages(stages)
    if plan.kind != "chain":
        raise MemschedError(f"apply_plan runs plans of kind 'chain', not of kind '{plan.kind}' (a graph plan runs "
                            "with planner.execute.graph.GraphExecutor, a pipeline plan with planner.execute.pipeline.run_pipeline)")
    if plan.moves_data and plan.transfer is None:
        raise MemschedError("the plan moves data between device and host but records no copy channel "
                            "('transfer'); solve it again with a channel (--bandwidth 16GB/s)")
    planned = planned_stages(plan.schedule)
    if planned != len(pairs):
        raise MemschedError(f"the plan schedules {planned} stages but {len(pairs)} were given; solve again for this model")
    check_schedule(plan.schedule, planned)  # the simulator's rules, before anything runs
    if chain is not None:
        check_plan_matches(plan, chain)
        names, expected = [name for name, _ in pairs], [stage.name for stage in chain.stages]
        if names != expected:
            mismatch = next(k for k, (a, b) in enumerate(zip(names, expected)) if a != b)
            raise MemschedError(f"stage {mismatch} is named {names[mismatch]!r} but the plan's chain calls it "
                                f"{expected[mismatch]!r}; apply the plan to the model it was solved for")
    measured, source = record_of(chain, plan)
    if measured is not None:
        measured.check_stages(pairs, source)
    return PlannedChain(pairs, plan, fuse, measured, source)


class PlannedChain(torch.nn.Module):
    """The stages, run by a plan. ``forward(a_0, *extra)`` returns the last stage's output.

    ``measured_on`` (a :class:`planner.measured_on.MeasuredOn` from the ``source``, ``chain`` or ``plan``): the
    inputs of the first call with gradients must be its inputs (later calls are not checked: a last, smaller
    batch runs).
    """

    def __init__(self, pairs, plan: Plan, fuse: bool = True, measured_on=None, source: str = "plan"):
        super().__init__()
        self.unchecked_inputs = None if measured_on is None else (measured_on, source)
        self.stage_names = [name for name, _ in pairs]
        self.stages = torch.nn.ModuleList([module for _, module in pairs])
        self.plan = plan
        self.loss_position = next(p for p, op in enumerate(plan.schedule) if op.kind == "Loss")
        self.releases = _output_releases(plan.schedule, len(pairs))
        if plan.moves_data:  # transfers run through planner/execute/offload.py; nothing of it otherwise
            from planner.execute.offload import OffloadRun, fused_positions, prepare_host_weights

            self.continued, self.absorbed, self.kept_outputs = fused_positions(plan.schedule)
            self.run_type = OffloadRun
            # Host-weight stages (plans moving weights i): their parameters now live on the host between steps.
            self.host_weights = prepare_host_weights([module for _, module in pairs], plan.schedule)
        else:
            if "planner.execute.offload" in sys.modules:  # parameters an earlier plan kept on the host: back
                sys.modules["planner.execute.offload"].prepare_host_weights([module for _, module in pairs], ())
            self.host_weights = {}
            self.continued, self.absorbed = _fused_positions(plan.schedule) if fuse else (set(), set())
            self.run_type = _Run
        # An absorbed B of a stage whose F_all continued a graph has nothing left to do (no standalone input):
        # the loops below skip it, so a fused graph costs one operation's bookkeeping, as in a plain step.
        continued_stages = {plan.schedule[position].stage for position in self.continued}
        idle = {position for position in self.absorbed if plan.schedule[position].stage in continued_stages}
        self.backward_positions = [position for position in range(self.loss_position + 1, len(plan.schedule))
                                   if position not in idle]
        counts = {}
        for op in plan.schedule:
            if op.kind in FORWARD_OPS:
                counts[op.stage] = counts.get(op.stage, 0) + 1
        self.recomputed = {stage for stage, count in counts.items() if count > 1}
        # Looked up at every operation: a plain list, and each fused graph's parameters (shared ones once),
        # taken when the module is built, as an optimizer takes them.
        self.modules_in_order = list(self.stages)
        self._graph_parameters = {}

    def graph_parameters(self, stages) -> list:
        """The parameters of ``stages`` (a fused graph's), each once."""
        if stages not in self._graph_parameters:
            self._graph_parameters[stages] = list({id(p): p for k in stages
                                                   for p in self.modules_in_order[k].parameters()}.values())
        return self._graph_parameters[stages]

    def forward(self, first, *extra):
        if not torch.is_grad_enabled():  # inference: no schedule needed
            activation = first
            for k, module in enumerate(self.stages):
                if k in self.host_weights:  # parameters on the host: a device copy for the call (CUDA)
                    from planner.execute.offload import weights_on_device

                    with weights_on_device(self.host_weights[k]):
                        activation = module(activation, *extra)
                else:
                    activation = module(activation, *extra)
            return activation
        if self.unchecked_inputs is not None:
            measured, source = self.unchecked_inputs
            measured.check_inputs((first, *extra), source)
            self.unchecked_inputs = None
        run = self.run_type(self, first, extra)
        anchor = torch.empty(0, requires_grad=True)  # makes the output differentiable even when the input is data
        flat_inputs = [t for t in tree_flatten((first, extra))[0] if isinstance(t, torch.Tensor)]
        outputs = _Capture.apply(run, *_Schedule.apply(run, anchor, *flat_inputs))
        return tree_unflatten(list(outputs), run.output_spec)


def _output_releases(schedule, length) -> dict:
    """``{position: [i, ...]}``: after the operation at ``position``, stage i's output is read no more.

    An ``F_all i`` output ``a_{i+1}`` is read by later forwards of stage i+1 (or by the loss when
    ``i+1 = L``) until ``B i``; after the last such read the executor keeps only stage i's graph.
    """
    releases = {}
    for start, op in enumerate(schedule):
        if op.kind != "F_all":
            continue
        last = start
        for position in range(start + 1, len(schedule)):
            later = schedule[position]
            if later.kind == "B" and later.stage == op.stage:
                break
            if (later.kind in FORWARD_OPS and later.stage == op.stage + 1) or (later.kind == "Loss" and op.stage + 1 == length):
                last = position
        releases.setdefault(last, []).append(op.stage)
    return releases


def _fused_positions(schedule) -> tuple:
    """``(continued, absorbed)``: positions of ``F_all i`` run on stage i-1's graph, and of the ``B`` done with a later one.

    ``F_all i`` at position p continues the graph of ``F_all i-1`` at p-1 when its ``B i`` (the first after p)
    is directly followed by ``B i-1`` and no forward of stage i-1 or i runs between p and that ``B i``. The
    fused graph's backward runs at ``B i`` of its last stage; the ``B``s of its other stages only release.
    """
    backward_of = {}
    for start, op in enumerate(schedule):
        if op.kind == "F_all":
            backward_of[start] = next((q for q in range(start + 1, len(schedule))
                                       if schedule[q] == Op("B", op.stage)), None)
    continued, absorbed = set(), set()
    for position, op in enumerate(schedule):
        if op.kind != "F_all" or position == 0 or schedule[position - 1] != Op("F_all", op.stage - 1):
            continue
        end = backward_of[position]
        if end is None or end + 1 >= len(schedule) or schedule[end + 1] != Op("B", op.stage - 1):
            continue
        if any(later.kind in FORWARD_OPS and later.stage in (op.stage - 1, op.stage)
               for later in schedule[position + 1:end]):
            continue
        continued.add(position)
        absorbed.add(end + 1)
    return continued, absorbed


class _Graph:
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


class _Run:
    """The state of one step: what is held, by activation index (bytes follow planner/simulate/chain.py)."""

    def __init__(self, planned: PlannedChain, first, extra):
        self.planned = planned
        self.extra = extra
        self.acts = {0: first}  # standalone activations a_i
        self.graphs = {}  # i -> _Graph of stage i: ā_{i+1}
        self.grads = {}  # i -> δ_i, one entry per tensor of a_i (None where none)
        self.extra_grads = [None] * len([t for t in tree_flatten(extra)[0] if isinstance(t, torch.Tensor)])
        self.forwarded = set()  # stages whose first forward has run
        self.rng = {}  # stage -> generator states of its first forward (recomputed stages only)
        self.autocast = _autocast_state()
        self.output_spec = None

    def activation(self, i):
        if i in self.acts:
            return self.acts[i]
        graph = self.graphs.get(i - 1)
        if graph is not None and graph.output is not None:
            return _detached(graph.output)
        raise MemschedError(f"the plan needs a_{i}, which is not in memory: the plan is invalid "
                            f"(check it with memsched show PLAN --chain CHAIN)")

    def run(self, position) -> None:
        """Execute the operation at ``position`` of the schedule, then release outputs no longer read."""
        op = self.planned.plan.schedule[position]
        if position in self.planned.absorbed:  # done by the B of a later stage of the same graph
            if op.stage > 0:
                self.acts.pop(op.stage, None)
        elif op.kind == "B":
            self._backward(op.stage)
        elif position in self.planned.continued:
            self._continue(op.stage)
        elif op.kind != "Loss":
            self._forward(op)
        self.release(position)

    def release(self, position) -> None:
        for i in self.planned.releases.get(position, ()):
            if i in self.graphs:
                self.graphs[i].release_output()

    def _forward(self, op) -> None:
        i, module = op.stage, self.planned.modules_in_order[op.stage]
        source = self.activation(i)
        if op.kind == "F_all":  # grad mode is on (_Schedule)
            leaf = _leaf(source, requires_grad=i > 0 or _any_requires_grad(source))
            extra = _leaf(self.extra, requires_grad=True) if _any_requires_grad(self.extra) else self.extra
            self.graphs[i] = _Graph(leaf, extra, self._call(i, module, leaf, *extra), (i,))
        else:
            with torch.no_grad():
                self.acts[i + 1] = self._call(i, module, source, *self.extra)
        del source
        if op.kind == "F_none" and i > 0:
            self.acts.pop(i, None)

    def _continue(self, i) -> None:
        """``F_all i`` on the output of stage i-1's graph itself, extending that graph to stage i."""
        graph = self.graphs.pop(i - 1)
        graph.extend(i, self._call(i, self.planned.modules_in_order[i], graph.output, *graph.extra))
        self.graphs[i] = graph

    def _backward(self, i) -> None:
        graph = self.graphs.pop(i)
        incoming = self.grads.pop(i + 1)
        first = graph.stages[0]
        parameters = [p for p in self.planned.graph_parameters(graph.stages) if p.requires_grad]
        leaves = [t for t in tree_flatten(graph.leaf)[0] if isinstance(t, torch.Tensor)]
        extras = [t for t in tree_flatten(graph.extra)[0] if isinstance(t, torch.Tensor)]
        targets = [t for t in leaves + extras if t.requires_grad]
        pairs = [(edge, grad) for edge, grad in zip(graph.edges, incoming) if edge is not None and grad is not None]
        inputs = targets + self._gradient_inputs(graph, parameters)
        del incoming, graph
        results = _differentiate(pairs, inputs) if pairs and inputs else [None] * len(inputs)
        del inputs
        parameter_grads, results[len(targets):] = results[len(targets):], []  # _accumulate's alone (it frees them)
        _accumulate(parameters, parameter_grads)
        by_target = iter(results[:len(targets)])
        self.grads[first] = [next(by_target) if t.requires_grad else None for t in leaves]
        for k, tensor in enumerate(extras):  # extra inputs (an encoder's output) gather gradients from every stage
            if tensor.requires_grad:
                grad = next(by_target)
                if grad is not None:
                    self.extra_grads[k] = grad if self.extra_grads[k] is None else self.extra_grads[k] + grad
        if i > 0:
            self.acts.pop(i, None)

    def _gradient_inputs(self, graph, parameters) -> list:
        """What ``autograd.grad`` differentiates for ``parameters`` (tensors, or gradient edges)."""
        return parameters

    def finish(self) -> None:
        """After the step's last operation."""

    def _call(self, i, module, *args):
        """``module(*args)`` for stage i. Its first forward records the random state (when the plan recomputes
        it); a recomputation replays that state and the autocast state, and keeps running statistics."""
        if i not in self.forwarded:
            self.forwarded.add(i)
            if i in self.planned.recomputed:
                self.rng[i] = _rng_state()
            return self._pass_on(module(*args), args)
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        with torch.random.fork_rng(devices=devices), _autocast(self.autocast), _running_statistics_kept(module):
            _set_rng_state(self.rng[i])
            return self._pass_on(module(*args), args)

    def _pass_on(self, output, args):
        """Stage ``output``, its tensors that are ``args``' own objects made views (see :func:`_passed_on_as_views`)."""
        return _passed_on_as_views(output, args)


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


def _accumulate(parameters, grads: list) -> None:
    """Add gradients into ``.grad`` as autograd's AccumulateGrad does; ``grads`` is emptied as it goes.

    Into an existing ``.grad`` a gradient is added in place. Into an empty one it is taken as it is when it
    obeys the parameter's layout (:func:`_obeys_layout`) and no other parameter took the same gradient, else
    copied to that layout (:func:`_copy_to_layout`). Each entry of ``grads`` is set to None once used, so that
    (the caller holding no other reference) a copied gradient is freed before the next is copied, as
    AccumulateGrad frees its input when it returns.
    """
    taken = set()
    for k, parameter in enumerate(parameters):
        grad, grads[k] = grads[k], None
        if grad is None:
            continue
        if parameter.grad is not None:
            parameter.grad.add_(grad)
        elif _obeys_layout(grad, parameter) and (where := _address(grad)) not in taken:
            taken.add(where)
            parameter.grad = grad.detach()
        else:
            parameter.grad = _copy_to_layout(grad.detach(), parameter)
        del grad


def _address(tensor) -> tuple:
    """Where ``tensor``'s data starts: its storage and offset (as ``data_ptr``, which a fake tensor in estimate
    mode must not be asked for)."""
    return tensor.untyped_storage()._cdata, tensor.storage_offset()


def _obeys_layout(grad, parameter) -> bool:
    """Whether ``grad`` may become ``parameter.grad`` as it is: autograd's gradient layout contract.

    For a non-overlapping and dense parameter, the strides must be the parameter's on every dimension of size
    other than 1 (so a 1x1 convolution's weight gradient in channels-last order, as convolution backward
    returns it with several threads, is taken), and no size-1 dimension may have stride 0 (a broadcast view);
    any other parameter needs a contiguous gradient (torch/csrc/autograd/utils/grad_layout_contract.h).
    """
    if grad.stride() == parameter.stride() and parameter.is_contiguous() and 0 not in parameter.stride():
        return True  # the common case, decided without the loops below
    if not _non_overlapping_and_dense(parameter):
        return grad.is_contiguous()
    return all(stride != 0 if size == 1 else stride == wanted
               for size, stride, wanted in zip(grad.shape, grad.stride(), parameter.stride()))


def _copy_to_layout(grad, parameter) -> torch.Tensor:
    """``grad`` copied in ``parameter``'s strides when the parameter is non-overlapping and dense, else
    contiguously (autograd's ``clone_obey_contract``)."""
    if _non_overlapping_and_dense(parameter):
        return grad.new_empty_strided(parameter.size(), parameter.stride()).copy_(grad)
    return grad.clone(memory_format=torch.contiguous_format)


def _non_overlapping_and_dense(tensor) -> bool:
    """Whether some order of ``tensor``'s dimensions is contiguous, dimensions of size below 2 ignored (c10's
    ``compute_non_overlapping_and_dense``)."""
    expected = 1
    for stride, size in sorted((stride, size) for size, stride in zip(tensor.shape, tensor.stride()) if size >= 2):
        if stride != expected:
            return False
        expected *= size
    return True


def _differentiate(pairs, inputs) -> list:
    """Gradients of ``inputs`` from ``[(gradient edge, incoming gradient), ...]``, autograd owning the gradients.

    Autograd is given zero-stride placeholders of the right shapes, and a hook on each edge's node swaps in
    the real gradient just before the node runs: from then on autograd alone holds it and frees it once
    used, as in a plain backward (a gradient passed in directly would live until the call returns). For the
    same reason ``pairs`` is emptied: the caller's list must not keep the gradients alive.
    """
    holder = {k: grad for k, (_, grad) in enumerate(pairs)}
    edges = [edge for edge, _ in pairs]
    placeholders = [torch.zeros((), dtype=grad.dtype, device=grad.device).expand(grad.shape) for _, grad in pairs]
    pairs.clear()
    by_node = {}
    for k, edge in enumerate(edges):  # no loop variable may hold a gradient: it would outlive its use
        by_node.setdefault(edge.node, []).append((edge.output_nr, k))

    def swap_in(entries):
        def hook(grad_outputs):
            grads = list(grad_outputs)
            for output_nr, k in entries:
                grad, arrived = holder.pop(k), grads[output_nr]
                untouched = arrived is None or arrived.data_ptr() == placeholders[k].data_ptr()
                # Another output of the stage derived from this one may have added to the placeholder.
                grads[output_nr] = grad if untouched else arrived + grad
            return tuple(grads)

        return hook

    handles = [node.register_prehook(swap_in(entries)) for node, entries in by_node.items()]
    try:
        return list(torch.autograd.grad(edges, inputs, placeholders, allow_unused=True))
    finally:
        for handle in handles:
            handle.remove()


class _Schedule(torch.autograd.Function):
    """Forward: the plan's operations before ``Loss``. Backward: the operations after it."""

    @staticmethod
    def forward(ctx, run, anchor, *flat_inputs):
        planned = run.planned
        with torch.enable_grad():  # F_all builds graphs; F_ck and F_none turn it off
            for position in range(planned.loss_position):
                run.run(position)
        last = run.activation(len(planned.stages))
        leaves, run.output_spec = tree_flatten(last)
        outputs = tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in leaves)
        del last, leaves
        run.acts.pop(len(planned.stages), None)  # the loss holds what it needs of a_L; δ_L takes its place
        run.release(planned.loss_position)
        ctx.run = run
        ctx.mark_non_differentiable(*[t for t in outputs if isinstance(t, torch.Tensor) and not t.is_floating_point()])
        return outputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *placeholders):
        run = ctx.run
        del ctx.run
        planned = run.planned
        with torch.enable_grad():
            for position in planned.backward_positions:
                run.run(position)
        run.finish()
        grads = list(run.grads.pop(0)) + run.extra_grads
        return (None, None, *grads)


class _Capture(torch.autograd.Function):
    """Identity on the last output; its backward takes ``δ_L`` into the run and passes on placeholders.

    The gradients a custom Function's backward receives stay alive until it returns; taking ``δ_L`` here
    and running the schedule in the next node lets the schedule free ``δ_L`` after ``B L-1``, as planned.
    """

    @staticmethod
    def forward(ctx, run, *tensors):
        ctx.run = run
        ctx.mark_non_differentiable(*[t for t in tensors if not t.is_floating_point()])
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        ctx.run.grads[len(ctx.run.planned.stages)] = list(grads)
        del ctx.run
        return (None, *[None if g is None else torch.zeros((), dtype=g.dtype, device=g.device).expand(g.shape)
                        for g in grads])


@contextlib.contextmanager
def _running_statistics_kept(module):
    """Run with throw-away copies of the running statistics of normalisation layers in training mode.

    A recomputed forward must not update them a second time; copying the originals back afterwards would
    bump their version counters, which autograd checks, so the originals are swapped out instead.
    """
    swapped = []
    for layer in module.modules() if isinstance(module, torch.nn.Module) else ():
        if isinstance(layer, torch.nn.modules.batchnorm._NormBase) and layer.training and layer.track_running_stats:
            originals = {name: layer._buffers[name] for name in ("running_mean", "running_var", "num_batches_tracked")
                         if layer._buffers.get(name) is not None}
            layer._buffers.update({name: buffer.clone() for name, buffer in originals.items()})
            swapped.append((layer, originals))
    try:
        yield
    finally:
        for layer, originals in swapped:
            layer._buffers.update(originals)


def _detached(tree):
    return tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, tree)


def _leaf(tree, requires_grad):
    return tree_map(lambda t: t.detach().requires_grad_(requires_grad and t.is_floating_point())
                    if isinstance(t, torch.Tensor) else t, tree)


def _any_requires_grad(tree) -> bool:
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_flatten(tree)[0])


def _rng_state():
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)


def _autocast_state():
    return {device: (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
            for device in ("cpu", "cuda") if device == "cpu" or torch.cuda.is_available()}


@contextlib.contextmanager
def _autocast(state):
    with contextlib.ExitStack() as stack:
        for device, (enabled, dtype) in state.items():
            stack.enter_context(torch.autocast(device_type=device, dtype=dtype, enabled=enabled))
        yield
