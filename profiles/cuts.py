"""Cutting a captured step into stages (for :mod:`profiles.discover`, whose docstring gives the method).

:class:`Cut` splits the graph's nodes into the prelude and the differentiable sequence and finds the cuts of the
latter: a boundary where one differentiable tensor is live and autograd keeps it (:func:`_kept`); :func:`merged`
merges the pieces into stages; :func:`stage_module` and :func:`prelude_module` build their ``GraphModule``s;
:func:`stage_names`, :func:`modules_of` and :func:`shared_names` name them for people.
"""

import functools
import operator
from dataclasses import dataclass

import torch
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_map_only

from planner.errors import MemschedError
from planner.execute.selective import written_arguments
from planner.measured_on import TensorSpec

_GUARDS = "_guards_fn"  # export's own check of its inputs' shapes: the fitted model checks its inputs itself


class OutputNotReturned(MemschedError):
    """The model's output cannot be handed back by the last stage (it lacks the loss, or holds a value no stage
    makes): the call returns the loss alone."""


@dataclass
class Piece:
    """A run of the differentiable sequence between two cuts: a stage to be."""

    nodes: list  # differentiable call nodes, in order
    incoming: object  # the node whose value comes in (a_0's node for the first piece)
    outgoing: object  # the node whose value goes out (the loss for the last, or (loss, *returned nodes))


class Cut:
    """The captured graph split into the prelude and the differentiable sequence, and the latter's cuts."""

    def __init__(self, graph_module, tensors, written, name):
        self.graph_module = graph_module
        graph = graph_module.graph
        self.placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        if len(self.placeholders) != len(tensors):
            raise MemschedError(f"{name}: the captured graph takes {len(self.placeholders)} inputs, "
                                f"the model {len(tensors)}")
        output = next(n for n in graph.nodes if n.op == "output")
        self.loss, *self.returned = tree_flatten(output.args[0])[0]  # returned: output leaves the step hands back
        self.calls = [n for n in graph.nodes if n.op == "call_function" or (
            n.op == "call_module" and n.target != _GUARDS)]
        grad_inputs = [p for p, t in zip(self.placeholders, tensors) if t.requires_grad]
        self.differentiable = self._differentiable(grad_inputs, written)
        if self.loss not in self.differentiable:
            raise MemschedError(f"{name}: the loss does not depend on any parameter that needs a gradient: "
                                f"nothing to train")
        if any(n not in self.differentiable for n in self.returned):
            raise OutputNotReturned(f"{name}: the model's output holds a value computed from its inputs alone, which "
                                    f"no stage makes: return the loss only (fit(..., returns='loss'))")
        self.sequence = [n for n in self.calls if n in self.differentiable]
        self.prelude_nodes = [n for n in self.calls if n not in self.differentiable]
        if len(grad_inputs) > 1:
            raise MemschedError(f"{name}: {len(grad_inputs)} inputs need gradients "
                                f"({', '.join(p.name for p in grad_inputs)}); a chain takes one")
        self.first = grad_inputs[0] if grad_inputs else None
        self.shared = self._shared()

    def _differentiable(self, grad_inputs, written) -> set:
        """Nodes that depend on a parameter or input needing a gradient, and the random ops and buffer reads
        and writes that come after the first of them (kept in place, in the model's order)."""
        found = set(grad_inputs)
        for node in self.graph_module.graph.nodes:
            if node.op == "get_attr":
                value = _attribute(self.graph_module, node.target)
                if isinstance(value, torch.Tensor) and value.requires_grad:
                    found.add(node)
        started = False
        read, changed = set(), set()  # storages the differentiable nodes so far read, and wrote in place
        for node in self.calls:
            reads = node.all_input_nodes
            if any(r in found for r in reads) or (started and self._in_order(node, written, read, changed)):
                found.add(node)
                started = True
                read.update(_storage_key(r.meta.get("val")) for r in reads)
                changed.update(_storage_key(w.meta.get("val")) for w in written_arguments(node))
                read.discard(None), changed.discard(None)
        return found

    def _in_order(self, node, written, read, changed) -> bool:
        """A random op, one that reads a buffer the model writes or a storage the sequence wrote in place
        (``changed``), or an in-place write to a storage a differentiable node before it read (``read``; storage
        keys). Another in-place write of prelude values (T5's ``relative_buckets += ...``, a label shift into
        ``new_zeros``) stays in the prelude, run once per step: inside a stage, every re-run of the stage would
        apply it again to the value the stages share."""
        target = node.target
        if isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags:
            return True
        keys = [_storage_key(w.meta.get("val")) for w in written_arguments(node)]
        if any(key is None or key in read or key in changed for key in keys):
            return True
        if any(_storage_key(r.meta.get("val")) in changed for r in node.all_input_nodes):
            return True
        return any(r.op == "get_attr" and r.target in written for r in node.all_input_nodes)

    def _shared(self) -> list:
        """The prelude's values (and input tensors) that differentiable nodes read, in graph order."""
        read = {r for n in self.sequence for r in n.all_input_nodes if r not in self.differentiable
                and r.op != "get_attr"}
        return [n for n in self.placeholders + self.prelude_nodes if n in read]

    def pieces(self) -> list:
        """The sequence cut wherever one differentiable tensor is live, as :class:`Piece` objects."""
        position = {n: i for i, n in enumerate(self.sequence)}
        end = len(self.sequence)
        last_use = {}
        for node in self.sequence + ([self.first] if self.first is not None else []):
            uses = [position.get(u, end) for u in node.users if u in position or u.op == "output"]
            last_use[node] = max(uses, default=-1)
        starts = {}
        for node, last in last_use.items():
            starts.setdefault(position.get(node, -1), []).append(node)
        live, cuts = set(), []
        live.update(starts.get(-1, []))
        # a returned value is handed back by the last stage: no cut once what it is made from exists
        limit = min((position.get(r, 0) for n in self.returned for r in n.all_input_nodes), default=end)
        for i, node in enumerate(self.sequence[:min(end - 1, limit)]):
            live.update(starts.get(i, []))
            live = {v for v in live if last_use[v] > i}
            if len(live) == 1:
                (value,) = live
                if isinstance(value.meta.get("val"), torch.Tensor) and value in position and _kept(value):
                    cuts.append((i, value))
        pieces, begin, incoming = [], 0, self.first
        for i, value in cuts:
            pieces.append(Piece(self.sequence[begin:i + 1], incoming, value))
            begin, incoming = i + 1, value
        pieces.append(Piece(self.sequence[begin:], incoming, (self.loss, *self.returned) if self.returned
                            else self.loss))
        if pieces[0].incoming is None:
            pieces[0].incoming = self._first_input(pieces[0])
        return pieces

    def _first_input(self, piece):
        """The chain's ``a_0`` when no input needs a gradient: the first input tensor the first piece reads."""
        read = {r for n in piece.nodes for r in n.all_input_nodes}
        return next((p for p in self.placeholders if p in read), self.placeholders[0])

    def later_shared(self, pieces) -> list:
        """The shared values, ``a_0`` left out when only the first piece reads it."""
        first = pieces[0].incoming
        later = {r for piece in pieces[1:] for n in piece.nodes for r in n.all_input_nodes}
        return [n for n in self.shared if n is not first or n in later]


