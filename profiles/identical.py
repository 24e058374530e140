"""Identical stages: which stages of a chain the profiler may measure once (a transformer's blocks).

:func:`stage_key` gives two stages the same key only when measuring them must give the same figures, bytes to
the byte: the same computation on inputs laid out alike. A discovered stage (a ``torch.fx.GraphModule``,
profiles/discover.py) is compared by its graph, written without its nodes' and attributes' names: each node's
kind, operation, arguments (nodes by position, constants by value) and value's layout, and each attribute
tensor's layout, kind (parameter or buffer), whether it needs a gradient and whether the model writes it. Any
other module is compared by :func:`planner.execute.selective.structure_key` (class, settings, parameter and input
layouts), and only when everything its forward may read is plain data: a module holding another object (a
callable, a config, an unregistered tensor), or with hooks, gets no key, and so does a stage that is no module.
Both add the layouts of the stage's inputs (shape, strides, dtype, device, storage size and offset, whether
they need gradients) and which of the tensors a stage sees share a storage, since the profiler counts a saved
tensor on a storage it holds anyway as free. Values are not compared: a graph whose sizes the capture left
symbolic gets no key, and a shared stage whose output differs in size from its twin's is measured after all;
but a module's own Python that sizes a temporary by value (routing tokens to experts) is not seen: profile
such stages with ``share_identical=False``. Times are measured once too (the blocks' own noise goes).
"""

import torch
from torch.fx.node import map_arg
from torch.utils._pytree import tree_flatten

from planner.execute.selective import structure_key

_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout)


def stage_key(module, activation, extra: tuple, resident: list, first: bool):
    """A hashable key for stage ``module`` called ``module(activation, *extra)`` with ``resident`` (the chain's
    inputs) held, or None when it cannot be told identical to another stage; ``first``: the chain's first
    stage (whose input needs no gradient unless it requires one)."""
    if not isinstance(module, torch.nn.Module) or _hooked(module):
        return None
    inputs = [activation, *extra]
    leaves, spec = tree_flatten(inputs)
    if not all(isinstance(leaf, torch.Tensor) or _plain(leaf) for leaf in leaves):
        return None
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    if isinstance(module, torch.fx.GraphModule):
        body, attributes = _graph_structure(module)
    else:
        body, attributes = _module_structure(module, inputs), list(module.parameters()) + list(module.buffers())
    if body is None:
        return None
    layouts = tuple(_layout(t) if isinstance(t, torch.Tensor) else ("value", repr(t)) for t in leaves)
    return (first, str(spec), layouts, _sharing(list(resident) + tensors + attributes), body)


def _hooked(module) -> bool:
    """Whether ``module`` or a submodule has hooks (which may do anything the key does not see)."""
    return any(sub._forward_hooks or sub._forward_pre_hooks or sub._backward_hooks or sub._backward_pre_hooks
               for sub in module.modules())


def _plain(value) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_plain(item) for item in value)
    return isinstance(value, _PLAIN)


def _layout(tensor) -> tuple:
    """What of a tensor the figures may depend on: not its values."""
    return (type(tensor).__name__, tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype, tensor.device.type,
            tensor.storage_offset(), tensor.untyped_storage().nbytes(), tensor.requires_grad,
            isinstance(tensor, torch.nn.Parameter))


def _sharing(tensors) -> tuple:
    """For each tensor, the position of the first one on the same storage (its own when none before)."""
    first = {}
    return tuple(first.setdefault(t.untyped_storage()._cdata, k) for k, t in enumerate(tensors))


def _graph_structure(module) -> tuple:
    """``(rows, attribute tensors)``: the graph of a graph module without names, or ``(None, [])`` when a node
    is of a kind the key cannot compare (a call of a submodule, an attribute that is no tensor)."""
    written = {id(getattr(owner, field)) for owner, field in getattr(module, "memsched_written_buffers", ())}
    position, attributes, rows = {}, [], []
    for node in module.graph.nodes:
        position[node] = len(position)
        if node.op == "get_attr":
            value = _attribute(module, node.target)
            if not isinstance(value, torch.Tensor):
                return None, []
            attributes.append(value)
            target = ("tensor", _layout(value), id(value) in written)
        elif node.op in ("call_function", "call_method"):
            target = node.target  # the function itself (an ATen operation, operator.getitem) or a method's name
        elif node.op in ("placeholder", "output"):
            target = node.op
        else:
            return None, []
        arguments = map_arg((node.args, node.kwargs), lambda n: _Position(position[n]))
        text = repr(arguments)
        if " at 0x" in text:  # an object compared by identity: not comparable by value
            return None, []
        layout = _value_layout(node.meta.get("val"))
        if layout is None:  # a size the capture left symbolic: it may depend on values
            return None, []
        rows.append((node.op, target, text, layout))
    return (module.training, tuple(rows)), attributes


class _Position(int):
    """A node's position among the graph's nodes, written as such in a row."""

    def __repr__(self):
        return f"%{int(self)}"


def _value_layout(value):
    """The layout of a node's value as the capture recorded it (fake tensors: shapes, strides, dtypes), or None
    when a size or a number in it is symbolic."""
    leaves = tree_flatten(value)[0] if isinstance(value, (tuple, list)) else [value]
    layout = tuple((tuple(v.shape), tuple(v.stride()), v.dtype) if isinstance(v, torch.Tensor) else v
                   for v in leaves)
    numbers = tree_flatten(list(layout))[0]
    if any(isinstance(n, (torch.SymInt, torch.SymFloat, torch.SymBool)) for n in numbers):
        return None
    return repr(layout)


def _module_structure(module, inputs):
    """:func:`structure_key` of a module and every setting of its submodules, when they hold nothing but plain
    data (numbers, strings, tuples and lists of them), parameters, buffers and submodules; else None."""
    settings = []
    for sub_name, sub in module.named_modules():
        for name, value in sorted(vars(sub).items()):
            if name.startswith("_"):
                continue
            if not _plain(value):
                return None
            settings.append((sub_name, name, repr(value)))
    return structure_key(module, inputs), tuple(settings)


def _attribute(root, dotted: str):
    for part in dotted.split("."):
        root = getattr(root, part)
    return root
