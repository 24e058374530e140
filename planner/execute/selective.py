"""A stage run with one of its options: the values of some forward operations dropped, recomputed at the backward.

A stage option (:class:`planner.chain.StageOption`) names operations of the stage's graph (``recompute``:
positions among its ``call_function`` nodes, in graph order). :func:`stage_graph` gives that graph: a
discovered stage is one already (profiles/discover.py); any other module is exported once per structure
(``torch.export``, non-strict; identical blocks share the graph, bound to their own parameters), and runs the
same ATen operations as the module. :func:`run_with_option` runs it as one eager call: a plain forward with
autograd under ``saved_tensors_hooks`` whose pack hook keeps every saved tensor except those on a dropped
value's storage, which it replaces by a handle; the first unpack of a handle (in the stage's backward) runs the
dropped operations again, without autograd, from the values they read (held since the forward, the *frontier*),
and each recomputed value is let go after its last unpack. Only the dropped operations are recomputed: the
backward itself is the plain one; a random operation is recomputed from the generator states it started from,
so its numbers are the forward's. Which operations may be recomputed (:func:`recomputable`): none that writes
in place or updates running statistics, and none whose value an in-place write fills or that reads a storage
before an in-place write to it (:func:`replays_in_place_writes`: the write is not replayed); the profiler drops
only values on new storages other than the output's. Rules, memory and traps: docs/execution.md ("Stage options").
"""

import contextlib
import copy
import operator
import warnings
import weakref
from dataclasses import dataclass

import torch
from torch.fx.node import map_arg
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten

from planner.errors import MemschedError
from planner.execute.autograd import rng_devices, rng_state, set_rng_state
from planner.execute.compiled_option import CompiledOption, SelectiveRegion

_EXPORTED = {}  # structure key -> an exported graph module of a stage with that structure
_EXPORTS_KEPT = 16
_PREPARED = weakref.WeakKeyDictionary()  # module -> {recompute positions: _Selective}
_ACTIVE = []  # the runs whose forward is in progress (innermost last)


# --------------------------------------------------------------------------------------------------
# The stage's graph


def stage_graph(module, args) -> torch.fx.GraphModule:
    """``module`` as a graph module taking ``args`` (the stage's input and extra inputs), with ``module``'s own
    parameters and buffers."""
    if isinstance(module, torch.fx.GraphModule):
        return module
    key = structure_key(module, args)
    if key not in _EXPORTED:
        if len(_EXPORTED) >= _EXPORTS_KEPT:  # the oldest first (dicts keep insertion order)
            del _EXPORTED[next(iter(_EXPORTED))]
        with _quiet_pytree():
            exported = torch.export.export(module, tuple(args), strict=False)
            _EXPORTED[key] = exported.run_decompositions({}).module()  # dropout as native_dropout: a mask value
    return _rebound(_EXPORTED[key], module)


def structure_key(module, args) -> tuple:
    """What makes two modules run the same graph: their classes and settings (every submodule's plain
    attributes), parameter and buffer shapes, the inputs' shapes, the tensors' kinds (a graph exported on fake
    tensors keeps fake constants) and the training flag."""
    tensors = [t for t in tree_flatten(list(args))[0] if isinstance(t, torch.Tensor)]
    settings = tuple((name, type(sub).__qualname__, tuple(sorted(
        (key, repr(value)) for key, value in vars(sub).items()
        if not key.startswith("_") and isinstance(value, (bool, int, float, str, type(None), tuple)))))
        for name, sub in module.named_modules())
    return (settings, repr(module),
            tuple((name, tuple(p.shape), p.dtype) for name, p in module.named_parameters()),
            tuple((name, tuple(b.shape), b.dtype) for name, b in module.named_buffers()),
            tuple((type(t).__name__, tuple(t.shape), t.dtype, t.device.type)  # a fake tensor's export is its own
                  for t in tensors + list(module.parameters()) + list(module.buffers())), module.training)


def _rebound(graph_module, module):
    """``graph_module``'s graph over ``module``'s attributes (parameters, buffers) where it has them."""
    attributes = {}
    for node in graph_module.graph.nodes:
        if node.op in ("get_attr", "call_module"):
            try:
                attributes[node.target] = _attribute(module, node.target)
            except AttributeError:  # the export's own (its input checks)
                attributes[node.target] = _attribute(graph_module, node.target)
    rebound = torch.fx.GraphModule(attributes, _copied(graph_module.graph))
    rebound.train(module.training)
    return rebound


def _copied(graph):
    """A deep copy of ``graph``."""
    with _quiet_pytree():
        return copy.deepcopy(graph)


