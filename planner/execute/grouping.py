"""Group a captured joint graph's operations into at most ``nodes`` graph nodes (:class:`Group`).

:func:`group` fills ``joint.groups``, ``joint.group_of``, ``joint.fixed_views`` and ``joint.fixed_bytes`` of a
:class:`planner.execute.capture.JointGraph` (it receives the joint graph; it does not import the capture).
Atoms (operations sharing storage) are fused, cheapest first, into nodes that keep the node graph acyclic,
never mix forward and backward, and keep random operations in the eager order; docs/execution.md
("Graph capture") gives the rules. Grouping the same joint graph twice gives the same groups.
"""

import heapq
import operator
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

from planner.errors import MemschedError
from planner.execute.stages import quiet_fake_tensor_log


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


def call_node(node, env):
    """Run one fx node on the values in ``env``."""
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
    return node.target(*args, **kwargs)


def group(joint, target: int, inputs) -> None:
    """Group ``joint``'s operations into at most ``target`` groups (fewer when nothing more can be fused)."""
    storages, flops = _analyse(joint, inputs)
    grouping = _atoms(joint, storages, flops)
    _Coarsening(grouping).run(target)
    _finish(joint, grouping)


# --------------------------------------------------------------------------------------------------
# Atoms


@dataclass
class Part:
    """A group being formed: its fx nodes (graph order) and what the coarsening weighs and must respect."""

    members: list
    flops: int
    bytes: int
    backward: bool
    keep: bool
    random: bool


@dataclass
class Grouping:
    """The groups being formed, keyed by their first member's position in the graph, and their edges."""

    parts: dict  # key -> Part
    preds: dict  # key -> set of keys it reads (and ordering edges between random parts)
    succs: dict  # key -> set of keys reading it
    order: dict  # fx node -> position in the graph
    flops: dict  # fx node -> FLOPs


def _storage_keys(value) -> dict:
    return {t.untyped_storage()._cdata: t.untyped_storage().nbytes()
            for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)}