def prelude_module(graph_module, cut, outputs) -> torch.fx.GraphModule:
    """``(*input tensors) -> outputs`` (``(a_0, *shared)``): the prelude's nodes, in order."""
    graph = torch.fx.Graph()
    env = {p: graph.placeholder(p.name) for p in cut.placeholders}
    for node in cut.prelude_nodes:
        env[node] = graph.node_copy(node, lambda n: env[n] if n in env else _copied_attribute(graph, env, n))
    graph.output(tuple(env[n] for n in outputs))
    return torch.fx.GraphModule(graph_module, graph, class_name="Prelude")


def shared_names(cut, shared, call) -> tuple:
    """Each shared value named for people: an input by its argument name, a computed one by its spec and the
    inputs it is made from (``bool[2,1,16,16] from attention_mask``)."""
    paths = [path for path, leaf in tree_flatten_with_path(call)[0] if isinstance(leaf, torch.Tensor)]
    inputs = {p: leaf_name(path) for p, path in zip(cut.placeholders, paths)}
    names = []
    for node in shared:
        if node in inputs:
            names.append(inputs[node])
            continue
        sources, stack, seen = [], [node], set()
        while stack:
            current = stack.pop()
            for read in current.all_input_nodes:
                if read not in seen:
                    seen.add(read)
                    stack.append(read)
                    if read in inputs:
                        sources.append(inputs[read])
        value = node.meta.get("val")
        spec = TensorSpec.of(value).to_text() if isinstance(value, torch.Tensor) else node.name
        names.append(f"{spec} from {'+'.join(sorted(sources))}" if sources else spec)
    return tuple(names)


