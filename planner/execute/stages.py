"""Stages as the profiler, the executor and the graph tools take them: ``[(name, module), ...]``; and the model
state a measuring run must leave as it found."""

import contextlib

import torch

from planner.errors import MemschedError


def named_stages(stages) -> list:
    """``[(name, module), ...]`` from an ``nn.Sequential``/``nn.ModuleList``, a list of modules or of pairs, or a dict."""
    if isinstance(stages, torch.nn.Sequential):
        pairs = list(stages.named_children())
    elif isinstance(stages, dict):
        pairs = list(stages.items())
    elif isinstance(stages, (list, tuple, torch.nn.ModuleList)):
        pairs = [item if isinstance(item, tuple) and len(item) == 2 else (f"stage{k}", item) for k, item in enumerate(stages)]
    else:
        raise MemschedError(f"stages must be an nn.Sequential, an nn.ModuleList, a list of modules or of (name, module) "
                            f"pairs, or a dict of them; got {type(stages).__name__}")
    for name, module in pairs:
        if not isinstance(name, str) or not callable(module):
            raise MemschedError(f"stage {name!r}: expected (name, module) with a callable module, got {type(module).__name__}")
    if not pairs:
        raise MemschedError("no stages to profile: give at least one module")
    return pairs


@contextlib.contextmanager
def preserved_state(modules, device):
    """Restore buffers (BatchNorm statistics...), parameter gradients and random number generators afterwards."""
    buffers = [(b, b.detach().clone()) for m in modules if isinstance(m, torch.nn.Module) for b in m.buffers()]
    grads = [(p, p.grad) for m in modules if isinstance(m, torch.nn.Module) for p in m.parameters()]
    cuda = [device] if torch.device(device).type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        try:
            yield
        finally:
            with torch.no_grad():
                for buffer, saved in buffers:
                    buffer.copy_(saved)
            for parameter, grad in grads:
                parameter.grad = grad
