"""Mixed precision for :func:`profiles.fit.fit`: the autocast state a model is planned, profiled and run under.

Autocast is a dispatcher state, not a part of the model: run under ``torch.autocast``, an op of its
lower-precision list (matmul, linear, convolution, attention) casts its inputs, and the cast of a parameter is
kept in autocast's cache until the outermost autocast region exits. A step planned without autocast and run under
it would compute other values and hold other bytes, and a graph captured without autocast refuses it outright
(its ``_assert_tensor_metadata`` nodes: "Tensor dtype mismatch").

So the step is captured under the autocast state it will train with (:meth:`Precision.capturing`): the
training IR ``torch.export`` makes is taken down to ATen operations under that state
(:func:`with_autocast_casts`), which writes every cast autocast makes into the graph as an explicit
``_to_copy``. The stages then compute in that precision whatever the caller's state, and a parameter's cast is
an ordinary value of the stage that reads it: saved for its backward (``F_all``), or made and dropped
(``F_ck``, ``F_none``, a recomputation), measured by the profiler as any other, so the chain model counts it
exactly. Autocast's cache stays empty at the call: each op a stage runs gets inputs already in its precision,
and autocast caches only the casts it makes itself. The profiler runs the captured stages with autocast off
(:meth:`Precision.profiling`), as the user's backward runs.

``aten.dropout`` is the one op whose ATen form differed from eager (measured on GPT-2): torch's decomposition
makes it ``native_dropout`` (mask and scale), where eager CPU multiplies by a noise tensor divided by ``1 - p``;
the gradients then differ in the last bit. :func:`with_autocast_casts` decomposes it as eager CPU runs it.

Taking the program down also makes a training BatchNorm functional: ``_native_batch_norm_legit_functional``
returns the new running statistics, and ``copy_`` nodes at the graph's end write them into the buffers. Those
writes modify tensors the normalisation's backward saved (its running statistics), so that the backward refused
to run ("modified by an inplace operation"), and the new statistics, computed from the activations, were live to
the graph's end, so that no stage could end between two normalisations. :func:`eager_batch_norm` puts back the
in-place form eager runs (``_native_batch_norm_legit``: the same kernel, the statistics updated by the
normalisation itself, the same tensors saved).
"""

import contextlib
import operator
from dataclasses import dataclass, field, replace

import torch

from planner.errors import MemschedError
from profiles.cuda_autocast import cuda_autocast

AUTOCAST_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True)
class Precision:
    """An autocast state: ``dtype`` (``torch.bfloat16`` or ``torch.float16``) on ``device_type``, or none;
    ``cuda_lists``: captured with CUDA's op lists on this CPU, for a CUDA target (profiles/cuda_autocast.py; the
    state a fitted model is called under is the same either way)."""

    device_type: str
    dtype: torch.dtype = None
    cuda_lists: bool = field(default=False, compare=False)

    def __str__(self) -> str:
        if self.dtype is None:
            return "no autocast"
        lists = " with CUDA's op lists" if self.cuda_lists and self.device_type != "cuda" else ""
        return f"{AUTOCAST_DTYPES[self.dtype]} autocast on {self.device_type}{lists}"

    def for_target(self, device_spec) -> "Precision":
        """This state for an estimate on ``device_spec`` (a :class:`planner.devices.DeviceSpec`, or None: this
        device): a CUDA target's autocast casts by CUDA's op lists."""
        cuda = device_spec is not None and device_spec.allocator == "cuda" and self.dtype is not None
        return replace(self, cuda_lists=cuda)

    @contextlib.contextmanager
    def capturing(self):
        """This state exactly, whatever the caller's (an ambient autocast of another dtype or none set aside)."""
        if self.dtype is None:
            with torch.autocast(self.device_type, enabled=False):
                yield
            return
        with torch.autocast(self.device_type, dtype=self.dtype), \
                cuda_autocast() if self.cuda_lists else contextlib.nullcontext():
            yield

    def profiling(self):
        """Autocast off: captured stages hold their casts, and a backward runs outside autocast."""
        return torch.autocast(self.device_type, enabled=False)

    def check_call(self, name: str) -> None:
        """A one-line :class:`MemschedError` unless the caller runs under this state."""
        now = current(self.device_type)
        if now != self:
            raise MemschedError(f"{name}: called under {now}, but it was fitted under {self}: call it under the "
                                f"autocast it was fitted for, or fit again (fit(..., autocast=...))")


def current(device_type: str) -> Precision:
    """The autocast state active now on ``device_type``."""
    if not torch.is_autocast_enabled(device_type):
        return Precision(device_type)
    return Precision(device_type, torch.get_autocast_dtype(device_type))


