"""A save-only graph plan as a ``torch.utils.checkpoint`` selective-checkpoint policy, for the user's own eager model.

Some graph plans only choose which forward values to keep for the backward (:func:`is_save_plan`; one is
built by :func:`solvers.save_only.save_only_plan`). Such a plan can run without the graph executor:
:func:`selective_policy` aligns the eager forward's operations with the captured graph's and builds one
policy per stage and one for the loss (:class:`SelectivePolicy`); :func:`checkpointed` /
:func:`checkpointed_model` run each stage and the loss inside
``checkpoint(..., use_reentrant=False, context_fn=...)``, the operations making the kept values ``MUST_SAVE``
and every other one ``PREFER_RECOMPUTE``. The peak under the policy is not the plan's (``checkpoint`` keeps
each region's input and recomputes a region at once); :attr:`SelectivePolicy.predicted_peak_bytes` is the
step as it runs, counted on fake tensors. Alignment, decisions, BatchNorm, memory and counting:
docs/execution.md ("Selective-checkpoint policies").
"""

import contextlib
import dataclasses
import difflib
import operator
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from planner.errors import MemschedError
from planner.execute.capture import capture, fake_copy, preserved_joint_state
from planner.execute.graph import check_same_graph
from planner.execute.live_memory import LiveMemoryTracker
from planner.execute.stages import StagedModel, default_loss, named_stages, run_stages
from planner.graph import Graph
from planner.plan import Plan
from planner.simulate import simulate

LOSS_REGION = "(loss)"  # the region running the loss function
_SAC_IGNORED = {torch.ops.aten.detach.default, torch.ops.prim.device.default}  # never shown to a policy
_SAME_OP = {"_unsafe_view": "view", "_native_batch_norm_legit_functional": "native_batch_norm",
            "_native_batch_norm_legit": "native_batch_norm"}


# --------------------------------------------------------------------------------------------------
# Which plans


def save_plan_problem(plan: Plan, graph: Graph):
    """Why ``plan`` is not a save-only plan of ``graph`` (one line), or ``None`` when it is
    (see :func:`is_save_plan`)."""
    simulate(graph, plan)  # a graph plan, for this graph, valid
    nodes = graph.nodes
    computes = [(position, op.node) for position, op in enumerate(plan.schedule) if op.kind == "compute"]
    boundary = next((position for position, v in computes if nodes[v].backward), len(plan.schedule))
    before, after = {}, {}
    for position, v in computes:
        counts = before if position < boundary else after
        counts[v] = counts.get(v, 0) + 1
    resident = set()
    for op in plan.schedule[:boundary]:
        (resident.add if op.kind == "compute" else resident.discard)(op.node)
    for v, node in enumerate(nodes):
        if node.backward:
            if after.get(v, 0) > 1:
                return f"backward node {v} ({node.name}) is computed {after[v]} times"
            continue
        if before.get(v, 0) != 1:
            return f"forward node {v} ({node.name}) is computed {before.get(v, 0)} times before the first backward node"
        if after.get(v, 0) > 1:
            return f"forward node {v} ({node.name}) is recomputed {after[v]} times in the backward"
        if after.get(v, 0) and v in resident:
            return f"forward node {v} ({node.name}) is both kept through the forward and recomputed"
    return None


def is_save_plan(plan: Plan, graph: Graph) -> bool:
    """True when ``plan`` only chooses which forward values to keep for the backward.

    The forward phase is every operation before the first computation of a
    backward node. The plan is save-only when, in it, every forward node is
    computed exactly once; after it, every forward node is computed at most
    once, and only if its value was not resident when the backward started
    (a value is either kept from its forward to its last use, or dropped and
    recomputed once); and every backward node is computed once. That is what
    a selective-checkpoint policy can express: ``MUST_SAVE`` for the kept
    values, recomputation (once, in the backward) for the others.
    """
    return save_plan_problem(plan, graph) is None


# --------------------------------------------------------------------------------------------------
# The policy


