"""What every executor does as autograd and a plain step would: gradients, random numbers, autocast, statistics.

:func:`accumulate_grads` adds gradients into ``.grad`` as AccumulateGrad does, and :class:`TiedGradients` sums a
tied parameter's contributions before adding them, in autograd's order; :func:`differentiate` runs
``autograd.grad`` from gradient edges, autograd owning (and freeing) the incoming gradients; :func:`rng_state` /
:func:`set_rng_state` capture and replay the CPU and CUDA generators; :func:`autocast_state` /
:func:`autocast_as` capture and restore the autocast state; :func:`running_statistics_kept` keeps a recomputed
forward from updating normalisation statistics again; :func:`fresh_leaf`, :func:`detached` and
:func:`any_requires_grad` act on trees of tensors (docs/execution.md, "Chain executor").
"""

import contextlib

import torch
from torch.utils._pytree import tree_flatten, tree_map


def accumulate_grads(parameters, grads: list) -> None:
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


class TiedGradients:
    """A parameter several stages read (tied weights), its gradient added into a ``.grad`` already there in
    autograd's order: ``G + (a + b)``, not ``(G + a) + b``.

    Autograd sums the contributions a parameter's uses send its AccumulateGrad node, then adds that sum into
    ``.grad``. The executor differentiates stage by stage, so each stage's contribution would reach ``.grad`` on
    its own, which rounds differently once ``.grad`` holds earlier micro-batches' gradients. So, for one step:
    before the first backward reaching such a parameter, :meth:`before_backward` sets its ``.grad`` (``G``) aside;
    the stages then add into an empty ``.grad`` as usual (``a``, then ``a + b``), and once the backward of the
    first stage reading it (the last to run) has, :meth:`after_backward` adds that sum into ``G`` in place and
    makes ``G`` the ``.grad`` again. The sum is held from the owner's backward to the first reader's, as
    autograd's input buffer holds it (planner/accumulate.py counts it). ``first_readers``: ``{id(parameter):
    the lowest stage reading it}`` for the shared parameters.
    """

    def __init__(self, first_readers: dict):
        self.first_readers = first_readers
        self.set_aside = {}  # id(parameter) -> (parameter, its .grad before the step)

    def before_backward(self, stages, parameters) -> None:
        """Before the backward of ``stages`` (a graph's, ascending) reaches ``parameters``."""
        for parameter in parameters:
            key = id(parameter)
            first = self.first_readers.get(key)
            if (first is not None and first not in stages and parameter.grad is not None
                    and key not in self.set_aside):
                self.set_aside[key] = (parameter, parameter.grad)
                parameter.grad = None

    def after_backward(self, stages) -> None:
        """After the backward of ``stages`` added its gradients into ``.grad``."""
        for key in [key for key in self.set_aside if self.first_readers[key] in stages]:
            parameter, earlier = self.set_aside.pop(key)
            if parameter.grad is not None:
                earlier.add_(parameter.grad)
            parameter.grad = earlier

    def put_back(self) -> None:
        """A failed step: each ``.grad`` set aside is the ``.grad`` again (this step's sums dropped)."""
        for parameter, earlier in self.set_aside.values():
            parameter.grad = earlier
        self.set_aside.clear()


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


def differentiate(pairs, inputs, accumulate: bool = False) -> list:
    """Gradients of ``inputs`` from ``[(gradient edge, incoming gradient), ...]``, autograd owning the gradients;
    with ``accumulate``, added into the inputs' ``.grad`` by autograd itself (its hooks see them: FSDP2's
    post-backward reduces them) and None returned.

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
        if accumulate:
            torch.autograd.backward(edges, placeholders, inputs=inputs)
            return None
        return list(torch.autograd.grad(edges, inputs, placeholders, allow_unused=True))
    finally:
        for handle in handles:
            handle.remove()


def rng_state() -> tuple:
    """``(CPU generator state, CUDA generator state or None)``, as ``torch.utils.checkpoint`` records them."""
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def set_rng_state(state) -> None:
    """Put back generator states from :func:`rng_state`."""
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)


def rng_devices() -> list:
    """The CUDA devices ``torch.random.fork_rng`` must fork for a replay: the current one once CUDA is in use."""
    return [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []


def autocast_state() -> dict:
    """``{device type: (enabled, dtype)}`` of autocast now, for :func:`autocast_as`."""
    return {device: (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
            for device in ("cpu", "cuda") if device == "cpu" or torch.cuda.is_available()}


@contextlib.contextmanager
def autocast_as(state):
    """Run under the autocast state :func:`autocast_state` recorded."""
    with contextlib.ExitStack() as stack:
        for device, (enabled, dtype) in state.items():
            stack.enter_context(torch.autocast(device_type=device, dtype=dtype, enabled=enabled))
        yield


def running_statistics_kept(module):
    """Run with throw-away copies of the running statistics of normalisation layers in training mode, and of
    the buffers a module lists as ``memsched_written_buffers`` (``(owner module, buffer name)`` pairs its forward
    writes in place: the stages :mod:`profiles.discover` makes, whose BatchNorm is an op, not a layer).

    A recomputed forward must not update them a second time; copying the originals back afterwards would
    bump their version counters, which autograd checks, so the originals are swapped out instead.
    """
    return swapped_in(spare_statistics(module))


def spare_statistics(module) -> list:
    """``[(owner, {name: copy})]``: copies, made now, of the buffers :func:`running_statistics_kept` swaps out."""
    spare = []
    for owner, names in _written_buffers(module):
        spare.append((owner, {name: owner._buffers[name].clone() for name in names
                              if owner._buffers.get(name) is not None}))
    return spare


@contextlib.contextmanager
def swapped_in(spare):
    """Run with the copies of :func:`spare_statistics` in place of the originals, put back afterwards."""
    originals = [(owner, {name: owner._buffers[name] for name in copies}) for owner, copies in spare]
    for owner, copies in spare:
        owner._buffers.update(copies)
    try:
        yield
    finally:
        for owner, buffers in originals:
            owner._buffers.update(buffers)


def _written_buffers(module) -> list:
    """``[(owner, buffer names)]`` that a forward of ``module`` updates (see :func:`running_statistics_kept`)."""
    if not isinstance(module, torch.nn.Module):
        return []
    found = [(layer, ("running_mean", "running_var", "num_batches_tracked")) for layer in module.modules()
             if isinstance(layer, torch.nn.modules.batchnorm._NormBase) and layer.training
             and layer.track_running_stats]
    return found + [(owner, (name,)) for part in module.modules()  # a part of merged stages lists its own
                    for owner, name in getattr(part, "memsched_written_buffers", ())]


def writes_statistics(module) -> bool:
    """Whether a forward of ``module`` updates buffers (running statistics) in place: what a recomputation of
    it must not do again (:func:`running_statistics_kept`)."""
    return bool(_written_buffers(module))


def detached(tree):
    """``tree`` with every tensor detached (same storage)."""
    return tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, tree)


def fresh_leaf(tree, requires_grad: bool):
    """``tree`` with every tensor a new leaf on the same storage, requiring gradients when ``requires_grad`` and
    floating point."""
    return tree_map(lambda t: t.detach().requires_grad_(requires_grad and t.is_floating_point())
                    if isinstance(t, torch.Tensor) else t, tree)


def any_requires_grad(tree) -> bool:
    """Whether any tensor of ``tree`` requires gradients."""
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_flatten(tree)[0])
