"""A model built on fake tensors: its sizes exact, nothing allocated (for estimated profiles, docs/execution.md)."""

import contextlib
import dataclasses

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode
from torch.utils._pytree import tree_map

from planner.execute.stages import StagedModel


def build_fake(factory):
    """``(mode, factory())`` with the model's parameters and buffers and the tensor inputs fake tensors of one
    fresh ``FakeTensorMode``, ``mode``.

    ``factory()`` is called under that mode, so that nothing is allocated; but
    fake tensors have no values, so an initialisation that reads the values it
    draws fails there (``torch.nn.init.trunc_normal_`` loops until every value
    lies within its bounds: every ViT and ConvNeXt). Such a factory is called
    again for real, its parameters allocated but no activation, and then
    :func:`fake_copies` replaces its tensors by fake ones. Nor can a module's
    fake parameters be converted (``model.to(torch.bfloat16)``, the common way
    to build a model in bf16: the mode keeps a weak reference to each fake
    tensor, so ``nn.Module._apply`` cannot swap it): such a factory is called
    under the meta device instead, where nothing is allocated either, and its
    tensors made fake CPU tensors of the same sizes, strides and dtypes.
    Tensors the loss closes over (targets) stay real: the mode takes them as
    constants.
    """
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        with mode:
            return mode, factory()
    except (DataDependentOutputException, DynamicOutputShapeException):
        pass
    except RuntimeError as error:
        if not _converts_fake_parameters(error):
            raise
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with torch.device("meta"):
            return mode, fake_copies(mode, factory())
    mode = FakeTensorMode(allow_non_fake_inputs=True)  # not the one the failed build left fake tensors in
    return mode, fake_copies(mode, factory())


def _converts_fake_parameters(error: RuntimeError) -> bool:
    """Whether ``error`` is ``nn.Module._apply`` failing to swap a fake parameter for its converted copy."""
    return str(error).startswith("_apply(): Couldn't swap")


def fake_copies(mode, built):
    """``built`` (a :class:`planner.execute.stages.StagedModel`, or ``(stages, example_inputs[, loss_fn])``) with the
    parameters and buffers of its stages replaced in place by fake tensors of ``mode`` of the same shape,
    strides, dtype, device and ``requires_grad`` (a parameter shared by two modules stays one), and its tensor
    inputs by fake copies; anything else is left as it is for the profiler to judge."""
    if isinstance(built, StagedModel):
        _fake_modules(mode, [module for _, module in built.stages])
        return dataclasses.replace(built, example_inputs=_fake_tree(mode, built.example_inputs))
    if not isinstance(built, tuple) or len(built) not in (2, 3):
        return built
    stages = built[0]
    if isinstance(stages, torch.nn.Module):
        modules = [stages]
    else:
        modules = list(stages.values()) if isinstance(stages, dict) else list(stages) if isinstance(
            stages, (list, tuple)) else []
        modules = [item[1] if isinstance(item, tuple) and len(item) == 2 else item for item in modules]
    _fake_modules(mode, [module for module in modules if isinstance(module, torch.nn.Module)])
    return (stages, _fake_tree(mode, built[1]), *built[2:])


@contextlib.contextmanager
def faked_in_place(modules, inputs, adopters: list = None):
    """Within the block, the parameters and buffers of the live ``modules`` are fake copies in one fresh
    ``FakeTensorMode`` (shared ones stay shared), and it yields fake copies of ``inputs``; afterwards every module
    has its own tensors back, untouched: a live model estimated without copying its data. ``adopters``: a list the
    block fills with modules made from the faked ones that refer to their tensors (the stages a capture cut):
    afterwards those refer to the real tensors, so that they run on the model's own."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    replaced = _fake_modules(mode, modules)
    try:
        yield _fake_tree(mode, inputs)
    finally:
        real = {id(table[name]): (table[name], tensor) for table, name, tensor in replaced}  # (the fake held)
        for table, name, tensor in replaced:
            table[name] = tensor
        for module in adopters or ():
            for sub in module.modules():
                for table in (sub._parameters, sub._buffers):
                    for name, tensor in table.items():
                        if tensor is not None and id(tensor) in real:
                            table[name] = real[id(tensor)][1]


def _fake_modules(mode, modules) -> list:
    """Each parameter and buffer of ``modules`` (and their submodules) replaced by its fake copy in ``mode``;
    ``[(table, name, the real tensor), ...]`` of what was replaced."""
    copies, fakes, replaced = {}, set(), []  # id(real tensor) -> (real, fake): the real one held, its id not reused

    def fake(tensor):
        if id(tensor) not in copies:
            copies[id(tensor)] = (tensor, _fake_of(mode, tensor))  # a Parameter's copy is a Parameter
            fakes.add(id(copies[id(tensor)][1]))
        return copies[id(tensor)][1]

    for module in modules:
        for sub in module.modules():
            for table in (sub._parameters, sub._buffers):
                for name, tensor in table.items():
                    if tensor is not None and id(tensor) not in fakes:  # (a submodule reached twice: faked once)
                        replaced.append((table, name, tensor))
                        table[name] = fake(tensor)
    return replaced


def _fake_tree(mode, tree):
    return tree_map(lambda t: _fake_of(mode, t) if isinstance(t, torch.Tensor) else t, tree)


def _fake_of(mode, tensor):
    """A fake copy of ``tensor`` in ``mode``; a meta tensor's (:func:`build_fake`) on the CPU."""
    if not tensor.is_meta:
        return mode.from_tensor(tensor)
    with mode:
        fake = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="cpu")
    if isinstance(tensor, torch.nn.Parameter):
        return torch.nn.Parameter(fake, requires_grad=tensor.requires_grad)
    return fake.requires_grad_(tensor.requires_grad)
