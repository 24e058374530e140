"""What the chain records about a model, read from live modules and tensors: the shapes and dtypes it was
measured on (planner/measured_on.py) and the parameters several stages share (planner/shared.py)."""

import torch
from torch.utils._pytree import keystr, tree_flatten_with_path

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
