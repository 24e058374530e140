"""Capture one training step's joint forward+backward graph and group it into graph nodes; run the nodes.

:func:`capture` traces the *joint* graph of one step
(``aot_export_module(trace_joint=True)``: ATen operations, functional, the loss
and the parameter gradients included) and groups its operations into at most
``nodes`` groups, the nodes of a ``memsched.graph/1`` problem.
:class:`StepRun` runs those groups one at a time. The graph profiler
(profiles/graph_profiler.py) measures each group with it; the graph executor
(planner/execute/graph.py) and the selective-checkpoint policy
(planner/execute/selective.py) re-capture the model and check that it is the graph a
plan was solved for. Nothing here measures or times anything.

What a group (graph node) is:

* **Fixed values** are not nodes: parameters, buffers, the example inputs, tensor
  constants the loss closes over (targets), and views of them (``t(weight)``);
  their distinct storages are ``fixed_bytes`` (a tied weight counts once).
* **Parameter gradients**: one per parameter. ``aot_export_module`` traces each
  name of a parameter shared under several names (tied weights: an embedding
  and the output head) as its own input with its own gradient; those gradients
  are added in the graph (``add`` operations after the last of them), and the
  sum, under the parameter's first name, is the gradient kept. A parameter that
  receives no gradient (an unused layer, a branch not taken on the example
  inputs) is a fixed value only: it is traced as needing none (found by one
  step on fake tensors first), so its ``.grad`` stays ``None``, as in the
  plain step.
* **Atoms**: every other operation is grouped with the operations whose results
  share a storage with it (views with their base, ``getitem`` with its
  multi-output operation), so no two nodes' values ever share memory.
  Operations with an ``output_mask`` (convolution, batch- and layer-norm
  backward) that make both an input gradient and parameter gradients are split
  in two calls, so the parameter gradients (kept to the end of the step) do not
  pin the input gradient.
* **Coarsening**: atoms are fused, cheapest first (FLOPs, then bytes), along an
  edge ``v -> u`` when ``u`` reads nothing else or ``v`` feeds nothing else
  (so the node graph stays acyclic), never across forward/backward, until at
  most ``nodes`` remain (or nothing more can be fused). View and element-wise
  runs count no FLOPs and go first. Consecutive random atoms get an ordering
  edge, so the nodes' index order keeps the random operations in the order of
  the eager step (which is what makes the dropout masks equal).
* A node's **value** is the results of its operations read by other nodes.
  :meth:`StepRun.compute` runs a node's operations in graph order, releasing
  each intermediate after its last use inside the node, and keeps only the value.
* ``keep``: nodes holding a parameter gradient or the loss. ``random``: nodes
  holding a random operation (dropout). Updated buffers (BatchNorm's running
  statistics) are written back into the model by the first computation of
  their node and are not part of its value.

Capturing the same model twice gives the same groups (names, deps, sizes), so
a model can be re-captured and checked against the graph its plan was solved for.
"""

import contextlib
import heapq
import logging
import operator

import torch
from torch.utils._pytree import tree_flatten

from planner.errors import MemschedError
from planner.execute.stages import named_stages, preserved_state


def default_loss(output):
    """The loss used when a model gives none: the mean of the first tensor of the last output."""
    return [leaf for leaf in tree_flatten(output)[0] if isinstance(leaf, torch.Tensor)][0].float().mean()


def checked_device(device) -> torch.device:
    """``device`` as a torch device, or a one-line error when it is CUDA and this machine has none."""
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise MemschedError("--device cuda: CUDA is not available on this machine; use --device cpu")
    return device


@contextlib.contextmanager
def quiet_fake_tensor_log():
    """A stage failing on fake tensors makes torch log a traceback; the one-line error names it instead."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


# --------------------------------------------------------------------------------------------------
# Capture


class Group:
    """One graph node: the fx nodes it runs (in graph order), those read outside it, and its node-level facts."""

    def __init__(self, members):
        self.members = members  # fx nodes, graph order
        self.outputs = []  # members read by later groups (the value)
        self.deps = ()  # group indices read
        self.name = ""
        self.backward = False
        self.random = False
        self.keep = False
        self.params = ()
        self.flops = 0
        self.buffer_updates = []  # (member, buffer name): written back into the model at the first computation
        self.last_use = {}  # member -> position of its last use inside the group (outputs: never released here)


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
            env = {node: _fake(fake_mode, value) for node, value in env.items()}
        with torch.no_grad():
            for node in self.fixed_views:
                env[node] = _call(node, env)
        return env

    def buffer(self, name: str) -> torch.Tensor:
        """The model's buffer ``name`` (as the signature names it)."""
        return self.module.get_buffer(name)


