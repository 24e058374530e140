"""The optimizer update inside the backward: each parameter updated, and its gradient freed, once complete.

A plan whose ``update`` is ``in-backward`` or ``on-host`` (planner/updates.py) runs with a :class:`StageUpdates`:
after ``B i`` has added its gradients into ``.grad`` (planner/execute/steprun.py), the parameters whose last
reading stage is ``i`` (a tied embedding: the first stage reading it, whose backward runs last) are updated by
their own optimizer and their gradients freed, as PyTorch's optimizer-in-backward recipe does with
post-accumulate-grad hooks (the chain executor sets ``.grad`` itself, so it calls the update itself). With
``on-host`` each gradient is first copied into a host buffer, the update runs there on an fp32 master copy whose
optimizer state is on the host too, and the updated values are copied back into the parameter.

The optimizers are PyTorch's, fused (one kernel per parameter list, no temporaries: the chain model's update
allocates nothing): ``sgd``, ``momentum`` (SGD, momentum 0.9), ``adam`` and ``adamw``. What an update inside the
backward cannot honour is refused in one line: gradients accumulated over several backwards (a parameter that
has a gradient when the backward starts), and 8-bit Adam (no PyTorch implementation).
"""

import torch

from planner.errors import MemschedError
from planner.execute.copies import numpy_backed

UPDATE_OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")
MOMENTUM = 0.9  # TrainingSetup's "momentum": SGD with one momentum buffer


def fused_optimizer(name: str, parameters, lr: float) -> torch.optim.Optimizer:
    """PyTorch's fused ``name`` optimizer (:data:`UPDATE_OPTIMIZERS`) over ``parameters`` at learning rate ``lr``."""
    if name == "sgd":
        return torch.optim.SGD(parameters, lr=lr, fused=True)
    if name == "momentum":
        return torch.optim.SGD(parameters, lr=lr, momentum=MOMENTUM, fused=True)
    if name == "adam":
        return torch.optim.Adam(parameters, lr=lr, fused=True)
    if name == "adamw":
        return torch.optim.AdamW(parameters, lr=lr, fused=True)
    raise MemschedError(f"optimizer: {name!r} cannot update inside the backward; use one of "
                        f"{', '.join(UPDATE_OPTIMIZERS)}")


class StageUpdates:
    """Per stage, the optimizer of the parameters complete after its backward (``modules``: the stages in order).

    ``update``: ``in-backward`` (parameters updated where they are) or ``on-host`` (on fp32 host copies).
    Optimizer state is made by :meth:`warm_up`, a zero-gradient step, before the first measured step.
    """

    def __init__(self, modules, update: str, optimizer: str, lr: float):
        self.on_host = update == "on-host"
        last_reader = {}  # id(parameter) -> (parameter, the lowest stage reading it: its backward runs last)
        for k, module in enumerate(modules):
            for parameter in module.parameters() if isinstance(module, torch.nn.Module) else ():
                if parameter.requires_grad:
                    last_reader.setdefault(id(parameter), (parameter, k))
        self.parameters = [parameter for parameter, _ in last_reader.values()]
        self.groups = {}  # stage -> [(parameter, its master copy on the host or None, host gradient buffer)]
        for parameter, k in last_reader.values():
            master = grad = None
            if self.on_host:
                master = _on_host(parameter.detach().float())
                grad = _on_host(torch.zeros_like(master))
            self.groups.setdefault(k, []).append((parameter, master, grad))
        self.optimizers = {k: fused_optimizer(optimizer, [p if m is None else m for p, m, _ in group], lr)
                           for k, group in self.groups.items()}

    def check_no_gradients(self) -> None:
        """Before a backward: a gradient already in ``.grad`` would be accumulated into, which the update cannot
        honour (it frees the gradients it updates with)."""
        for parameter in self.parameters:
            if parameter.grad is not None:
                raise MemschedError("a parameter has a gradient before the backward (gradients accumulated over "
                                    "several backwards): the optimizer update inside the backward updates with "
                                    "each backward's gradients; set them to None first, or update after the "
                                    "backward")

    def after_backward(self, stage: int) -> None:
        """``B stage`` has run: update the parameters it completed and free their gradients."""
        group = self.groups.get(stage)
        if not group:
            return
        if self.on_host:
            for parameter, master, grad in group:
                grad.copy_(parameter.grad)
                parameter.grad = None
                master.grad = grad
            self.optimizers[stage].step()
            for parameter, master, _ in group:
                master.grad = None
                parameter.data.copy_(master)
            return
        self.optimizers[stage].step()
        for parameter, _, _ in group:
            parameter.grad = None

    def warm_up(self) -> None:
        """One update with zero gradients, making every optimizer's state (as a training loop's first step)."""
        for k, group in self.groups.items():
            for parameter, master, _ in group:
                target = parameter if master is None else master
                target.grad = torch.zeros_like(target)
            self.optimizers[k].step()
            for parameter, master, _ in group:
                target = parameter if master is None else master
                target.grad = None
                if master is not None:
                    parameter.data.copy_(master)

    def saved(self) -> list:
        """``(tensor, copy)`` for every parameter, master copy and optimizer state tensor: what :meth:`restore`
        puts back (a measuring run that must not count as a training step)."""
        tensors = [p for group in self.groups.values() for entry in group for p in entry[:2] if p is not None]
        for optimizer in self.optimizers.values():
            tensors += [value for state in optimizer.state.values() for value in state.values()
                        if isinstance(value, torch.Tensor)]
        return [(t, t.detach().clone()) for t in tensors]

    @staticmethod
    def restore(saved: list) -> None:
        """Put back what :meth:`saved` copied."""
        with torch.no_grad():
            for tensor, copy in saved:
                tensor.copy_(copy)


def _on_host(tensor) -> torch.Tensor:
    """A host copy of ``tensor``: pinned for a CUDA tensor; on CPU over NumPy memory, which the live-memory
    tracker does not count as the device's (planner/execute/copies.py)."""
    if tensor.device.type == "cpu":
        return numpy_backed(tensor.contiguous())
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor)
    return host
