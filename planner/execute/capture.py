"""Capture one training step's joint forward+backward graph, grouped into graph nodes; run the nodes.

:func:`capture` traces the *joint* graph of one step (``aot_export_module(trace_joint=True)``: ATen operations,
functional, the loss and the parameter gradients included) and groups its operations into at most ``nodes``
groups (planner/execute/grouping.py), the nodes of a ``memsched.graph/1`` problem: a :class:`JointGraph`.
:class:`GroupRun` runs those groups one at a time. The graph profiler measures each group with it; the graph
executor and the selective-checkpoint policy re-capture the model and check that it is the graph a plan was
solved for (capturing the same model twice gives the same groups). Nothing here measures or times anything.
What a node, its value, ``fixed_bytes``, ``keep`` and ``random`` are: docs/execution.md ("Graph capture").
"""

import contextlib
import operator

import torch
from torch._functorch.aot_autograd import aot_export_module
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from planner.errors import MemschedError
from planner.execute.grouping import call_node, group
from planner.execute.stages import StagedModel, checked_device, preserved_state, quiet_fake_tensor_log, run_stages
from planner.interrupts import interrupts_deferred

# --------------------------------------------------------------------------------------------------
# Capture


class JointGraph:
    """A captured joint graph, grouped: what :func:`profile_graph` measures and the executor runs."""

    def __init__(self, module, gm, signature, fake_mode, device):
        self.module = module  # the wrapper holding the stages (parameters and buffers by name)
        self.gm = gm
        self.signature = signature
        self.fake_mode = fake_mode
        self.device = device
        self.example_inputs = ()  # the example inputs, on the device (set by capture)
        self.placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.groups = []
        self.group_of = {}  # fx node -> group index
        self.fixed_views = []  # fx nodes computed from fixed values only, allocating nothing
        self.fixed_bytes = 0
        self.param_grads = {}  # fx node -> parameter name (a shared parameter's first name; one gradient each)
        self.parameter_names = _first_names(module)  # every name of a parameter -> its first name
        self.buffer_updates = {}  # fx node -> name of the buffer it updates
        self.loss_node = None

    def fixed_values(self, inputs, fake_mode=None) -> dict:
        """``{fx node: tensor}`` for placeholders and constants (fake copies under ``fake_mode``), then fixed views.

        A tensor shared under several names (tied weights) is the value of each of its placeholders."""
        named = {**dict(self.module.named_parameters(remove_duplicate=False)),
                 **dict(self.module.named_buffers(remove_duplicate=False))}
        sig = self.signature
        by_name = {**sig.inputs_to_parameters, **sig.inputs_to_buffers}
        user = iter(inputs)
        env = {}
        for node in self.placeholders:
            env[node] = named[by_name[node.name]] if node.name in by_name else next(user)
        for node in self.gm.graph.nodes:
            if node.op == "get_attr":
                env[node] = getattr(self.gm, node.target)
        if fake_mode is not None:
            env = {node: fake_copy(fake_mode, value) for node, value in env.items()}
        with torch.no_grad():
            for node in self.fixed_views:
                env[node] = call_node(node, env)
        return env

    def placeholder_parameters(self) -> dict:
        """``{placeholder: parameter name in the user's model}`` (a shared parameter's first name)."""
        to_parameters = self.signature.inputs_to_parameters
        return {node: parameter_name(self.parameter_names[to_parameters[node.name]])
                for node in self.placeholders if node.name in to_parameters}

    def buffer(self, name: str) -> torch.Tensor:
        """The model's buffer ``name`` (as the signature names it)."""
        return self.module.get_buffer(name)


def _first_names(module) -> dict:
    """``{name: first name}`` over every name of every parameter: a parameter shared under several names (tied
    weights) is known by the first, the one ``named_parameters()`` lists."""
    first = {}
    return {name: first.setdefault(id(p), name) for name, p in module.named_parameters(remove_duplicate=False)}


def fake_copy(mode, value):
    """``value`` as a fake tensor of ``mode`` (a fake tensor or a non-tensor as it is)."""
    if isinstance(value, FakeTensor) or not isinstance(value, torch.Tensor):
        return value
    return mode.from_tensor(value)


def parameter_name(qualified: str) -> str:
    """A parameter's name in the user's model (``block0.attn.q.weight``) from its name in the captured wrapper."""
    return qualified.removeprefix("stages.")


class _Joint(torch.nn.Module):
    """The stages and the loss as one module returning ``(loss,)``: what aot_export_module traces."""

    def __init__(self, pairs, loss_fn):
        super().__init__()
        self.stages = torch.nn.ModuleDict({stage_name.replace(".", "_"): module for stage_name, module in pairs})
        self.loss_fn = loss_fn

    def forward(self, first, *extra):
        return (self.loss_fn(run_stages(self.stages.items(), (first, *extra))),)