def _kept(value) -> bool:
    """Whether autograd keeps ``value`` for the backward: its op saves its output, or an op reading it saves it,
    or it is :func:`upcast_kept`.

    The chain model holds a stage's output until the next stage's backward; a plain step frees a tensor nothing
    saved as soon as it is read. A cut is taken only at a kept value, where the two agree (an upcast-kept value
    is held by the executor to that backward: planner/execute/steprun.py). Each op is run alone on the fake
    tensors the capture left in ``meta["val"]``; an op that cannot be run so counts as keeping it.
    """
    producer, index = (value.args[0], value.args[1]) if value.target is operator.getitem else (value, None)
    if producer.op == "call_function" and _saves(producer, value, producer, index):
        return True
    return any(_saves(op, alias, producer, index) for alias in _aliases(value) for op in alias.users
               if op.op == "call_function") or upcast_kept(value)


def upcast_kept(value) -> bool:
    """Whether ``value``, a 16-bit tensor, is read by its cast to fp32 and that cast is kept: the residual stream
    of a model built in bf16 or fp16, whose normalisations compute in fp32 (``x.to(torch.float32)``, as Llama's
    RMSNorm), is saved only as that fp32 copy. Its stage boundary is taken all the same (else such a model is one
    stage), the value held to the next backward as the chain model counts it: 2 bytes an element beside the
    4 of the copy its backward keeps."""
    fake = value.meta.get("val")
    if not isinstance(fake, torch.Tensor) or fake.dtype not in (torch.bfloat16, torch.float16):
        return False
    return any(_is_upcast(op) and _kept(op) for alias in _aliases(value) for op in alias.users)


def _is_upcast(op) -> bool:
    """Whether ``op`` copies its input to fp32 (``x.to(torch.float32)`` as the capture writes it)."""
    fake = op.meta.get("val")
    return (op.op == "call_function" and op.target in _CASTS and isinstance(fake, torch.Tensor)
            and fake.dtype == torch.float32)


_CASTS = (torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype, torch.ops.aten.to.dtype_layout,
          torch.ops.prims.convert_element_type.default)


def _aliases(value) -> list:
    """``value`` and the views of it (their captured values share its storage), as later ops read them."""
    key = _storage_key(value.meta.get("val"))
    found, todo = [value], [value]
    while todo:
        for user in todo.pop().users:
            if user not in found and key is not None and _storage_key(user.meta.get("val")) == key:
                found.append(user)
                todo.append(user)
    return found


def _storage_key(value):
    return value.untyped_storage()._cdata if isinstance(value, torch.Tensor) else None


def _saves(op, value, producer, index) -> bool:
    """Whether ``op``, run alone on fresh fake tensors under autograd, saves ``value`` (its output ``index`` when
    ``op`` is the ``producer`` of a multi-output op, else the argument that is ``value``), by storage."""
    fake = value.meta["val"]
    mode = getattr(fake, "fake_mode", None)
    if mode is None or not isinstance(op.target, torch._ops.OpOverload):
        return True
    try:
        with mode:
            arguments = _fake_arguments(op, mode)
            saved = []
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t,
                                                                               lambda t: t):
                output = op.target(*arguments[0], **arguments[1])
    except Exception:  # noqa: BLE001 (an op fake tensors cannot run: the cut is taken, as before this check)
        return True
    if op is producer:
        tensor = output if index is None else output[index]
    else:
        tensor = next(a for n, a in zip(tree_flatten((op.args, op.kwargs))[0], tree_flatten(arguments)[0])
                      if n is value)
    key = _storage_key(tensor)
    return any(_storage_key(t) == key for t in saved)