def _first_names(module) -> dict:
    """``{name: first name}`` over every name of every parameter: a parameter shared under several names (tied
    weights) is known by the first, the one ``named_parameters()`` lists."""
    first = {}
    return {name: first.setdefault(id(p), name) for name, p in module.named_parameters(remove_duplicate=False)}


def _fake(mode, value):
    from torch._subclasses.fake_tensor import FakeTensor

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
        activation = first
        for module in self.stages.values():
            activation = module(activation, *extra)
        return (self.loss_fn(activation),)


def _pairs(model_or_stages) -> list:
    if isinstance(model_or_stages, torch.nn.Module) and not isinstance(model_or_stages, (torch.nn.Sequential,
                                                                                         torch.nn.ModuleList)):
        return [("model", model_or_stages)]
    pairs = named_stages(model_or_stages)
    for stage_name, module in pairs:
        if not isinstance(module, torch.nn.Module):
            raise MemschedError(f"stage {stage_name!r}: graph capture needs nn.Module stages, got {type(module).__name__}")
    return pairs


def capture(model_or_stages, example_inputs, loss_fn=None, *, nodes=200, device=None) -> JointGraph:
    """Capture the joint graph of one step and group it into at most ``nodes`` groups (see the module docstring)."""
    from torch._functorch.aot_autograd import aot_export_module
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    pairs = _pairs(model_or_stages)
    inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    if not inputs or not all(isinstance(t, torch.Tensor) for t in inputs):
        raise MemschedError("example_inputs must be one tensor or a tuple of tensors (the first stage's input, then extras)")
    module = _Joint(pairs, loss_fn or default_loss)
    existing = next((t.fake_mode for t in [*module.parameters(), *inputs] if isinstance(t, FakeTensor)), None)
    if device is not None:
        device = checked_device(device)
        with existing or contextlib.nullcontext():
            module.to(device)
            inputs = tuple(t.to(device) for t in inputs)
    device = inputs[0].device
    fake_mode = existing or FakeTensorMode(allow_non_fake_inputs=True)
    traced_inputs = [_fake(fake_mode, t.detach()) for t in inputs]
    with quiet_fake_tensor_log(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
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
    joint.loss_node = outputs[signature.user_outputs[0]]  # (backward_signature.loss_output is wrong with buffer updates)
    _split_parameter_gradients(joint)
    _sum_shared_gradients(joint)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    _group(joint, nodes, inputs)
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
        leaves = {name: _fake(fake_mode, p).detach().requires_grad_() for name, p in named}
        buffers = {name: _fake(fake_mode, b).clone() for name, b in module.named_buffers(remove_duplicate=False)}
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
                replacement = gm.graph.call_function(operator.getitem,
                                                     (calls["grads" if user.args[1] in kept else "other"], user.args[1]))
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
# Atoms and coarsening


def _call(node, env):
    """Run one fx node on the values in ``env``."""
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
    return node.target(*args, **kwargs)


def _storage_keys(value) -> dict:
    return {t.untyped_storage()._cdata: t.untyped_storage().nbytes()
            for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)}


