"""What the chain records about a model, read from live modules and tensors: the shapes and dtypes it was
measured on (planner/measured_on.py), the parameters several stages share (planner/shared.py) and each stage's
parameters as sharding cuts them (planner/layout.py)."""

import torch
from torch.utils._pytree import keystr, tree_flatten_with_path

from planner.layout import ParameterRows
from planner.measured_on import MeasuredOn, TensorSpec
from planner.shared import SharedParameter


def measured_on(pairs, inputs) -> MeasuredOn:
    """What ``pairs`` (``[(name, module), ...]``) run on ``inputs`` (the tuple ``(a_0, *extra)``) are."""
    return MeasuredOn(inputs=input_specs(inputs), stages=tuple(parameter_specs(module) for _, module in pairs))


def input_specs(inputs) -> tuple:
    """``((label, TensorSpec), ...)`` for the tensors of ``inputs``: ``0``, ``1``..., ``0['ids']`` inside a dict."""
    leaves, _ = tree_flatten_with_path(tuple(inputs))
    return tuple((f"{path[0].idx}{keystr(path[1:])}", TensorSpec.of(leaf)) for path, leaf in leaves
                 if isinstance(leaf, torch.Tensor))


def parameter_specs(module) -> tuple:
    """``((name, TensorSpec), ...)`` for the parameters of a stage (none for a plain function)."""
    if not isinstance(module, torch.nn.Module):
        return ()
    return tuple((name, TensorSpec.of(parameter)) for name, parameter in module.named_parameters())


def stage_specs(pairs) -> list:
    """``[(name, parameter specs), ...]`` of the live stages ``[(name, module), ...]``, for
    :meth:`MeasuredOn.check_stages`."""
    return [(name, parameter_specs(module)) for name, module in pairs]


def parameter_layout(pairs) -> tuple:
    """Per stage of ``[(name, module), ...]``, a :class:`planner.layout.ParameterRows` for each parameter its module
    holds that no earlier stage holds, in the module's order: its rows along dimension 0 (1 for a scalar), the
    bytes of one row, whether it is trainable, frozen or shared by several stages, and its element's bytes."""
    shared, seen, layout = {id(p) for _, p in find_shared(pairs)}, set(), []
    for _, module in pairs:
        rows = []
        for parameter in module.parameters() if isinstance(module, torch.nn.Module) else ():
            if id(parameter) in seen:
                continue
            seen.add(id(parameter))
            count = parameter.shape[0] if parameter.dim() else 1
            kind = "shared" if id(parameter) in shared else "trainable" if parameter.requires_grad else "frozen"
            rows.append(ParameterRows(count, parameter.numel() // max(count, 1) * parameter.element_size(), kind,
                                      parameter.element_size()))
        layout.append(tuple(rows))
    return tuple(layout)


def shared_parameters(pairs) -> tuple:
    """The parameters (needing gradients) that several of the live stages ``[(name, module), ...]`` read, in the
    order of their first stage, each named ``stage.parameter`` at its first stage."""
    return tuple(entry for entry, _ in find_shared(pairs))


def find_shared(pairs) -> list:
    """``[(SharedParameter, the parameter), ...]`` for :func:`shared_parameters`."""
    found = {}  # id -> (name, stages, parameter)
    for k, (stage_name, module) in enumerate(pairs):
        if not isinstance(module, torch.nn.Module):
            continue
        for name, parameter in module.named_parameters():
            if not parameter.requires_grad:
                continue
            entry = found.setdefault(id(parameter), (f"{stage_name}.{name}", [], parameter))
            if k not in entry[1]:
                entry[1].append(k)
    return [(SharedParameter(name=name, stages=tuple(stages), bytes=parameter.untyped_storage().nbytes()), parameter)
            for name, stages, parameter in found.values() if len(stages) > 1]