def _is_random(node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in node.target.tags


def _analyse(joint, inputs):
    """Run the graph once on fake tensors, keeping everything alive: per fx node its storages and FLOPs.

    Nodes that read only fixed values and allocate nothing (views of parameters) become fixed views.
    """
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
                env[node] = call_node(node, env)
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


def _forward_nodes(joint) -> set:
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


def _atoms(joint, storages, flops) -> Grouping:
    """One part per atom, with the edges between atoms and an ordering edge between consecutive random atoms."""
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
    parts = {}
    for nodes in members.values():
        nodes.sort(key=order.get)
        parts[order[nodes[0]]] = Part(
            members=nodes, flops=sum(flops[n] for n in nodes),
            bytes=sum({k: v for n in nodes for k, v in storages[n].items()}.values()),
            backward=nodes[0] not in forward, keep=any(n in keep_nodes for n in nodes),
            random=any(_is_random(n) for n in nodes))
    part_of = {node: key for key, part in parts.items() for node in part.members}
    preds = {key: set() for key in parts}
    succs = {key: set() for key in parts}
    for key, part in parts.items():
        for node in part.members:
            for source in node.all_input_nodes:
                other = part_of.get(source)
                if other is not None and other != key:
                    preds[key].add(other)
                    succs[other].add(key)
    randoms = sorted(key for key, part in parts.items() if part.random)
    for before, after in zip(randoms, randoms[1:]):  # random operations keep the eager step's order
        preds[after].add(before)
        succs[before].add(after)
    return Grouping(parts, preds, succs, order, flops)


# --------------------------------------------------------------------------------------------------
# Coarsening


# NOTE [coarsening]
# Parts are fused, cheapest first (FLOPs, then bytes), along an edge ``v -> u`` when no other path leads
# from ``v`` to ``u`` (so the node graph stays acyclic), or, for two parameter-gradient parts that nothing
# reads (sinks), side by side. Forward and backward never mix, and a value kept to the end absorbs only a
# producer read by it alone. Heap entries carry both parts' versions: an entry whose parts changed since
# it was pushed is stale and skipped. View and element-wise parts (no FLOPs) first join their latest
# producer, so a value is not held unchanged beside its transformed copy (a norm's output beside the
# activation of it).
class _Coarsening:
    """Fuses the parts of a :class:`Grouping` in place (see NOTE [coarsening])."""

    def __init__(self, grouping: Grouping):
        self.parts, self.preds, self.succs = grouping.parts, grouping.preds, grouping.succs
        self.order = grouping.order
        self.version = {key: 0 for key in self.parts}
        self.heap = []

    def sink(self, key) -> bool:
        return self.parts[key].keep and not self.succs[key]

    def candidate(self, v, u):
        """The heap entry for fusing ``u`` into ``v``, or None when they may not be fused."""
        a, b = self.parts[v], self.parts[u]
        if a.backward != b.backward:
            return None
        if u in self.succs[v]:
            if a.keep != b.keep and (b.keep is False or self.succs[v] != {u}):
                return None
        elif not (self.sink(v) and self.sink(u)):
            return None
        return (a.flops + b.flops, a.bytes + b.bytes, v, u, self.version[v], self.version[u])

    def other_path(self, v, u) -> bool:
        """True when a path other than the edge ``v -> u`` leads from ``v`` to ``u``."""
        if len(self.preds[u]) == 1 or len(self.succs[v]) == 1:
            return False
        stack, seen = [w for w in self.succs[v] if w != u], set()
        while stack:
            w = stack.pop()
            if w == u:
                return True
            if w not in seen:
                seen.add(w)
                stack.extend(self.succs[w])
        return False

    def push(self, v, u) -> None:
        entry = self.candidate(v, u)
        if entry:
            heapq.heappush(self.heap, entry)

    def push_sibling(self, v) -> None:
        """A sink part paired with its nearest sibling sink, as a merge candidate."""
        if self.sink(v):
            others = [w for w in self.parts
                      if w != v and self.sink(w) and self.parts[w].backward == self.parts[v].backward]
            w = min(others, key=lambda w: abs(w - v), default=None)
            if w is not None:
                self.push(min(v, w), max(v, w))

    def merge(self, v, u) -> None:
        a, b = self.parts[v], self.parts.pop(u)
        a.members = sorted(a.members + b.members, key=self.order.get)
        a.flops += b.flops
        a.bytes += b.bytes
        a.keep = a.keep or b.keep
        a.random = a.random or b.random
        self.version[v] += 1
        preds, succs = self.preds, self.succs
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

    def run(self, target: int) -> None:
        """Fuse until at most ``target`` parts remain or no candidate is left."""
        parts, version = self.parts, self.version
        for u in sorted(parts):
            if u in parts and parts[u].flops == 0 and self.preds[u]:
                v = max(self.preds[u])
                if self.candidate(v, u) and not self.other_path(v, u):
                    self.merge(v, u)
        for v in list(parts):
            for u in self.succs[v]:
                self.push(v, u)
            self.push_sibling(v)
        while len(parts) > target and self.heap:
            _, _, v, u, version_v, version_u = heapq.heappop(self.heap)
            if v not in parts or u not in parts or version[v] != version_v or version[u] != version_u \
                    or self.candidate(v, u) is None or (u in self.succs[v] and self.other_path(v, u)):
                continue
            self.merge(v, u)
            for other in self.preds[v]:
                self.push(other, v)
            for other in self.succs[v]:
                self.push(v, other)
            self.push_sibling(v)


# --------------------------------------------------------------------------------------------------
# The groups


def _topological(grouping: Grouping) -> list:
    """The parts' keys in topological order, the earliest first member first."""
    parts, preds = grouping.parts, grouping.preds
    indegree = {key: len(preds[key]) for key in parts}
    succs = {key: [] for key in parts}
    for key in parts:
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
    if len(ordered) != len(parts):
        raise MemschedError("grouping the joint graph made a cycle; this is a bug in memsched's graph capture")
    return ordered


def _finish(joint, grouping: Grouping) -> None:
    """Order the parts topologically and fill in a :class:`Group` for each, in ``joint.groups``."""
    ordered = _topological(grouping)
    index = {key: k for k, key in enumerate(ordered)}
    for key in ordered:
        for node in grouping.parts[key].members:
            joint.group_of[node] = index[key]
    params = joint.placeholder_parameters()
    view_params = {}
    for node in joint.fixed_views:
        view_params[node] = {p for source in node.all_input_nodes
                             for p in ([params[source]] if source in params else view_params.get(source, ()))}
    for key in ordered:
        part = grouping.parts[key]
        joint.groups.append(_group_of(joint, part, index[key], params, view_params, grouping))


def _group_of(joint, part: Part, k: int, params: dict, view_params: dict, grouping: Grouping) -> Group:
    """Group ``k`` from ``part``: its value, dependencies, parameters read and the last use of each member."""
    group = Group(part.members)
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
    group.backward, group.random, group.keep = part.backward, part.random, part.keep
    group.flops = part.flops
    flops, order = grouping.flops, grouping.order
    representative = max(group.members, key=lambda n: (flops[n], -order[n]))
    group.name = f"{'bw' if group.backward else 'fw'}.{representative.name}"
    return group
