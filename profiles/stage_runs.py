"""The runs the chain profiler measures a stage with, as a stage runs inside a whole chain's step: a fresh input
(:func:`fresh_input`), its backward with the gradient autograd alone owns (:func:`stage_backward`), and the loss
handed its input without the stage's backward (:class:`HandOver`). profiles/chain_profiler.py says what each run
measures."""

import torch
from torch.utils._pytree import tree_flatten, tree_map

from planner.execute.autograd import accumulate_grads


class _IncomingGradient(torch.autograd.Function):
    """Identity whose backward hands on a fresh gradient of ones, owned by autograd alone.

    In a whole chain, the gradient reaching a stage is a buffer that autograd frees as soon as the stage's
    first backward operation has used it; a gradient held by the caller would stay to the end and inflate
    the measured peak. The values (ones) change neither sizes nor times.
    """

    @staticmethod
    def forward(ctx, tensor):
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        return torch.ones(grad.shape, dtype=grad.dtype, device=grad.device)


class HandOver(torch.autograd.Function):
    """Identity on a tensor, differentiable with respect to a scalar ``source`` instead of the tensor.

    Its backward receives the tensor's gradient (so autograd makes it, as for ``δ_L`` in a whole chain)
    and drops it, so the gradient goes no further; the caller need not keep the tensor to differentiate.
    It returns no gradient for ``source`` either, so that it allocates nothing the real step would not.
    """

    @staticmethod
    def forward(ctx, tensor, source):
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        return None, None

    @staticmethod
    def hand(tree, source):
        return tree_map(lambda t: HandOver.apply(t, source) if isinstance(t, torch.Tensor) and t.is_floating_point()
                        else t, tree)


def stage_backward(outputs, stage_input, module, release: bool = False) -> None:
    """The stage's backward as in a whole chain: parameter gradients into ``.grad``, input gradients made.

    ``release``: ``outputs`` (a list) is emptied once the backward's root is built, so that, as in the executor
    (which keeps only the outputs' gradient edges), an output the backward saved dies when its operation's
    backward has run, not at the end (a block ending in ReLU: its output, a whole activation, at the start).

    ``torch.autograd.grad`` rather than ``backward``: the stage's input is a leaf here but not in the real
    chain, and accumulating into a leaf's ``.grad`` can copy the gradient, which the real step never does.
    The parameter gradients go into ``.grad`` as the executor puts them (``planner.execute.autograd.accumulate_grads``:
    autograd's layout rule, so a gradient AccumulateGrad would copy is copied here too, at either thread count).
    """
    differentiable = [t for t in outputs if t.requires_grad]
    targets = [t for t in tensors_of(stage_input) if t.requires_grad]
    parameters = [p for p in module_parameters(module) if p.requires_grad] if module is not None else []
    if not differentiable or not targets + parameters:
        return
    if len(differentiable) == 1 and differentiable[0].numel() == 1:
        root = differentiable[0]  # the loss: its gradient is the scalar 1
    else:
        root = sum(_IncomingGradient.apply(t).sum() for t in differentiable)
    del differentiable
    if release:
        outputs.clear()
    results = list(torch.autograd.grad(root, targets + parameters, allow_unused=True))
    parameter_grads, results[len(targets):] = results[len(targets):], []  # accumulate_grads' alone (it frees them)
    accumulate_grads(parameters, parameter_grads)


def module_parameters(module) -> list:
    return list(module.parameters()) if isinstance(module, torch.nn.Module) else []


def module_buffers(module) -> list:
    return list(module.buffers()) if isinstance(module, torch.nn.Module) else []


def fresh_input(activation, needs_grad):
    """A detached copy-free view of ``activation``; floating tensors require grad when the stage's input does."""
    def fresh(t):
        if not isinstance(t, torch.Tensor):
            return t
        leaf = t.detach()
        return leaf.requires_grad_(needs_grad and leaf.is_floating_point())

    return tree_map(fresh, activation)


def tensors_of(tree) -> list:
    """The tensors among ``tree``'s leaves."""
    return [leaf for leaf in tree_flatten(tree)[0] if isinstance(leaf, torch.Tensor)]
