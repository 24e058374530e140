"""Cuts whose value no backward keeps: where discovery should not cut.

The chain model holds a stage's input ``a_k`` from the forward that makes it to the backward ``B k``
(planner/simulate/chain.py): the backward of stage ``k`` may read it. When neither stage ``k``'s backward nor
stage ``k-1``'s keeps it (its weights frozen, a LoRA model's base layers do not save the inputs of their matrix
products; rotary embeddings save their tables, not the queries), the executor lets it go once ``F_all k`` has
read it, and the model counts bytes that no longer exist: a peft LoRA Llama measured 0.96 of its prediction.
Merged into one stage, such a value is an inner one, which its stage's own figures count as they are.

:func:`loose_cuts` finds them by running the stages once with autograd on fake copies (nothing allocated), each
pack of a saved tensor noted by its storage.
"""

import contextlib

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    UnsupportedOperatorException,
)
from torch.utils._pytree import tree_flatten, tree_map

from profiles.fake_build import faked_in_place
from profiles.identical import stage_key


def loose_cuts(stages, inputs) -> list:
    """The indices ``k >= 1`` of ``stages`` (``[(name, module), ...]``, called ``stage_k(a_k, *extra)``) whose
    input ``a_k`` — every tensor of it — neither stage ``k``'s backward nor stage ``k-1``'s keeps, on ``inputs``
    (``(a_0, *extra)``, real or fake tensors; real ones are copied as fake ones, and so are the stages'
    parameters, theirs back afterwards). Stages that fake tensors cannot run (an output sized by the values:
    ``nonzero``) are taken as they are: none."""
    modules = [module for _, module in stages if isinstance(module, torch.nn.Module)]
    fake = next((t for t in _tensors(inputs) if isinstance(t, FakeTensor)), None)
    faking = contextlib.nullcontext(inputs) if fake is not None else faked_in_place(modules, inputs)
    with faking as fakes:
        mode = fake.fake_mode if fake is not None else _mode_of(fakes)
        try:
            with mode, torch.enable_grad():
                return _walk(stages, fakes)
        except (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException):
            return []  # a stage sized by its values (experts routed by nonzero): its cuts are kept as found


def _walk(stages, inputs) -> list:
    """:func:`loose_cuts` on fake ``inputs``; a stage identical to an earlier one (:func:`profiles.identical.
    stage_key`: a transformer's blocks) is not run again, its twin's output and packs taken."""
    first, extra = inputs[0], inputs[1:]
    resident, seen = _tensors(inputs), {}
    loose, activation, kept_before = [], first, set()
    for k, (_, module) in enumerate(stages):
        read = {t.untyped_storage()._cdata for t in _tensors(activation) if t.is_floating_point()}
        key = stage_key(module, activation, extra, resident, k == 0)
        if key is None or key not in seen:
            leaf = _fresh(activation, k > 0 or any(t.requires_grad for t in _tensors(activation)))
            packed = set()

            def pack(tensor, packed=packed):
                packed.add(tensor.untyped_storage()._cdata)
                return tensor

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                output = module(leaf, *extra)
            keeps_input = bool({t.untyped_storage()._cdata for t in _tensors(leaf)} & packed)
            output = tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, output)
            if key is not None:
                seen[key] = output, packed, keeps_input
        else:
            output, packed, keeps_input = seen[key]
        if k > 0 and read and not keeps_input and not read & kept_before:
            loose.append(k)
        kept_before, activation = packed, output
    return loose


def _fresh(activation, needs_grad):
    """A detached view of ``activation``, its floating tensors needing gradients when the stage's input does (as
    the chain profiler makes a stage's input)."""
    return tree_map(lambda t: t.detach().requires_grad_(needs_grad and t.is_floating_point())
                    if isinstance(t, torch.Tensor) else t, activation)


def _tensors(tree) -> list:
    return [leaf for leaf in tree_flatten(tree)[0] if isinstance(leaf, torch.Tensor)]


def _mode_of(fakes):
    return next(t.fake_mode for t in _tensors(fakes) if isinstance(t, FakeTensor))