def capture(model_or_stages, example_inputs=None, loss_fn=None, *, nodes=200, device=None) -> JointGraph:
    """Capture the joint graph of one step and group it into at most ``nodes`` groups (docs/execution.md).

    ``model_or_stages``: a :class:`StagedModel` (``example_inputs`` and ``loss_fn`` may then be None), or a module
    or stages as :meth:`StagedModel.of` takes them, with ``nn.Module`` stages; ``device`` moves them there first.
    """
    model = StagedModel.of(model_or_stages, example_inputs, loss_fn, user="capture")
    for stage_name, module in model.stages:
        if not isinstance(module, torch.nn.Module):
            raise MemschedError(f"stage {stage_name!r}: graph capture needs nn.Module stages, "
                                f"got {type(module).__name__}")
    inputs = model.example_inputs
    if not inputs or not all(isinstance(t, torch.Tensor) for t in inputs):
        raise MemschedError("example_inputs must be one tensor or a tuple of tensors "
                            "(the first stage's input, then extras)")
    module = _Joint(model.stages, model.loss_fn)
    existing = next((t.fake_mode for t in [*module.parameters(), *inputs] if isinstance(t, FakeTensor)), None)
    if device is not None:
        device = checked_device(device)
        with existing or contextlib.nullcontext():
            module.to(device)
            inputs = tuple(t.to(device) for t in inputs)
    device = inputs[0].device
    fake_mode = existing or FakeTensorMode(allow_non_fake_inputs=True)
    traced_inputs = [fake_copy(fake_mode, t.detach()) for t in inputs]
    with quiet_fake_tensor_log(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
            interrupts_deferred():  # a Ctrl-C inside the trace could abort the process (planner/interrupts.py)
        try:
            ungraded = _names_without_gradient(module, traced_inputs, fake_mode)
            with _needing_no_gradient(module, ungraded):
                gm, signature = aot_export_module(module, traced_inputs, trace_joint=True, output_loss_index=0)
        except MemschedError:
            raise
        except Exception as exc:  # the user's model: say what failed in one line
            raise MemschedError(f"capturing the joint graph failed: {type(exc).__name__}: {_one_line(exc)}") from None
    joint = JointGraph(module, gm, signature, fake_mode, device)
    joint.example_inputs = inputs
    outputs = {node.name: node for node in _graph_outputs(gm) if node is not None}
    joint.param_grads = {outputs[k]: v for k, v in signature.backward_signature.gradients_to_parameters.items()}
    joint.buffer_updates = {outputs[k]: v for k, v in signature.buffers_to_mutate.items()}
    # (backward_signature.loss_output is wrong with buffer updates)
    joint.loss_node = outputs[signature.user_outputs[0]]
    _split_parameter_gradients(joint)
    _sum_shared_gradients(joint)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    group(joint, nodes, inputs)
    return joint


def _one_line(exc) -> str:
    return " ".join(str(exc).split())[:300]


def _names_without_gradient(module, inputs, fake_mode) -> list:
    """Names of parameters needing a gradient that the step gives none (an unused layer, a branch not taken).

    Found by one step on fake tensors (nothing allocated), every name of a parameter its own leaf, as
    ``aot_export_module`` traces them: a tied weight can receive a gradient through one name and none
    through the other.
    """
    named = [(name, p) for name, p in module.named_parameters(remove_duplicate=False) if p.requires_grad]
    with fake_mode:
        leaves = {name: fake_copy(fake_mode, p).detach().requires_grad_() for name, p in named}
        buffers = {name: fake_copy(fake_mode, b).clone() for name, b in module.named_buffers(remove_duplicate=False)}
        (loss,) = torch.func.functional_call(module, {**leaves, **buffers}, tuple(inputs), tie_weights=False)
        if not leaves or not loss.requires_grad:
            return []  # aot_export_module says what is wrong
        grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    return [name for name, grad in zip(leaves, grads) if grad is None]


@contextlib.contextmanager
def _needing_no_gradient(module, names):
    """The parameters ``names`` replaced, under those names only, by aliases that need no gradient.

    ``aot_export_module`` refuses a parameter that needs a gradient and receives none; such a parameter is then
    a fixed value of the graph, and its ``.grad`` stays ``None``, as in the plain step. Restored on exit.
    """
    swapped = []
    for name in names:
        owner, _, leaf = name.rpartition(".")
        holder = module.get_submodule(owner)
        swapped.append((holder, leaf, holder._parameters[leaf]))
        holder._parameters[leaf] = torch.nn.Parameter(holder._parameters[leaf].detach(), requires_grad=False)
    try:
        yield
    finally:
        for holder, leaf, parameter in reversed(swapped):
            holder._parameters[leaf] = parameter


def _graph_outputs(gm) -> list:
    return list(gm.graph.output_node().args[0])


def _split_parameter_gradients(joint: JointGraph) -> None:
    """Split each operation with an ``output_mask`` making both parameter gradients and other results in two.

    The parameter gradients are kept to the end of the step; made by the same call as an input gradient,
    they would pin it (a node has one value). The first call makes the other results, the second the
    parameter gradients (each as the original call would, on the same inputs).
    """
    gm = joint.gm
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        names = [a.name for a in node.target._schema.arguments]
        if "output_mask" not in names:
            continue
        position = names.index("output_mask")
        mask = list(node.args[position]) if position < len(node.args) else list(node.kwargs["output_mask"])
        getitems = [u for u in node.users if u.target is operator.getitem]
        kept = {u.args[1] for u in getitems if u in joint.param_grads}
        others = {u.args[1] for u in getitems if u not in joint.param_grads}
        if not kept or not others:
            continue
        calls = {}
        for part, indices in (("other", others), ("grads", kept)):
            part_mask = [bool(m) and k in indices for k, m in enumerate(mask)]
            args = list(node.args)
            kwargs = dict(node.kwargs)
            if position < len(args):
                args[position] = part_mask
            else:
                kwargs["output_mask"] = part_mask
            with gm.graph.inserting_before(node):
                calls[part] = gm.graph.call_function(node.target, tuple(args), kwargs)
        for user in getitems:
            with gm.graph.inserting_before(user):
                replacement = gm.graph.call_function(
                    operator.getitem, (calls["grads" if user.args[1] in kept else "other"], user.args[1]))
            user.replace_all_uses_with(replacement)
            if user in joint.param_grads:
                joint.param_grads[replacement] = joint.param_grads.pop(user)
            gm.graph.erase_node(user)
        gm.graph.erase_node(node)


def _sum_shared_gradients(joint: JointGraph) -> None:
    """One gradient per parameter: the gradients of a shared parameter's names (tied weights) summed in the graph.

    ``aot_export_module`` traces each name of a shared parameter as its own input, with its own gradient. They
    are added, in graph order (the order autograd's engine receives them), by ``add`` operations after the
    last of them; the sum is the parameter's gradient, under its first name, and the only one kept to the end.
    """
    gm = joint.gm
    order = {node: k for k, node in enumerate(gm.graph.nodes)}
    by_parameter = {}
    for node, name in joint.param_grads.items():
        by_parameter.setdefault(joint.parameter_names[name], []).append(node)
    output = gm.graph.output_node()
    results = list(output.args[0])
    param_grads = {}
    for name, nodes in by_parameter.items():
        nodes.sort(key=order.get)
        total, anchor = nodes[0], nodes[-1]
        for node in nodes[1:]:
            with gm.graph.inserting_after(anchor):
                total = anchor = gm.graph.call_function(torch.ops.aten.add.Tensor, (total, node))
        results = [total if node is nodes[0] else node for node in results if node not in nodes[1:]]
        param_grads[total] = name
    output.args = (type(output.args[0])(results),)
    joint.param_grads = param_grads


# --------------------------------------------------------------------------------------------------
# Running groups


class GroupRun:
    """One step in progress: the values held per group. The profiler measures with it, the executor runs with it.

    ``compute(k)`` runs group k's operations in graph order under ``torch.no_grad()`` (the graph holds the
    backward explicitly), releasing each intermediate after its last use inside the group, and keeps only
    the group's value; the first computation writes updated buffers back into the model. ``free(k)``
    drops the value. Nothing else holds a tensor between operations.
    """

    def __init__(self, joint: JointGraph, fixed: dict):
        self.joint = joint
        self.fixed = fixed
        self.values = {}  # group index -> {fx node: tensor}
        self.computed = set()

    def _lookup(self, env, node):
        if node in env:
            return env[node]
        group = self.joint.group_of.get(node)
        return self.fixed[node] if group is None else self.values[group][node]

    def compute(self, k: int) -> None:
        group = self.joint.groups[k]
        first = k not in self.computed
        updates = dict(group.buffer_updates)
        outputs = set(group.outputs)
        env = {}
        with torch.no_grad():
            for position, node in enumerate(group.members):
                args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: self._lookup(env, n))
                env[node] = node.target(*args, **kwargs)
                del args, kwargs
                if node in updates and first:
                    self.joint.buffer(updates[node]).copy_(env[node])
                if node not in outputs and node not in group.last_use:
                    del env[node]
                for source in node.all_input_nodes:
                    if group.last_use.get(source) == position:
                        del env[source]
        self.values[k] = {node: env.pop(node) for node in group.outputs}
        self.computed.add(k)

    def free(self, k: int) -> None:
        del self.values[k]


def preserved_joint_state(joint: JointGraph):
    """Buffers (BatchNorm statistics), gradients and random number generators restored around a run of the step."""
    return preserved_state([joint.module], joint.device)