class RegionPolicy:
    """The selective-checkpoint policy of one region: its ``k``-th operation gets the ``k``-th decision.

    ``ops`` and ``decisions`` are the recorded operations (``OpOverload``) and their
    :class:`CheckpointPolicy`, ``tokens`` their ``(normalised name, shape of the first result)``;
    ``saved_bytes`` is what the latest forward cached (distinct storages of the results of ``MUST_SAVE``
    operations, bytes).
    """

    def __init__(self, name: str, ops: tuple, tokens: tuple, decisions: tuple):
        self.name, self.ops, self.tokens, self.decisions = name, ops, tokens, decisions
        self.saved_bytes = 0
        self._calls = 0
        self._storages = set()

    def __call__(self, ctx, op, *args, **kwargs):
        k = self._calls
        if k == 0:
            self.saved_bytes, self._storages = 0, set()
        if k >= len(self.ops) or op != self.ops[k]:
            expected = self.ops[k] if k < len(self.ops) else "the end of the region"
            raise MemschedError(f"region {self.name!r}: operation {k} is {op}, the recorded forward ran {expected}; "
                                "the policy was built for another forward (inputs, model or torch.compile); "
                                "build it again")
        self._calls = (k + 1) % len(self.ops)
        decision = self.decisions[k]
        if decision == CheckpointPolicy.MUST_SAVE:
            for tensor in _tensors(ctx.op_output):
                key = tensor.untyped_storage()._cdata
                if key not in self._storages:
                    self._storages.add(key)
                    self.saved_bytes += tensor.untyped_storage().nbytes()
        return decision

    def context_fn(self):
        """``create_selective_checkpoint_contexts(self)`` with the count restarted: a ``context_fn`` for
        ``checkpoint``."""
        self._calls = 0
        return create_selective_checkpoint_contexts(self)

    @property
    def must_save(self) -> list:
        """Positions of the ``MUST_SAVE`` operations."""
        return [k for k, d in enumerate(self.decisions) if d == CheckpointPolicy.MUST_SAVE]


@dataclass
class SelectivePolicy:
    """A save-only graph plan as per-region policies (docs/execution.md, "Selective-checkpoint policies").

    ``regions``: region name (a stage name, or :data:`LOSS_REGION`) -> :class:`RegionPolicy`.
    ``kept``: the graph operations the plan keeps that lie in the regions, as ``(node index, fx name,
    token, partner)`` (tokens as :attr:`RegionPolicy.tokens`; ``partner``: the ``(region, position)`` of the
    eager operation paired one to one with it, or None); ``unaligned``: eager operations decided by the
    enclosing stretch, as ``(region, position, operation, "save" | "recompute")``.
    ``kept_bytes``: the plan's resident bytes when the backward starts, less ``fixed_bytes``.
    ``predicted_peak_bytes``: the peak of one step run under the policy, gradients ``None`` at the start,
    ``fixed_bytes`` included (as the plan's predicted peak): that step counted once on fake tensors
    (docs/execution.md, "What the memory looks like").
    """

    regions: dict
    kept: list
    unaligned: list
    kept_bytes: int
    predicted_peak_bytes: int

    @property
    def saved_bytes(self) -> int:
        """Bytes the latest forward cached over all regions."""
        return sum(region.saved_bytes for region in self.regions.values())


def selective_policy(plan: Plan, graph: Graph, model, example_inputs=None, loss_fn=None) -> SelectivePolicy:
    """The selective-checkpoint policy running the save-only ``plan`` of ``graph`` on the eager ``model``.

    ``model``: a :class:`planner.execute.stages.StagedModel`, or the stages given to
    :func:`profiles.graph_profiler.profile_graph` with the same ``example_inputs`` and ``loss_fn``. The model
    is captured again (refused if its graph is not ``graph``), its forward run once under recording
    policies, on the example inputs, and then its step once under the policy on fake tensors
    (:attr:`SelectivePolicy.predicted_peak_bytes`), leaving parameters, buffers, gradients and the random
    state as found.
    A plan that is not save-only (:func:`is_save_plan`) raises a one-line :class:`MemschedError`.
    """
    problem = save_plan_problem(plan, graph)
    if problem is not None:
        raise MemschedError(f"plan for graph '{graph.name}' is not save-only ({problem}), so no selective-checkpoint "
                            "policy can run it; run it with the graph executor (planner.execute.graph.GraphExecutor, "
                            "memsched train SPEC --graph)")
    model = StagedModel.of(model, example_inputs, loss_fn, user="selective_policy")
    pairs, example_inputs, loss_fn = model.stages, model.example_inputs, model.loss_fn
    joint = capture(model, nodes=graph.size)
    check_same_graph(joint, graph)
    kept_nodes, kept_bytes = _kept(plan, graph)
    graph_ops = _graph_forward(joint, kept_nodes)
    recorders = {name: _Recorder(name) for name, _ in pairs}
    recorders[LOSS_REGION] = _Recorder(LOSS_REGION)
    with preserved_joint_state(joint):
        wrapped, wrapped_loss = checkpointed(pairs, recorders, loss_fn)
        wrapped_loss(run_stages(wrapped, example_inputs))
    calls = [call for recorder in recorders.values() for call in recorder.calls]
    wants, conservative = _align(calls, graph_ops)
    regions, where = {}, []
    for name, recorder in recorders.items():
        count = len(where)
        decisions = _decisions(recorder.calls, wants[count:count + len(recorder.calls)])
        regions[name] = RegionPolicy(name, tuple(c.op for c in recorder.calls), tuple(c.token for c in recorder.calls),
                                     decisions)
        where.extend((name, k) for k in range(len(recorder.calls)))
    unaligned = [(*where[i], str(op), decision) for i, op, decision in conservative]
    kept = [(g.group, g.node.name, g.token, None if g.partner is None else where[g.partner])
            for g in graph_ops if g.kept]
    wrapped, wrapped_loss = checkpointed(pairs, regions, loss_fn)
    peak = _peak_on_fake_tensors(wrapped, wrapped_loss, loss_fn, example_inputs) + graph.fixed_bytes
    return SelectivePolicy(regions=regions, kept=kept, unaligned=unaligned, kept_bytes=kept_bytes,
                           predicted_peak_bytes=peak)


