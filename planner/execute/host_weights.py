"""Where the parameters of host-weight stages live between steps: on the host (docs/execution.md, "Host weights").

:func:`prepare_host_weights` moves the trainable parameters of the stages a schedule moves ``weights`` of to the
host (the same ``Parameter`` objects; ``.data`` and ``.grad`` swapped) and puts back on their device those an
earlier plan moved and this one does not; a plan without transfers therefore restores them. :func:`current_homes`
re-homes parameters replaced since; :func:`weights_on_device` runs inference on a temporary device copy.
"""

import contextlib

import torch
from torch.utils.weak import WeakIdKeyDictionary

from planner.errors import MemschedError
from planner.execute.copies import numpy_backed
from planner.ops import host_weight_stages

_HOMES = WeakIdKeyDictionary()  # parameter -> (its host tensor, the device it is computed on)


def prepare_host_weights(modules, schedule) -> dict:
    """``{i: [(parameter, host tensor, device), ...]}`` for the host-weight stages of ``schedule``, their
    trainable parameters' data (and any ``.grad``) moved to the host. Parameters made host-weight by an earlier
    plan and not by this one go back to their device. A parameter shared with another stage is refused."""
    stages = host_weight_stages(schedule)
    where = {}  # id(parameter) -> the stages holding it
    for k, module in enumerate(modules):
        for parameter in module.parameters() if isinstance(module, torch.nn.Module) else ():
            where.setdefault(id(parameter), set()).add(k)
    homes = {}
    for i in sorted(stages):
        if not 0 <= i < len(modules):
            raise MemschedError(f"the plan moves weights {i}, but the model has {len(modules)} stages")
        module = modules[i]
        named = list(module.named_parameters()) if isinstance(module, torch.nn.Module) else []
        for name, parameter in named:
            others = sorted(where[id(parameter)] - {i}) if parameter.requires_grad else ()
            if others:
                raise MemschedError(f"parameter {name!r} of stage {i} is shared with stage {others[0]} (tied "
                                    f"weights): the plan cannot keep stage {i}'s weights on the host; keep them on "
                                    "the device (no transfers of weights/grads of either stage)")
        unique = {id(p): p for _, p in named if p.requires_grad}
        homes[i] = [_home(parameter) for parameter in unique.values()]
    moved = {id(parameter) for entries in homes.values() for parameter, _, _ in entries}
    for module in modules:
        for parameter in module.parameters() if isinstance(module, torch.nn.Module) else ():
            if id(parameter) not in moved and parameter in _HOMES:
                _go_back(parameter)
    return homes


def current_homes(host_weights) -> dict:
    """``host_weights`` (from :func:`prepare_host_weights`), re-homing a parameter whose data was replaced since
    (``load_state_dict`` copies in place and keeps the home; ``model.to(...)`` replaces it)."""
    for entries in host_weights.values():
        for k, (parameter, host, _) in enumerate(entries):
            if not _same_storage(parameter.data, host):
                entries[k] = _home(parameter)
    return host_weights


@contextlib.contextmanager
def weights_on_device(homes):
    """Inference (no autograd) on a host-weight stage: its parameters on their device for the call (on CPU the
    host tensors themselves)."""
    moved = [(parameter, host, device) for parameter, host, device in homes if host.device != device]
    try:
        for parameter, host, device in moved:
            parameter.data = host.to(device, non_blocking=True)
        yield
    finally:
        for parameter, host, _ in moved:
            parameter.data = host


def _same_storage(a, b) -> bool:
    return a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _home(parameter) -> tuple:
    """``(parameter, host, device)``, the parameter's data and gradient now on the host."""
    known = _HOMES.get(parameter)
    if known is not None and _same_storage(parameter.data, known[0]):
        return (parameter, *known)
    data, device = parameter.data, parameter.device
    grad = parameter.grad
    if device.type == "cpu":
        host = numpy_backed(data)
    else:
        host = torch.empty_strided(data.size(), data.stride(), dtype=data.dtype, pin_memory=True)
        host.copy_(data)
    parameter.grad = None
    parameter.data = host
    if grad is not None:
        parameter.grad = grad if grad.device.type == "cpu" else grad.to("cpu")
    _HOMES[parameter] = (host, device)
    return parameter, host, device


def _go_back(parameter) -> None:
    """A parameter no plan keeps on the host any more: back to the device it was computed on."""
    _, device = _HOMES.pop(parameter)
    if parameter.device != device:
        grad = parameter.grad
        parameter.grad = None
        parameter.data = parameter.data.to(device)
        if grad is not None:
            parameter.grad = grad.to(device)