def _fake_arguments(op, mode) -> tuple:
    """``(args, kwargs)`` of ``op`` as fresh fake tensors (:func:`_fake_argument`); an argument the op writes in
    place (a training BatchNorm's running statistics) requires no gradient, as the buffer it is: requiring one, the
    op refused to run ("not differentiable with respect to argument 'running_mean'"), which counted as saving its
    output, and a stage was cut at a BatchNorm's output that under autocast nothing saves (only the next
    convolution's cast reads it), the chain holding it to the next backward: 4.7% over the measured peak."""
    written = {a.name for a in op.target._schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    names = [a.name for a in op.target._schema.arguments]

    def fake(node, name):
        return tree_map_only(torch.fx.Node, lambda n: _fake_argument(n, mode, name not in written), node)

    args = tuple(fake(a, names[k] if k < len(names) else None) for k, a in enumerate(op.args))
    return args, {key: fake(value, key) for key, value in op.kwargs.items()}


def _fake_argument(node, mode, differentiable: bool = True):
    """A node's value as a fresh fake tensor (requiring a gradient when floating point and ``differentiable``), as
    the op sees it."""
    value = node.meta.get("val")
    if value is None and node.op == "get_attr":
        value = mode.from_tensor(_attribute(node.graph.owning_module, node.target))
    if not isinstance(value, torch.Tensor):
        return value
    copy = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)
    return copy.requires_grad_(differentiable and copy.is_floating_point())


def _copied_attribute(graph, env, node):
    if node.op != "get_attr":
        raise AssertionError(f"{node.name} read across a cut")
    env[node] = graph.get_attr(node.target)
    env[node].meta = dict(node.meta)
    return env[node]


def merged(pieces: list, max_stages) -> list:
    """Pieces that call no parameter, or that begin inside the module the piece before ends in when that module
    calls no other (an RMSNorm cut after its dtype cast), merged into the one before (the first into the next);
    then, while more than ``max_stages`` remain, the neighbours whose nodes share the deepest module merged."""
    leaves = _leaf_modules([n for piece in pieces for n in piece.nodes])
    whole = []
    for piece in pieces:  # first the cuts inside a leaf module, so that a block begins at its first module
        if whole and _splits_leaf(whole[-1], piece, leaves):
            whole[-1] = _joined(whole[-1], piece)
        else:
            whole.append(piece)
    merged = []
    for piece in whole:
        if merged and not _has_parameters(piece):
            merged[-1] = _joined(merged[-1], piece)
        else:
            merged.append(piece)
    if len(merged) > 1 and not _has_parameters(merged[0]):
        merged[:2] = [_joined(merged[0], merged[1])]
    while max_stages is not None and len(merged) > max_stages:
        depth = [len(_common(_paths(a.nodes) + _paths(b.nodes))) for a, b in zip(merged, merged[1:])]
        size = [len(a.nodes) + len(b.nodes) for a, b in zip(merged, merged[1:])]
        k = max(range(len(depth)), key=lambda j: (depth[j], -size[j]))
        merged[k:k + 2] = [_joined(merged[k], merged[k + 1])]
    return merged


def joined(pieces: list, later: list) -> list:
    """``pieces`` with each piece whose index is in ``later`` joined into the one before it."""
    whole = []
    for k, piece in enumerate(pieces):
        if k in later and whole:
            whole[-1] = _joined(whole[-1], piece)
        else:
            whole.append(piece)
    return whole


def _joined(before, after):
    return Piece(before.nodes + after.nodes, before.incoming, after.outgoing)


def _leaf_modules(nodes) -> set:
    """The module paths (not the model's top) that no op runs below."""
    paths = set(_paths(nodes))
    inner = {path[:k] for path in paths for k in range(len(path))}
    return {path for path in paths if path and path not in inner and path != ("(loss)",)}


def _splits_leaf(before, after, leaves) -> bool:
    last, first = _paths(before.nodes[-1:])[0], _paths(after.nodes[:1])[0]
    return last == first and last in leaves


def _has_parameters(piece) -> bool:
    return any(_reads_parameter(n) for n in piece.nodes)


def _reads_parameter(node) -> bool:
    """Whether ``node`` reads a parameter of the model (not a buffer or a constant)."""
    return any(r.op == "get_attr" and isinstance(_attribute(r.graph.owning_module, r.target), torch.nn.Parameter)
               for r in node.all_input_nodes)


# --------------------------------------------------------------------------------------------------
# Stage modules and names