@contextlib.contextmanager
def _quiet_pytree():
    """Without the pytree deprecation warning torch's export raises when its specs are copied (it would reach the
    user's terminal, about torch's own code)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, message=".*LeafSpec.*")
        yield


def _attribute(root, dotted: str):
    for part in dotted.split("."):
        root = getattr(root, part)
    return root


def operations(graph_module) -> list:
    """The ``call_function`` nodes of the graph, in graph order: what option positions index."""
    return [node for node in graph_module.graph.nodes if node.op == "call_function"]


def writes_in_place(graph_module) -> bool:
    """Whether an operation of the graph writes in place (an exported BatchNorm's running statistics): such a
    graph cannot run inside a compiled selective checkpoint (planner/execute/compiled_option.py)."""
    return any(isinstance(n.target, torch._ops.OpOverload) and any(
        a.alias_info is not None and a.alias_info.is_write for a in n.target._schema.arguments)
        for n in operations(graph_module))


def recomputable(node) -> bool:
    """Whether an option may recompute ``node``: an ATen operation whose results are tensors, that writes
    nothing in place and is no normalisation updating running statistics (the recomputation would update them
    again; the functional form, whose new statistics a later ``copy_`` writes, is one), or an item of such an
    operation's results. Views cost nothing; a random operation is replayed from
    the generator state it started from."""
    if node.target is operator.getitem:
        return isinstance(node.args[0], torch.fx.Node) and recomputable(node.args[0])
    target, value = node.target, node.meta.get("val")
    values = value if isinstance(value, (tuple, list)) else (value,)
    if not isinstance(target, torch._ops.OpOverload) or not values or not all(
            isinstance(v, torch.Tensor) for v in values):
        return False
    schema = target._schema
    if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments + schema.returns):
        return False
    name = target._overloadpacket.__name__  # the functional form returns new statistics, a copy_ writes them
    return "functional" in name or ("batch_norm" not in name and "instance_norm" not in name)


def replays_in_place_writes(graph_module) -> set:
    """The operations no option may recompute because of an in-place write the recomputation would not replay:
    those whose value lives on a storage some operation writes in place (``buf = empty_like(x); buf[i] = v``,
    ``out.index_add_(...)``: recomputed, the value would be the bare allocation), and those that read such a
    storage before its last write (recomputed after it, they would read the written values: a sum taken before
    ``w /= sum``). Storages are followed through views by the operations' alias annotations. A buffer of the
    module is left to :func:`recomputable`'s rule: the functional normalisation reading its running statistics
    recomputes only values its ``copy_`` writes, and no recomputation replays that ``copy_``."""
    nodes = operations(graph_module)
    base = {}  # node -> the node that made the storage its value lives on
    last_write = {}  # that node -> the position of the last operation writing it in place
    for position, node in enumerate(nodes):
        base[node] = _storage_maker(node, base)
        for written in written_arguments(node):
            last_write[base.get(written, written)] = position
    hazards = {node for node in nodes if base[node] in last_write}
    for position, node in enumerate(nodes):
        for read in node.all_input_nodes:
            made = base.get(read, read)
            if made.op != "get_attr" and last_write.get(made, -1) > position:
                hazards.add(node)
    for node in list(hazards):  # an item of a tuple: the operation making the tuple recomputes it
        if node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
            hazards.add(node.args[0])
    return hazards


def _storage_maker(node, base):
    """The node whose new storage ``node``'s value lives on: itself, or for a view (an alias in its schema's
    returns, an item of a tuple of views) the maker of the argument it views."""
    if node.target is operator.getitem:
        source = node.args[0]
        if isinstance(source, torch.fx.Node) and isinstance(source.target, torch._ops.OpOverload):
            returns = source.target._schema.returns
            item = returns[0] if len(returns) == 1 else returns[node.args[1]] if node.args[1] < len(returns) else None
            if item is not None and item.alias_info is not None:
                return base.get(source, source)
        return node
    if not isinstance(node.target, torch._ops.OpOverload):
        return node
    schema = node.target._schema
    sets = {a for r in schema.returns if r.alias_info is not None for a in r.alias_info.before_set}
    for argument, value in zip(schema.arguments, _bound_arguments(node)):
        if argument.alias_info is not None and sets & set(argument.alias_info.before_set) and isinstance(
                value, torch.fx.Node):
            return base.get(value, value)
    return node


def written_arguments(node) -> list:
    """The nodes an operation writes in place (its schema's arguments marked ``Tensor(a!)``)."""
    if not isinstance(node.target, torch._ops.OpOverload):
        return []
    values = _bound_arguments(node)
    return [value for argument, value in zip(node.target._schema.arguments, values)
            if argument.alias_info is not None and argument.alias_info.is_write and isinstance(value, torch.fx.Node)]


def _bound_arguments(node) -> list:
    """The node's arguments in its schema's order (keyword ones by name; None where not given)."""
    schema = node.target._schema
    return [node.args[k] if k < len(node.args) else node.kwargs.get(argument.name)
            for k, argument in enumerate(schema.arguments)]


def _random(node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in node.target.tags


@dataclass(frozen=True)
class ForwardNode:
    """One operation of a stage's graph as options see it.

    ``position`` in :func:`operations`; ``inputs``: the positions of the operations it reads (placeholders and
    attributes left out: the stage's inputs and parameters, held anyway); ``recomputable`` (see
    :func:`recomputable`); ``bytes`` of the new storage its value is on (0: a view, or on the stage's output,
    which the chain holds anyway); ``saved``: autograd saves a tensor on that storage in the plain forward;
    ``flops`` it does (``torch.utils.flop_counter``: matrix products, convolutions and attention; 0 for the
    others); ``several``: its value is a tuple of tensors (read by ``getitem`` nodes). Counts, not a clock: the
    options proposed from them are the same on every run (profiles/options.py).
    """

    position: int
    name: str  # the operation (``aten.linear.default``)
    inputs: tuple
    recomputable: bool
    bytes: int
    saved: bool
    flops: int
    several: bool = False


def forward_nodes(module, args) -> list:
    """The :class:`ForwardNode` s of ``module(*args)``'s graph, from one forward with autograd run node by node
    (real or fake tensors: the same nodes). The caller restores what the forward changes (running statistics,
    random state)."""
    from torch.utils.flop_counter import FlopCounterMode

    graph_module = stage_graph(module, args)
    positions = {node: k for k, node in enumerate(operations(graph_module))}
    hazards = replays_in_place_writes(graph_module)
    found, saved, keys = [], set(), {}  # keys: node -> storage key of its value (views: their base's)
    flat = tree_flatten(list(args))[0]

    class _Counted(torch.fx.Interpreter):
        def run_node(self, node):
            if node not in positions:
                return super().run_node(node)
            with FlopCounterMode(display=False) as counter:
                value = super().run_node(node)
            fresh = isinstance(value, torch.Tensor) and (node.target is operator.getitem or all(
                r.alias_info is None for r in node.target._schema.returns))
            found.append((node, value.untyped_storage() if fresh else None, counter.get_total_flops()))
            keys[node] = value.untyped_storage()._cdata if isinstance(value, torch.Tensor) else None
            return value

    def pack(tensor):
        saved.add(tensor.untyped_storage()._cdata)
        return tensor

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = _Counted(graph_module).run(*flat)
    output_keys = {t.untyped_storage()._cdata for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)}
    nodes = []
    for node, storage, flops in found:
        on_output = isinstance(node.meta.get("val"), torch.Tensor) and keys[node] in output_keys
        own = storage is not None and not on_output
        nodes.append(ForwardNode(positions[node], str(node.target), tuple(positions[d] for d in node.all_input_nodes
                                                                  if d in positions),
                                 recomputable(node) and node not in hazards and not on_output,
                                 storage.nbytes() if own else 0, own and storage._cdata in saved, flops,
                                 isinstance(node.meta.get("val"), (tuple, list))))
    return nodes


# --------------------------------------------------------------------------------------------------
# Running with an option


def run_with_option(module, recompute, *args, compiled: bool = False):
    """``module(*args)`` with the values of the operations at positions ``recompute`` dropped after the forward
    and recomputed at its backward (see the module docstring); ``compiled``: through ``torch.compile``, as one
    compiled forward and backward with the recomputation inside (planner/execute/compiled_option.py), unless the
    graph writes in place."""
    return _prepared(module, recompute, compiled, args).run(module, args)


def recomputation(module, recompute, *args):
    """What running ``module(*args)`` with option ``recompute`` adds to its backward, as a callable to time: the
    dropped operations its backward reads (and those they read) recomputed without autograd from the frontier of
    one forward run here (its output let go)."""
    selective = _prepared(module, recompute, False, args)
    run = _Run(selective)
    selective.forward(module, args, run)
    held, generators, wanted = run.held, run.generators, sorted(run.uses)
    return lambda: selective.recompute(held, generators, wanted)


def _prepared(module, recompute, compiled: bool, args) -> "_Selective":
    """The stage's option, made at its first call: the stage's graph exported (on fake tensors, inside
    ``torch.export``) and marked, hidden from the caller's dispatch modes (:func:`unobserved`)."""
    prepared = _PREPARED.setdefault(module, {})
    key = tuple(recompute), compiled
    if key not in prepared:
        with unobserved():
            prepared[key] = _preparation(module, key, args)
    return prepared[key]


@contextlib.contextmanager
def unobserved():
    """The caller's dispatch modes (a memory tracker around the training step, a FLOP counter) set aside: what
    runs inside is torch's tracing of a stage on fake tensors, which allocate nothing (their storages are on the
    meta device), but a tracker counting every new storage would count them in the step that exports (the first
    step peaked at 1.56 of its prediction on a mixer with options, then 1.000)."""
    with _disable_current_modes():
        yield


def _preparation(module, key, args):
    """What :func:`_prepared` keeps for ``key`` (recompute positions, compiled)."""
    recompute, compiled = key
    graph_module = stage_graph(module, args)
    nodes = operations(graph_module)
    if recompute and max(recompute) >= len(nodes):
        raise ValueError(f"the stage's graph has {len(nodes)} operations; position {max(recompute)} is not one")
    _check_replayable(graph_module, [nodes[p] for p in recompute], type(module).__name__)
    region = compiled_region(graph_module, recompute, args, type(module).__name__, module) if compiled else None
    return CompiledOption(region) if region is not None else _Selective(graph_module, recompute)


def _check_replayable(graph_module, dropped, name: str) -> None:
    """Refuse, in one line, an option dropping an operation that cannot be recomputed as the forward ran it."""
    hazards = replays_in_place_writes(graph_module)
    for node in dropped:
        if not recomputable(node) or node in hazards:
            raise MemschedError(f"{name}: a stage option recomputes {node.name} ({node.target}), which writes in "
                                f"place or whose value an in-place write fills or changes after it: the "
                                f"recomputation would not replay it; profile the chain again")


def compiled_region(graph_module, recompute, args, name: str, module):
    """The :class:`planner.execute.compiled_option.SelectiveRegion` running ``graph_module`` (``module``'s)
    recomputing the operations at positions ``recompute`` (``args``: an example call), or None where the graph
    writes in place (its option then runs eagerly). Where its compiled function runs eagerly (under a dispatch
    mode), the region runs ``module`` with the option as the eager plan does."""
    if writes_in_place(graph_module):
        return None
    nodes = operations(graph_module)
    return SelectiveRegion(graph_module, [nodes[p] for p in recompute], args, name,
                           eager=lambda *inputs: run_with_option(module, recompute, *inputs))


def _note(value, index, held):
    """Inserted after a dropped operation (``held`` False: its storage is noted) or a frontier value (``held``
    True: the value is kept for the recomputation)."""
    _ACTIVE[-1].note(value, index, held)


def _note_generators(index):
    """Inserted before a dropped random operation: the generator states it starts from."""
    _ACTIVE[-1].generators[index] = rng_state()


class _Selective:
    """A stage's graph with notes after its dropped operations and its frontier, and their recomputation."""

    def __init__(self, graph_module, recompute):
        nodes = operations(graph_module)
        self.dropped = [nodes[p] for p in recompute]
        dropped = set(self.dropped)
        self.frontier = list({d: None for n in self.dropped for d in n.all_input_nodes if d not in dropped})
        graph = _copied(graph_module.graph)
        copies = dict(zip(graph_module.graph.nodes, graph.nodes))
        # An input's note goes after the last input (an exported graph reads its attributes before its inputs).
        last_input = [node for node in graph.nodes if node.op == "placeholder"][-1]
        for k, node in enumerate(self.dropped):
            if isinstance(node.meta.get("val"), torch.Tensor):  # a tuple's items are noted at their getitem
                with graph.inserting_after(copies[node]):
                    graph.call_function(_note, (copies[node], k, False))
            if _random(node):
                with graph.inserting_before(copies[node]):
                    graph.call_function(_note_generators, (k,))
        for k, node in enumerate(self.frontier):
            at = copies[node]
            with graph.inserting_after(last_input if at.op == "placeholder" else at):
                graph.call_function(_note, (at, k, True))
        attributes = {node.target: _attribute(graph_module, node.target) for node in graph_module.graph.nodes
                      if node.op in ("get_attr", "call_module")}
        self.marked = torch.fx.GraphModule(attributes, graph)
        self.marked.train(graph_module.training)
        # Parameters and buffers are read from the module at each call: a recomputed stage runs on throw-away
        # copies of its running statistics, swapped into the module (planner.execute.autograd.
        # running_statistics_kept), and a stage prepared while its tensors were fake copies (an estimate of a new
        # shape, profiles/fake_build.py) runs on its own tensors once they are back.
        self.tensors = [target for target, value in attributes.items() if isinstance(value, torch.Tensor)]

    def run(self, module, args):
        run = _Run(self)
        try:
            return self.forward(module, args, run)
        finally:
            run.forward_done()

    def forward(self, module, args, run):
        """``module``'s forward on ``args`` through the marked graph, ``run`` taking the notes and saved tensors."""
        for target in self.tensors:
            try:
                value = _attribute(module, target)
            except AttributeError:  # the export's own
                continue
            *path, name = target.split(".")
            owner = _attribute(self.marked, ".".join(path)) if path else self.marked
            (owner._parameters if name in owner._parameters else owner._buffers)[name] = value
        _ACTIVE.append(run)
        try:
            with torch.autograd.graph.saved_tensors_hooks(run.pack, run.unpack):
                return self.marked(*args)
        finally:
            _ACTIVE.pop()

    def recompute(self, held: dict, generators: dict, wanted) -> dict:
        """``{k: value}`` of the dropped operations ``wanted`` (indices into :attr:`dropped`), recomputed without
        autograd from the frontier values ``held``, a random one from its ``generators`` states (the caller's
        are left as they were); operations none of them needs are skipped."""
        needed, stack = set(), [self.dropped[k] for k in wanted]
        dropped = set(self.dropped)
        while stack:
            node = stack.pop()
            if node not in needed:
                needed.add(node)
                stack.extend(d for d in node.all_input_nodes if d in dropped)
        values = {node: held[k] for k, node in enumerate(self.frontier)}
        replay = torch.random.fork_rng(devices=rng_devices()) if generators else contextlib.nullcontext()
        with torch.no_grad(), replay:
            for k, node in enumerate(self.dropped):
                if node in needed:
                    if k in generators:
                        set_rng_state(generators[k])
                    values[node] = node.target(*map_arg(node.args, values.__getitem__),
                                               **map_arg(node.kwargs, values.__getitem__))
        return {k: values[self.dropped[k]] for k in wanted}


class _Run:
    """One forward of a stage with an option: the dropped storages, the held frontier, the recomputed values.

    A saved tensor is packed when the operation that saves it runs, which for an operation saving its own
    result (``relu``, ``softmax``) is before the note after it says the result is dropped: every tensor packed
    during the forward waits in a one-item list, and a note turns those already packed on its storage into
    handles (so the list, not the tensor, is what autograd keeps)."""

    def __init__(self, selective):
        self.selective = selective
        self.dropped_keys = {}  # storage key -> index of the dropped operation that made it (while it lives)
        self.packed = {}  # storage key -> the lists packed on it so far (during the forward)
        self.held = {}
        self.generators = {}  # index of a dropped random operation -> the generator states it started from
        self.uses = {}  # index -> handles still to unpack
        self.values = None

    def note(self, value, index, held):
        if held:
            self.held[index] = value
            return
        storage = value.untyped_storage()
        key = storage._cdata
        self.dropped_keys[key] = index
        weakref.finalize(storage, self.dropped_keys.pop, key, None)  # a later storage may reuse the address
        for box in self.packed.pop(key, ()):
            box[0] = self._handle(box[0], index)

    def forward_done(self):
        if not self.uses:  # nothing was dropped that the backward reads: hold nothing
            self.held = self.generators = None
        self.dropped_keys, self.packed = {}, {}

    def _handle(self, tensor, index) -> tuple:
        self.uses[index] = self.uses.get(index, 0) + 1
        return index, tensor.size(), tensor.stride(), tensor.storage_offset()

    def pack(self, tensor):
        key = tensor.untyped_storage()._cdata
        index = self.dropped_keys.get(key)
        if index is not None:
            return [self._handle(tensor, index)]
        box = [tensor]
        self.packed.setdefault(key, []).append(box)
        return box

    def unpack(self, box):
        packed = box[0]
        if isinstance(packed, torch.Tensor):
            return packed
        index, size, stride, offset = packed
        if self.values is None:
            self.values = self.selective.recompute(self.held, self.generators, sorted(self.uses))
            self.held = self.generators = None
        value = self.values[index]
        self.uses[index] -= 1
        if not self.uses[index]:
            del self.values[index]
        return value.as_strided(size, stride, offset)