def planned(autocast, model: torch.nn.Module, name: str) -> Precision:
    """The state ``fit(..., autocast=...)`` plans for: ``None``, the one active at the call (on the model's
    device); ``False``, none; ``torch.bfloat16`` or ``torch.float16``, that dtype's autocast."""
    device_type = next((p.device.type for p in model.parameters()), "cpu")
    if isinstance(autocast, str):
        autocast = named_dtype(autocast, f"{name}: fit autocast")
    if autocast is None:
        return current(device_type)
    if autocast is False:
        return Precision(device_type)
    if autocast not in AUTOCAST_DTYPES:
        raise MemschedError(f"{name}: fit autocast must be torch.bfloat16, torch.float16, False (none) or None (the "
                            f"autocast state active at fit), got {autocast!r}")
    return Precision(device_type, autocast)


def named_dtype(name: str, where: str) -> torch.dtype:
    """The autocast dtype ``bf16`` or ``fp16`` (or ``bfloat16``, ``float16``) names; a one-line error otherwise."""
    dtypes = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
    if name not in dtypes:
        raise MemschedError(f"{where} must be bf16 or fp16 (autocast's lower precision), got {name!r}")
    return dtypes[name]


def with_autocast_casts(program, device_type: str):
    """``program`` (a ``torch.export`` training IR) taken down to ATen operations under the autocast state
    active on ``device_type``, its casts explicit; unchanged when none is."""
    if not torch.is_autocast_enabled(device_type):
        return program
    with _eager_dropout() if device_type == "cpu" else contextlib.nullcontext():  # CUDA's eager is native_dropout
        return program.run_decompositions({})


def eager_batch_norm(graph_module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``graph_module`` with each functional training normalisation whose new running statistics only ``copy_``
    nodes write back into the statistics it read made the in-place one eager runs (module docstring), and each
    ``copy_(counter, counter + 1)`` of a counter nothing else reads (BatchNorm's ``num_batches_tracked``) made the
    in-place ``add_`` where the ``+ 1`` was; changed in place and returned."""
    functional, in_place = (torch.ops.aten._native_batch_norm_legit_functional.default,
                            torch.ops.aten._native_batch_norm_legit.default)
    graph = graph_module.graph
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target is functional]:
        items = {user.args[1]: user for user in node.users if user.target is operator.getitem}
        writes = [_write_back(items.get(k), node.args[k]) for k in (3, 4)]
        if len(items) != len(node.users) or None in writes:
            continue
        for write, item in zip(writes, (items[3], items[4])):
            graph.erase_node(write)
            graph.erase_node(item)
        node.target = in_place
    for write in [n for n in graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.copy_.default]:
        counter, value = write.args  # num_batches_tracked += 1, written back at the end: in place where it was
        if (value.target is torch.ops.aten.add.Tensor and value.args == (counter, 1) and len(value.users) == 1
                and set(counter.users) == {value, write} and not write.users):
            value.target = torch.ops.aten.add_.Tensor
            graph.erase_node(write)
    graph_module.recompile()
    return graph_module


def _write_back(item, statistics):
    """The ``copy_(statistics, item)`` node that alone uses ``item`` (a new running statistic), or None."""
    if item is None or len(item.users) != 1:
        return None
    (user,) = item.users
    is_write = user.target is torch.ops.aten.copy_.default and user.args == (statistics, item) and not user.users
    return user if is_write else None


def _dropout(input, p, train):
    """``aten.dropout`` as eager runs it on CPU (``_dropout_impl``): the input times a Bernoulli noise tensor
    divided by ``1 - p``; the input itself when nothing is dropped."""
    if not train or p == 0 or input.numel() == 0:
        return input
    if p == 1:
        return input * torch.zeros((), dtype=input.dtype, device=input.device)
    noise = torch.empty_like(input).bernoulli_(1 - p)
    noise.div_(1 - p)
    return input * noise


@contextlib.contextmanager
def _eager_dropout():
    """``aten.dropout`` decomposed by :func:`_dropout` while in the context (torch's Python kernels put back)."""
    op = torch.ops.aten.dropout.default
    saved = dict(op.py_kernels)
    for key in (torch._C.DispatchKey.CompositeImplicitAutograd, torch._C.DispatchKey.Autograd):
        if key in op.py_kernels:
            op.py_kernels[key] = _dropout
    op._dispatch_cache.clear()
    try:
        yield
    finally:
        op.py_kernels.clear()
        op.py_kernels.update(saved)
        op._dispatch_cache.clear()