def _is_random(node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in node.target.tags


def _analyse(joint: JointGraph, inputs):
    """Run the graph once on fake tensors, keeping everything alive: per fx node its storages and FLOPs.

    Nodes that read only fixed values and allocate nothing (views of parameters) become fixed views.
    """
    from torch.utils.flop_counter import FlopCounterMode

    fake_mode = joint.fake_mode
    env = joint.fixed_values(inputs, fake_mode)
    fixed_keys = {}
    for value in env.values():
        fixed_keys.update(_storage_keys(value))
    storages, flops, checks = {}, {}, []
    with fake_mode, torch.no_grad(), quiet_fake_tensor_log():
        for node in joint.gm.graph.nodes:
            if node.op != "call_function":
                continue
            counter = FlopCounterMode(display=False)
            with counter:
                env[node] = _call(node, env)
            if env[node] is None and not node.users:  # a check such as _assert_tensor_metadata: nothing to run
                checks.append(node)
                continue
            keys = _storage_keys(env[node])
            if all(n in env and (n.op != "call_function" or n in joint.fixed_views) for n in node.all_input_nodes) \
                    and all(key in fixed_keys for key in keys) and node not in joint.param_grads:
                joint.fixed_views.append(node)
                continue
            storages[node] = {key: size for key, size in keys.items() if key not in fixed_keys}
            flops[node] = counter.get_total_flops()
    joint.fixed_bytes = sum(fixed_keys.values())
    for node in checks:
        joint.gm.graph.erase_node(node)
    return storages, flops


def _forward_nodes(joint: JointGraph) -> set:
    """The loss and every operation it (or a buffer update) depends on: the forward pass."""
    seen, stack = set(), [joint.loss_node, *joint.buffer_updates]
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
    return seen


class _Atoms:
    """Union-find over fx nodes: operations sharing storage (views, getitem) form one atom."""

    def __init__(self, nodes):
        self.parent = {node: node for node in nodes}

    def find(self, node):
        while self.parent[node] is not node:
            self.parent[node] = self.parent[self.parent[node]]
            node = self.parent[node]
        return node

    def union(self, a, b) -> None:
        a, b = self.find(a), self.find(b)
        if a is not b:
            self.parent[b] = a


def _group(joint: JointGraph, target: int, inputs) -> None:
    storages, flops = _analyse(joint, inputs)
    order = {node: k for k, node in enumerate(joint.gm.graph.nodes)}
    ops = [node for node in joint.gm.graph.nodes if node in storages]
    atoms = _Atoms(ops)
    owner = {}
    for node in ops:
        if node.target is operator.getitem and node.args[0] in storages:
            atoms.union(node.args[0], node)
        for key in storages[node]:
            if key in owner:
                atoms.union(owner[key], node)
            else:
                owner[key] = node
    members = {}
    for node in ops:
        members.setdefault(atoms.find(node), []).append(node)
    forward = _forward_nodes(joint)
    keep_nodes = set(joint.param_grads) | {joint.loss_node}
    # Working groups, keyed by their first member's position in the graph.
    groups = {}
    for nodes in members.values():
        nodes.sort(key=order.get)
        groups[order[nodes[0]]] = {
            "members": nodes, "flops": sum(flops[n] for n in nodes),
            "bytes": sum({k: v for n in nodes for k, v in storages[n].items()}.values()),
            "backward": nodes[0] not in forward, "keep": any(n in keep_nodes for n in nodes),
            "random": any(_is_random(n) for n in nodes)}
    group_of = {node: key for key, g in groups.items() for node in g["members"]}
    preds = {key: set() for key in groups}
    succs = {key: set() for key in groups}
    for key, g in groups.items():
        for node in g["members"]:
            for source in node.all_input_nodes:
                other = group_of.get(source)
                if other is not None and other != key:
                    preds[key].add(other)
                    succs[other].add(key)
    randoms = sorted(key for key, g in groups.items() if g["random"])
    for before, after in zip(randoms, randoms[1:]):  # random operations keep the eager step's order
        preds[after].add(before)
        succs[before].add(after)
    _coarsen(groups, preds, succs, target, order)
    _finish(joint, groups, preds, flops, order)


def _coarsen(groups, preds, succs, target, order) -> None:
    """Fuse groups, cheapest first, until at most ``target`` remain (see the module docstring).

    A pair is fused along an edge ``v -> u`` when no other path leads from ``v`` to ``u`` (so the node graph
    stays acyclic), or, for two parameter-gradient groups that nothing reads, side by side. Forward and
    backward never mix, and a value kept to the end absorbs only a producer read by it alone.
    """
    version = {key: 0 for key in groups}

    def sink(key):
        return groups[key]["keep"] and not succs[key]

    def candidate(v, u):
        a, b = groups[v], groups[u]
        if a["backward"] != b["backward"]:
            return None
        if u in succs[v]:
            if a["keep"] != b["keep"] and (b["keep"] is False or succs[v] != {u}):
                return None
        elif not (sink(v) and sink(u)):
            return None
        return (a["flops"] + b["flops"], a["bytes"] + b["bytes"], v, u, version[v], version[u])

    def other_path(v, u) -> bool:
        if len(preds[u]) == 1 or len(succs[v]) == 1:
            return False
        stack, seen = [w for w in succs[v] if w != u], set()
        while stack:
            w = stack.pop()
            if w == u:
                return True
            if w not in seen:
                seen.add(w)
                stack.extend(succs[w])
        return False

    def sibling(v):
        others = [w for w in groups if w != v and sink(w) and groups[w]["backward"] == groups[v]["backward"]]
        return min(others, key=lambda w: abs(w - v), default=None)

    def push_sibling(v):
        """A sink group paired with its nearest sibling sink, as a merge candidate."""
        if sink(v):
            w = sibling(v)
            if w is not None:
                push(min(v, w), max(v, w))

    heap = []

    def push(v, u):
        entry = candidate(v, u)
        if entry:
            heapq.heappush(heap, entry)

    def merge(v, u):
        a, b = groups[v], groups.pop(u)
        a["members"] = sorted(a["members"] + b["members"], key=order.get)
        a["flops"] += b["flops"]
        a["bytes"] += b["bytes"]
        a["keep"] = a["keep"] or b["keep"]
        a["random"] = a["random"] or b["random"]
        version[v] += 1
        for other in preds.pop(u):
            succs[other].discard(u)
            if other != v:
                succs[other].add(v)
                preds[v].add(other)
        for other in succs.pop(u):
            preds[other].discard(u)
            if other != v:
                preds[other].add(v)
                succs[v].add(other)
        succs[v].discard(u)

    # View and element-wise operations (no FLOPs) join their latest producer, so a value is not held
    # unchanged beside its transformed copy (a norm's output beside the activation of it).
    for u in sorted(groups):
        if u in groups and groups[u]["flops"] == 0 and preds[u]:
            v = max(preds[u])
            if candidate(v, u) and not other_path(v, u):
                merge(v, u)
    for v in list(groups):
        for u in succs[v]:
            push(v, u)
        push_sibling(v)
    while len(groups) > target and heap:
        _, _, v, u, version_v, version_u = heapq.heappop(heap)
        if v not in groups or u not in groups or version[v] != version_v or version[u] != version_u \
                or candidate(v, u) is None or (u in succs[v] and other_path(v, u)):
            continue
        merge(v, u)
        for other in preds[v]:
            push(other, v)
        for other in succs[v]:
            push(v, other)
        push_sibling(v)


def _finish(joint: JointGraph, groups, preds, flops, order) -> None:
    """Order the groups topologically (earliest first member first) and fill in each :class:`Group`."""
    indegree = {key: len(preds[key]) for key in groups}
    succs = {key: [] for key in groups}
    for key in groups:
        for other in preds[key]:
            succs[other].append(key)
    ready = [key for key, count in indegree.items() if count == 0]
    heapq.heapify(ready)
    ordered = []
    while ready:
        key = heapq.heappop(ready)
        ordered.append(key)
        for other in succs[key]:
            indegree[other] -= 1
            if indegree[other] == 0:
                heapq.heappush(ready, other)
    if len(ordered) != len(groups):
        raise MemschedError("grouping the joint graph made a cycle; this is a bug in memsched's graph capture")
    index = {key: k for k, key in enumerate(ordered)}
    for key in ordered:
        for node in groups[key]["members"]:
            joint.group_of[node] = index[key]
    params = {node: parameter_name(joint.parameter_names[joint.signature.inputs_to_parameters[node.name]])
              for node in joint.placeholders if node.name in joint.signature.inputs_to_parameters}
    view_params = {}
    for node in joint.fixed_views:
        view_params[node] = {p for source in node.all_input_nodes
                             for p in ([params[source]] if source in params else view_params.get(source, ()))}
    for key in ordered:
        spec = groups[key]
        group = Group(spec["members"])
        k = index[key]
        inside = set(group.members)
        deps, read = set(), set()
        for position, node in enumerate(group.members):
            for source in node.all_input_nodes:
                if source in inside:
                    group.last_use[source] = position
                elif source in joint.group_of:
                    deps.add(joint.group_of[source])
                elif source in params:
                    read.add(params[source])
                else:
                    read.update(view_params.get(source, ()))
            external = [u for u in node.users if u.op == "output" or joint.group_of.get(u, k) != k]
            if node in joint.buffer_updates:
                group.buffer_updates.append((node, joint.buffer_updates[node]))
            if any(u.op != "output" for u in external) or node in joint.param_grads or node is joint.loss_node:
                group.outputs.append(node)
        for node in group.outputs:
            group.last_use.pop(node, None)
        group.deps = tuple(sorted(deps))
        group.params = tuple(sorted(read))
        group.backward, group.random, group.keep = spec["backward"], spec["random"], spec["keep"]
        group.flops = spec["flops"]
        representative = max(group.members, key=lambda n: (flops[n], -order[n]))
        group.name = f"{'bw' if group.backward else 'fw'}.{representative.name}"
        joint.groups.append(group)


# --------------------------------------------------------------------------------------------------
# Running groups


class StepRun:
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
