"""Seconds of code from a roofline per operation: each aten operation takes the larger of its FLOPs over the peak
FLOP/s (the 16-bit peak for an operation whose inputs are bf16 or fp16) and its bytes over the memory bandwidth,
plus a fixed cost (:class:`planner.rates.Rates`).

:class:`RooflineMode` is a ``TorchDispatchMode``; it runs under the ``FakeTensorMode`` an estimate runs in (nothing
is allocated) as on real tensors. FLOPs are ``torch.utils.flop_counter``'s registered formulas, applied as
``FlopCounterMode`` applies them (an operation without a formula is decomposed when it can be); CPU's fused
attention, which that registry lacks, gets the registry's own attention formulas. Bytes are what an operation reads
and writes: every tensor argument read once, every output written (an in-place operation writes its argument);
a view (an output aliasing an input, nothing written) costs nothing, not even the fixed cost; ``empty`` writes
nothing; a lookup (``embedding``, ``index_select``, ``gather``, ``index``) reads at most its output's bytes of its
source. A tensor's bytes are its elements', at most its storage's (an expanded tensor reads its storage once);
a sparse one's, its indices' and values'.
"""

from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop, sdpa_flop

from planner.rates import Rates

aten = torch.ops.aten

FLOP_FORMULAS = {
    **flop_registry,
    aten._scaled_dot_product_flash_attention_for_cpu: sdpa_flop,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: sdpa_backward_flop,
}
NO_WRITE = {aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty, aten.new_empty_strided}
LOOKUPS = {aten.embedding, aten.index_select, aten.gather, aten.index}  # their first argument: read in part


class Tally(NamedTuple):
    """What a piece of code did under :class:`RooflineMode`: FLOPs, bytes moved, operations timed, and seconds."""

    flops: int
    bytes_moved: int
    ops: int
    seconds: float


class RooflineMode(TorchDispatchMode):
    """Adds up, per aten operation run inside it, FLOPs, bytes moved and the seconds ``rates`` give them."""

    def __init__(self, rates: Rates):
        super().__init__()
        self.rates = rates
        self.flops = self.bytes_moved = self.ops = 0
        self.seconds = 0.0

    def tally(self) -> Tally:
        return Tally(self.flops, self.bytes_moved, self.ops, self.seconds)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func._overloadpacket
        if packet not in FLOP_FORMULAS and func is not torch.ops.prim.device.default:
            with self:  # as FlopCounterMode: a composite operation counts as its parts
                result = func.decompose(*args, **kwargs)
            if result is not NotImplemented:
                return result
        out = func(*args, **kwargs)
        flops = FLOP_FORMULAS[packet](*args, **kwargs, out_val=out) if packet in FLOP_FORMULAS else 0
        moved = operation_bytes(func, args, kwargs, out)
        if flops or moved is not None:
            moved = moved or 0
            self.flops += flops
            self.bytes_moved += moved
            self.ops += 1
            self.seconds += self.rates.seconds(flops, moved, _low_precision(args))
        return out


def roofline(work, rates: Rates) -> Tally:
    """Run ``work()`` under a :class:`RooflineMode` of ``rates``; return its :class:`Tally`."""
    with RooflineMode(rates) as mode:
        work()
    return mode.tally()


def operation_bytes(func, args, kwargs, out):
    """Bytes ``func`` reads and writes (see the module's docstring), or None when it neither computes nor moves
    data (a view, a query of sizes)."""
    schema = func._schema
    written = [value for argument, value in _arguments(schema, args, kwargs)
               if argument.alias_info is not None and argument.alias_info.is_write]
    outputs = out if isinstance(out, (tuple, list)) else (out,)
    written += [value for ret, value in zip(schema.returns, outputs) if ret.alias_info is None]
    written = _tensors(written)
    if not written:
        return None
    packet = func._overloadpacket
    if packet in NO_WRITE:
        return 0
    read = _tensors([args, kwargs])
    write_bytes = sum(tensor_bytes(t) for t in written)
    read_bytes = sum(tensor_bytes(t) for t in read)
    if packet in LOOKUPS and read and read[0] is _first_tensor(args):
        read_bytes -= tensor_bytes(read[0]) - min(tensor_bytes(read[0]), write_bytes)
    return read_bytes + write_bytes


def tensor_bytes(tensor) -> int:
    """Bytes of ``tensor``'s elements, at most those of its storage; a sparse (COO) tensor's indices and values;
    another layout's elements as if dense (it has no one storage)."""
    if tensor.layout == torch.sparse_coo:
        return tensor_bytes(tensor._indices()) + tensor_bytes(tensor._values())
    elements = tensor.numel() * tensor.element_size()
    return min(elements, tensor.untyped_storage().nbytes()) if tensor.layout == torch.strided else elements


def _arguments(schema, args, kwargs):
    """``(schema argument, value)`` for the arguments given."""
    for position, argument in enumerate(schema.arguments):
        if argument.kwarg_only:
            if argument.name in kwargs:
                yield argument, kwargs[argument.name]
        elif position < len(args):
            yield argument, args[position]
        elif argument.name in kwargs:
            yield argument, kwargs[argument.name]


def _tensors(tree) -> list:
    """The tensors in ``tree``, each once (by identity)."""
    seen, tensors = set(), []
    for leaf in tree_flatten(tree)[0]:
        if isinstance(leaf, torch.Tensor) and id(leaf) not in seen:
            seen.add(id(leaf))
            tensors.append(leaf)
    return tensors


def _low_precision(args) -> bool:
    """Whether an operation computes in 16 bits: its first floating-point tensor argument is bf16 or fp16."""
    first = next((a for a in tree_flatten(args)[0] if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
    return first is not None and first.dtype in (torch.bfloat16, torch.float16)


def _first_tensor(args):
    return next((a for a in args if isinstance(a, torch.Tensor)), None)