def stage_module(graph_module, piece, shared, written) -> torch.fx.GraphModule:
    """``stage(activation, *shared)`` for ``piece``: its nodes copied, the model's attributes referred to."""
    graph = torch.fx.Graph()
    env = {}
    for k, node in enumerate(shared):
        env[node] = graph.placeholder(f"shared_{k}_{node.name}")
    env[piece.incoming] = graph.placeholder("activation")
    for node in piece.nodes:
        env[node] = graph.node_copy(node, lambda n: env[n] if n in env else _copied_attribute(graph, env, n))
    outgoing = piece.outgoing
    graph.output(tuple(env[n] for n in outgoing) if isinstance(outgoing, tuple) else env[outgoing])
    _activation_first(graph)
    _private_copies(graph, {env[n]: n for n in [piece.incoming, *shared]}, {env[n]: n for n in piece.nodes})
    module = torch.fx.GraphModule(graph_module, graph, class_name="DiscoveredStage")
    module.memsched_written_buffers = tuple(_owner(module, n.target) for n in graph.nodes
                                           if n.op == "get_attr" and n.target in written)
    return module


def _private_copies(graph, inputs: dict, copied: dict) -> None:
    """An input the stage writes in place (``out.index_add_(...)`` into a ``zeros`` the prelude made, a ``+=`` on
    the stage's input) replaced inside the stage by a copy it makes first: a re-run of the stage (a
    recomputation, the profiler's runs) then writes a fresh copy, not again the value it was given. ``inputs``
    and ``copied``: the stage's placeholders and operations -> the captured graph's nodes (their fake values)."""
    keys = {_storage_key(written.meta.get("val")) for original in copied.values()
            for written in written_arguments(original)}
    keys.discard(None)
    last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    for placeholder, original in inputs.items():
        if _storage_key(original.meta.get("val")) not in keys:
            continue
        with graph.inserting_after(last):
            copy = graph.call_function(torch.ops.aten.clone.default, (placeholder,))
        copy.meta = dict(original.meta)
        placeholder.replace_all_uses_with(copy, delete_user_cb=lambda user: user is not copy)
        last = copy


def _activation_first(graph) -> None:
    """Placeholders in the order ``(activation, *shared)``."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    activation = next(n for n in placeholders if n.target == "activation")
    placeholders[0].prepend(activation)


def _owner(module, target) -> tuple:
    """``(module holding the buffer, its name)`` for a dotted buffer ``target``."""
    path, _, field = target.rpartition(".")
    return _attribute(module, path), field


def _attribute(root, target: str):
    """``root``'s attribute at the dotted ``target`` (``root`` itself for ``""``)."""
    return functools.reduce(getattr, target.split("."), root) if target else root


def _paths(nodes) -> list:
    """The module path of each node as a tuple of names, ``model.`` left off (so the model's own ops have ());
    the loss function's ops, outside the model, have ``("(loss)",)``."""
    found = []
    for node in nodes:
        stack = node.meta.get("nn_module_stack") or {}
        path = list(stack.values())[-1][0] if stack else ""
        parts = tuple(path.split(".")) if path else ()
        found.append(parts[1:] if parts[:1] == ("model",) else ("(loss)",) if not parts else parts)
    return found


def _common(paths) -> tuple:
    common = paths[0] if paths else ()
    for path in paths[1:]:
        n = 0
        while n < min(len(common), len(path)) and common[n] == path[n]:
            n += 1
        common = common[:n]
    return common


def modules_of(nodes) -> tuple:
    """The distinct module paths a stage's ops run in, in order."""
    return tuple(dict.fromkeys(".".join(p) or "model" for p in _paths(nodes)))


def stage_names(pieces_nodes) -> list:
    """Each piece named after the module that holds all its ops (``top`` for the model itself); pieces of one
    module told apart by the modules below it whose parameters they use: ``transformer.h.0[ln_2,mlp]``."""
    bases = [".".join(_common(_paths(nodes))) or "top" for nodes in pieces_nodes]
    names, seen = [], {}
    for base, nodes in zip(bases, pieces_nodes):
        name = base
        if bases.count(base) > 1:
            depth = len(_common(_paths(nodes)))
            users = [n for n in nodes if _reads_parameter(n)]
            children = dict.fromkeys(p[depth] for p in _paths(users) if len(p) > depth)
            name = f"{base}[{','.join(children)}]" if children else base
        seen[name] = seen.get(name, 0) + 1
        names.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
    return names


def leaf_name(path) -> str:
    """``argument 0``, ``attention_mask``, ``labels['x']``: an input leaf named as the caller wrote it."""
    head = path[1]
    name = f"argument {head.idx}" if path[0].idx == 0 else str(head.key)
    return name + keystr(path[2:])
