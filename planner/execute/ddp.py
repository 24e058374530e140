"""A plan run inside PyTorch's ``DistributedDataParallel``: each gradient announced to DDP's reducer once complete.

DDP averages gradients from hooks on the parameters' gradient accumulators (autograd's ``AccumulateGrad`` nodes):
its reducer copies a parameter's ``.grad`` into a bucket when the node has run, and all-reduces a bucket once all
of its parameters are in. The chain executor adds gradients into ``.grad`` itself (planner/execute/autograd.py:
exact bytes, tied parameters summed in autograd's order), so no accumulator runs and DDP would average nothing.
:class:`GradientAnnouncer` runs each parameter's accumulator node once, with no gradient, as soon as its
gradient is complete (after the backward of its stage; a tied parameter's after the backward of the first stage
reading it, the last to run): the node adds nothing, and every post hook on it fires, as in a plain backward.
DDP then buckets, all-reduces (overlapping the later stages' backwards, as it does in a plain step) and writes
the averages back into ``.grad`` before ``backward()`` returns. :func:`active_ddp` finds the DDP running a module;
:func:`check_ddp` refuses in one line what cannot run so. Memory: docs/model.md, "Data parallelism (DDP)".
"""

import weakref
from dataclasses import dataclass

import torch

from planner.errors import MemschedError
from planner.simulate.ddp import CommHook, Gradient


def active_ddp(module: torch.nn.Module):
    """The ``DistributedDataParallel`` whose forward is running now and holds ``module``'s parameters (it wraps the
    fitted model that runs ``module``), else None."""
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel._get_active_ddp_module()
    mine = next(module.parameters(), None)
    if ddp is None or mine is None or id(mine) not in known_ddp(ddp)[0]:  # its parameters' ids, read once
        return None
    return ddp


def check_ddp(ddp, plan_kind: str) -> None:
    """Refuse in one line a DDP setting under which the executor's gradients would not be averaged as DDP's are:
    ``find_unused_parameters`` (DDP looks for the parameters the output's graph reaches, and a planned step's
    output reaches none: every parameter would be taken as unused and then marked ready twice), and plans that
    do not add their gradients into ``.grad`` stage by stage (``plan_kind`` names them)."""
    if ddp.find_unused_parameters and not ddp.static_graph:
        raise MemschedError("DDP(find_unused_parameters=True) cannot see a planned step's parameters (its output "
                            "reaches them only through the plan's backward), and every parameter of a fitted model "
                            "receives a gradient: wrap it without find_unused_parameters")
    if plan_kind is not None:
        raise MemschedError(f"a plan {plan_kind} does not run inside DistributedDataParallel: fit without it, or "
                            "train without DDP")


@dataclass(frozen=True)
class DDPSettings:
    """What sizes a rank under a DDP (planner/simulate/ddp.py): whether its gradients are bucket views, its
    communication hook (None: a hook memsched does not size, named in ``hook_name``) and its trainable
    parameters' gradients, each once."""

    bucket_view: bool
    hook: CommHook
    hook_name: str
    gradients: tuple


_KNOWN = weakref.WeakKeyDictionary()  # DDP -> (hooks registered, bucket order, DDPSettings): read once per DDP


def known_ddp(ddp) -> tuple:
    """``(order, settings)`` of a ``DistributedDataParallel``: ``{id(parameter): position}`` in its bucket order
    (the reverse of its module's parameters, for :class:`GradientAnnouncer`) and its :class:`DDPSettings`, read
    again only once a communication hook is registered."""
    hooks = len(getattr(ddp, "_comm_hooks", ()))
    if ddp not in _KNOWN or _KNOWN[ddp][0] != hooks:
        order = {id(parameter): -k for k, parameter in enumerate(ddp.module.parameters())}
        _KNOWN[ddp] = hooks, order, ddp_settings(ddp)
    return _KNOWN[ddp][1:]


def ddp_settings(ddp) -> DDPSettings:
    """The :class:`DDPSettings` of a ``DistributedDataParallel``."""
    hooks = list(getattr(ddp, "_comm_hooks", ()))
    hook, name = (CommHook(), "allreduce") if not hooks else _sized_hook(*hooks[-1])
    trainable = {id(p): p for p in ddp.module.parameters() if p.requires_grad}.values()
    return DDPSettings(ddp.gradient_as_bucket_view, hook, name, tuple(_gradient(p) for p in trainable))


def _sized_hook(hook, state) -> tuple:
    """``(CommHook or None, the hook's name)`` for a hook registered with ``register_comm_hook``."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    name = getattr(hook, "__qualname__", repr(hook))
    if hook is powerSGD_hook.powerSGD_hook:
        return CommHook("powersgd", state.matrix_approximation_rank, state.min_compression_rate,
                        state.use_error_feedback, state.warm_start), name
    kinds = {default_hooks.allreduce_hook: "allreduce", default_hooks.fp16_compress_hook: "fp16",
             default_hooks.bf16_compress_hook: "bf16"}
    return (CommHook(kinds[hook]) if hook in kinds else None), name


def _gradient(parameter) -> Gradient:
    """A parameter's gradient as DDP buckets it and PowerSGD views it (its first dimension by the rest)."""
    rows = parameter.shape[0] if parameter.dim() else 1
    return Gradient(rows, parameter.numel() // max(rows, 1), parameter.element_size())


class GradientAnnouncer:
    """Announces each parameter's gradient to the hooks on its accumulator once complete, once a step.

    ``first_readers``: ``{id(parameter): the lowest stage reading it}`` for the parameters several stages read
    (as :class:`planner.execute.autograd.TiedGradients` takes them); any other parameter is complete after the
    backward of its own stage. ``order``: DDP's bucket order (:func:`known_ddp`, the reverse of its module's
    parameters), in which the gradients a backward completes are announced together. DDP rebuilds its buckets
    once, in the order the gradients arrived in the first step: announced so, they stay DDP's initial ones. (A
    plain step completes them in the order its eager backward runs, which a stage's captured graph does not keep;
    a hook drawing random projections bucket by bucket, PowerSGD, depends on that order.)
    """

    def __init__(self, first_readers: dict, order: dict):
        self.first_readers = first_readers
        self.position = order

    def after_backward(self, stages, parameters) -> None:
        """After the backward of ``stages`` (a graph's) added the gradients of ``parameters`` (those needing
        them) into ``.grad``: announce those now complete."""
        complete = sorted((p for p in parameters if self.first_readers.get(id(p), stages[0]) in stages),
                          key=lambda p: self.position.get(id(p), 0))
        if complete:  # a chain of nodes, so that autograd runs the accumulators one by one in this order
            link = None
            for parameter in reversed(complete):
                link = _Announce.apply(parameter, link)
            torch.autograd.backward(link, torch.empty(0))


class _Announce(torch.autograd.Function):
    """Reads a parameter (and the next link of the chain); its backward sends the parameter no gradient, so that
    autograd runs its accumulator with nothing to add (the accumulator's post hooks fire, ``.grad`` untouched),
    and only then the next link: an accumulator runs before any other ready node."""

    @staticmethod
    def forward(ctx, parameter, link):
        return torch.empty(0)  # no storage: nothing allocated

    @staticmethod
    def backward(ctx, grad):
        return None, (grad if ctx.needs_input_grad[1] else None)