def _kept(plan: Plan, graph: Graph):
    """Forward nodes resident when the backward starts (kept; never recomputed in a save-only plan), and their bytes."""
    resident = set()
    for op in plan.schedule:
        if op.kind == "compute" and graph.nodes[op.node].backward:
            break
        (resident.add if op.kind == "compute" else resident.discard)(op.node)
    return resident, sum(graph.nodes[v].out_bytes for v in resident)


# --------------------------------------------------------------------------------------------------
# Recording the eager forward


@dataclass
class _Call:
    """One operation a region's policy is asked about: its results' storages and what it does to them."""

    op: object
    token: tuple
    keys: tuple  # storage keys of every tensor result
    made: tuple  # storage keys of results that are not views (new storages, or in-place writes)
    written: tuple  # storage keys written in place
    views: bool  # every result is a view
    random: bool


def _tensors(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    return []


def _token(op, value) -> tuple:
    name = op._overloadpacket.__name__ if isinstance(op, torch._ops.OpOverload) else getattr(op, "__name__", str(op))
    name = name if name.endswith("__") else name.rstrip("_")  # in-place as functional
    name = _SAME_OP.get(name, name)
    tensors = _tensors(value)
    return name, tuple(tensors[0].shape) if tensors else None


class _Recorder:
    """A policy that records what it is asked (and keeps the results alive so storages are not reused)."""

    def __init__(self, name: str):
        self.name = name
        self.calls = []
        self._alive = []

    def __call__(self, ctx, op, *args, **kwargs):
        out = ctx.op_output
        results = out if isinstance(out, (tuple, list)) else (out,)
        keys, made, written, views = [], [], [], True
        for schema, result in zip(op._schema.returns, results):
            alias = schema.alias_info
            for tensor in _tensors(result):
                key = tensor.untyped_storage()._cdata
                keys.append(key)
                if alias is None or alias.is_write:
                    made.append(key)
                    views = False
                if alias is not None and alias.is_write:
                    written.append(key)
        self._alive.append(out)
        self.calls.append(_Call(op, _token(op, out), tuple(keys), tuple(made), tuple(written), views,
                                torch.Tag.nondeterministic_seeded in op.tags))
        return CheckpointPolicy.PREFER_RECOMPUTE

    def context_fn(self):
        return create_selective_checkpoint_contexts(self)


# --------------------------------------------------------------------------------------------------
# The graph's forward operations and the alignment


@dataclass
class _GraphOp:
    node: object  # fx node
    group: int  # graph node index, or -1 for a view of fixed values
    token: tuple
    kept: bool  # the plan keeps (most of) this operation's results
    partner: int = None  # the eager call matched one to one with it (set by _align)


def _graph_forward(joint, kept_nodes) -> list:
    """The forward's fx operations in graph order, as the policy would see them, each with the plan's decision."""
    backward = {k for k, g in enumerate(joint.groups) if g.backward}
    kept_parts = {}  # (root fx node, result index) for results in a kept node's value
    for k in kept_nodes:
        for output in joint.groups[k].outputs:
            root = _root(output)
            if root is not None:
                kept_parts.setdefault(root[0], set()).add(root[1])
    fixed = set(joint.fixed_views)
    ops = []
    for node in joint.gm.graph.nodes:
        if node.op != "call_function":
            continue
        group = joint.group_of.get(node)
        if group in backward:
            break
        if node.target is operator.getitem or node.target in _SAC_IGNORED or (group is None and node not in fixed):
            continue
        value = node.meta.get("val")
        sizes = [t.numel() * t.element_size() for t in _tensors(value)]
        kept = sum(sizes[i] for i in kept_parts.get(node, ()) if i < len(sizes))
        token = _token(node.target, value)
        ops.append(_GraphOp(node, -1 if group is None else group, token,
                            group is not None and sum(sizes) > 0 and 2 * kept >= sum(sizes)))
    return ops


def _root(node):
    """``(fx node, result index)`` whose storage ``node``'s value is: through getitem and views; None for fixed
    values."""
    index = 0
    while True:
        if node.op != "call_function":
            return None
        if node.target is operator.getitem:
            node, index = node.args[0], node.args[1]
            continue
        target = node.target
        returns = target._schema.returns if isinstance(target, torch._ops.OpOverload) else ()
        if target is torch.ops.aten._unsafe_view.default or (
                returns and returns[0].alias_info is not None and not returns[0].alias_info.is_write):
            if not node.all_input_nodes:
                return None
            node, index = node.all_input_nodes[0], 0
            continue
        return node, index


def _align(calls: list, graph_ops: list):
    """Per eager call, whether the plan keeps it, and the calls decided by their stretch (docs/execution.md,
    "Decisions").

    Sets the ``partner`` of the graph operations paired one to one with an eager call."""
    matcher = difflib.SequenceMatcher(None, [c.token for c in calls], [g.token for g in graph_ops], autojunk=False)
    wants = [False] * len(calls)
    unaligned = []
    previous = False  # the decision of the latest graph operation with one
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            for i, j in zip(range(i1, i2), range(j1, j2)):
                graph_ops[j].partner = i
                if graph_ops[j].group >= 0:
                    wants[i] = previous = graph_ops[j].kept
            continue
        decided = [g.kept for g in graph_ops[j1:j2] if g.group >= 0]
        decision = any(decided) if decided else previous
        if decided:
            previous = decided[-1]
        for i in range(i1, i2):
            wants[i] = decision
            unaligned.append((i, calls[i].op, "save" if decision else "recompute"))
    return wants, unaligned


def _decisions(calls: list, wants: list) -> tuple:
    """``MUST_SAVE`` for the maker of each storage that a kept call made in the region, when nothing writes it
    afterwards and the maker is not random; else ``PREFER_RECOMPUTE``."""
    made_here, seen, last_writer = set(), set(), {}
    for k, call in enumerate(calls):
        for key in call.made:
            if key in call.written:
                if key in made_here:
                    last_writer[key] = k
            elif key not in seen:  # a new storage (a later non-view result on it, as _unsafe_view, writes nothing)
                made_here.add(key)
                last_writer[key] = k
        seen.update(call.keys)
    def makers(keys):
        return {last_writer[key] for key in keys if key in made_here and key not in calls[last_writer[key]].written
                and not calls[last_writer[key]].random}

    save = set()
    for k, call in enumerate(calls):
        if wants[k] and not call.views:
            save |= makers(call.made)
    return tuple(CheckpointPolicy.MUST_SAVE if k in save else CheckpointPolicy.PREFER_RECOMPUTE
                 for k in range(len(calls)))


# --------------------------------------------------------------------------------------------------
# Running a model under the policy


# NOTE [selective BatchNorm]
# A recomputed BatchNorm would update its running statistics a second time. The chain executor's guard
# (planner.execute.autograd.running_statistics_kept) clones the statistics when the recomputation starts; here
# that clone would run inside checkpoint's recompute dispatch mode, so the region's policy would be asked about
# an operation the recorded forward never ran (and the fake-tensor peak would count it there). So the copies
# are made at the forward, outside checkpoint's dispatch modes, and only swapped in for the recomputation.
class _SelectiveStage(torch.nn.Module):
    """A stage run by ``checkpoint`` with a region's policy; a recomputation uses throw-away normalisation buffers."""

    def __init__(self, module, policy):
        super().__init__()
        self.module = module
        self.policy = policy

    def forward(self, *args):
        spare = _spare_statistics(self.module)
        calls = []

        def run(*inner):
            if not calls:
                calls.append(True)
                return self.module(*inner)
            with _swapped(spare):  # the recomputation: BatchNorm statistics are not updated again
                return self.module(*inner)

        return checkpoint(run, *args, use_reentrant=False, context_fn=self.policy.context_fn)


def _spare_statistics(module) -> list:
    """``[(layer, {name: copy})]`` for normalisation layers that update running statistics in training."""
    spare = []
    for layer in module.modules():
        if isinstance(layer, torch.nn.modules.batchnorm._NormBase) and layer.training and layer.track_running_stats:
            spare.append((layer, {name: layer._buffers[name].clone()
                                  for name in ("running_mean", "running_var", "num_batches_tracked")
                                  if layer._buffers.get(name) is not None}))
    return spare


@contextlib.contextmanager
def _swapped(spare):
    originals = [(layer, {name: layer._buffers[name] for name in copies}) for layer, copies in spare]
    for layer, copies in spare:
        layer._buffers.update(copies)
    try:
        yield
    finally:
        for layer, buffers in originals:
            layer._buffers.update(buffers)


def checkpointed(stages, policy, loss_fn=None):
    """``(stage pairs, loss)`` running ``stages`` and ``loss_fn`` under ``policy``'s regions, one ``checkpoint`` each.

    ``policy``: a :class:`SelectivePolicy` (or a dict of region policies with ``context_fn()``). Each stage
    becomes a module calling ``checkpoint(stage, a_k, *extra, use_reentrant=False, context_fn=...)`` on the
    original module (parameters shared), and the loss ``checkpoint(loss_fn, output, ...)``. Run them as the
    plain step: ``loss = loss_fn(stage_n(...stage_0(x)))``; ``loss.backward()``.
    """
    regions = policy.regions if isinstance(policy, SelectivePolicy) else policy
    pairs = [(name, _SelectiveStage(module, regions[name])) for name, module in named_stages(stages)]
    loss_policy = regions[LOSS_REGION]
    inner = loss_fn or default_loss

    def loss(output):
        return checkpoint(inner, output, use_reentrant=False, context_fn=loss_policy.context_fn)

    return pairs, loss


def checkpointed_model(model, policy: SelectivePolicy):
    """The :class:`planner.execute.stages.StagedModel` ``model`` with its stages and loss run under ``policy``
    (same parameters)."""
    pairs, loss = checkpointed(model.stages, policy, model.loss_fn)
    return dataclasses.replace(model, stages=pairs, loss_fn=loss)


# --------------------------------------------------------------------------------------------------
# The peak under the policy


class _Step(torch.nn.Module):
    """One step by the checkpointed stages and loss, as one module (``functional_call`` swaps its state); returns
    the tracker's peak (bytes allocated in the step)."""

    def __init__(self, pairs, loss, loss_fn):
        super().__init__()
        self.stages = torch.nn.ModuleList(module for _, module in pairs)
        self.loss_module = loss_fn if isinstance(loss_fn, torch.nn.Module) else None  # its parameters swapped too
        self.loss = loss

    def forward(self, first, *extra):
        with LiveMemoryTracker() as tracker:
            loss = self.loss(run_stages(enumerate(self.stages), (first, *extra)))
            loss.backward()
        return tracker.peak


def _peak_on_fake_tensors(pairs, loss, loss_fn, example_inputs) -> int:
    """Bytes allocated at the peak of one step by ``pairs`` and ``loss``, run on fake tensors (nothing allocated).

    Every parameter and buffer (a tied one once, under all its names) and the inputs are fake copies for the
    whole step, forward and backward (so the recomputations too), gradients ``None`` at the start; the model's
    own tensors, gradients and the random state are left as found.
    """
    step = _Step(pairs, loss, loss_fn)
    named = [*step.named_parameters(remove_duplicate=False), *step.named_buffers(remove_duplicate=False)]
    existing = (t.fake_mode for t in [*(t for _, t in named), *example_inputs] if isinstance(t, FakeTensor))
    mode = next(existing, None) or FakeTensorMode(allow_non_fake_inputs=True)
    fakes, state = {}, {}
    for name, tensor in named:
        if id(tensor) not in fakes:
            fakes[id(tensor)] = fake_copy(mode, tensor.detach()).requires_grad_(tensor.requires_grad)
        state[name] = fakes[id(tensor)]
    inputs = tuple(fake_copy(mode, t) for t in example_inputs)
    device = example_inputs[0].device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), mode:
        return torch.func.functional_call(step, state, inputs)
