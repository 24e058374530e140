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


def state_tensors(optimizers) -> list:
    """The tensors of the ``optimizers``' state (moments, momentum buffers, step counters)."""
    return [value for optimizer in optimizers for entry in optimizer.state.values() for value in entry.values()
            if isinstance(value, torch.Tensor)]


class StageUpdates:
    """Per stage, the optimizers of the parameters complete after its backward (``modules``: the stages in order).

    ``update``: ``in-backward`` (parameters updated where they are) or ``on-host`` (on fp32 host copies) for the
    parameters of the stages ``host_stages`` (None: all), a parameter belonging, as in a chain, to the last stage
    reading it (planner/shared.py); the others update on their device. Optimizer state is made by
    :meth:`warm_up`, a zero-gradient step, before the first measured step (or by the first step).
    """

    def __init__(self, modules, update: str, optimizer: str, lr: float, host_stages=None):
        readers = {}  # id(parameter) -> (parameter, the stages reading it, in order)
        for k, module in enumerate(modules):
            for parameter in module.parameters() if isinstance(module, torch.nn.Module) else ():
                if parameter.requires_grad:
                    readers.setdefault(id(parameter), (parameter, []))[1].append(k)
        self.update = update  # when: "in-backward" or "on-host"
        host = set() if update != "on-host" else set(range(len(modules)) if host_stages is None else host_stages)
        self.parameters = [parameter for parameter, _ in readers.values()]
        # (the lowest stage reading them: its backward completes their gradients, on the host?) -> entries
        # (parameter, its master copy on the host or None, the host gradient buffer or None)
        self.groups = {}
        for parameter, stages in readers.values():
            master = grad = None
            if stages[-1] in host:
                master = _on_host(parameter.detach().float())
                grad = _on_host(torch.zeros_like(master))
            self.groups.setdefault((stages[0], master is not None), []).append((parameter, master, grad))
        self.optimizers = {key: fused_optimizer(optimizer, [p if m is None else m for p, m, _ in group], lr)
                           for key, group in self.groups.items()}

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
        for on_host in (False, True):
            group = self.groups.get((stage, on_host))
            if not group:
                continue
            if on_host:
                for parameter, master, grad in group:
                    grad.copy_(parameter.grad)
                    parameter.grad = None
                    master.grad = grad
            self.optimizers[stage, on_host].step()
            for parameter, master, _ in group:
                if master is None:
                    parameter.grad = None
                else:
                    master.grad = None
                    parameter.data.copy_(master)

    def warm_up(self) -> None:
        """One update with zero gradients, making every optimizer's state (as a training loop's first step)."""
        for key, group in self.groups.items():
            for parameter, master, _ in group:
                target = parameter if master is None else master
                target.grad = torch.zeros_like(target)
            self.optimizers[key].step()
            for parameter, master, _ in group:
                target = parameter if master is None else master
                target.grad = None
                if master is not None:
                    parameter.data.copy_(master)

    def device_optimizers(self) -> list:
        """The optimizers whose state is on the parameters' device."""
        return [optimizer for (_, on_host), optimizer in self.optimizers.items() if not on_host]

    def saved(self) -> list:
        """``(tensor, copy)`` for every parameter, master copy and optimizer state tensor: what :meth:`restore`
        puts back (a measuring run that must not count as a training step)."""
        tensors = [p for group in self.groups.values() for entry in group for p in entry[:2] if p is not None]
        return [(t, t.detach().clone()) for t in tensors + state_tensors(self.optimizers.values())]

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
