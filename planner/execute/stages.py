"""The staged model every executor, the profilers and the zoo share, and the helpers that run it.

:class:`StagedModel`: stages ``[(name, module), ...]`` in chain order, example inputs ``(a_0, *extra)`` and a
loss. Stage ``k`` is called as ``module(a_k, *extra)`` (:func:`run_stages`); ``loss_fn(a_L)`` returns a scalar.
:meth:`StagedModel.of` accepts a model or the ``(stages, example_inputs, loss_fn)`` the profilers take.
:func:`preserved_state` restores what a measuring run changes; :func:`default_loss`, :func:`checked_device` and
:func:`quiet_fake_tensor_log` are shared by the capture, the profilers and the CLI.
"""

import contextlib
import dataclasses
import logging
import types
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from planner.errors import MemschedError


def default_loss(output):
    """The loss used when a model gives none: the mean of the first tensor of the last output."""
    return [leaf for leaf in tree_flatten(output)[0] if isinstance(leaf, torch.Tensor)][0].float().mean()


@dataclass
class StagedModel:
    """A model split into a chain of stages, with example inputs and a loss (see the module docstring)."""

    name: str
    stages: list  # [(stage_name, module)] in chain order
    example_inputs: tuple  # (first_stage_input, *extra_args)
    loss_fn: Callable  # loss_fn(last_stage_output) -> scalar tensor
    options: dict = field(default_factory=dict)  # the options it was built with (the zoo's), defaults filled in
    report: tuple = ()  # lines saying how its stages were found, when memsched found them (profiles/discover.py)

    @classmethod
    def of(cls, model, example_inputs=None, loss_fn=None, *, user: str = "this", name: str = "model"):
        """``model`` as a :class:`StagedModel`: a staged model (``example_inputs`` and ``loss_fn``, when given,
        replace its own), or a module or stages (as :func:`named_stages` takes them; one ``nn.Module`` that is no
        container is one stage ``"model"``) with ``example_inputs`` (one tensor or a tuple) and ``loss_fn``
        (default :func:`default_loss`). ``user`` names the caller in the error for missing inputs."""
        if isinstance(model, StagedModel):
            inputs = model.example_inputs if example_inputs is None else _as_tuple(example_inputs)
            return dataclasses.replace(model, example_inputs=inputs, loss_fn=loss_fn or model.loss_fn)
        if example_inputs is None:
            raise MemschedError(f"{user} needs example_inputs (the profiled model's) to capture the step")
        if isinstance(model, torch.nn.Module) and not isinstance(model, (torch.nn.Sequential, torch.nn.ModuleList)):
            stages = [("model", model)]
        else:
            stages = named_stages(model)
        return cls(name, stages, _as_tuple(example_inputs), loss_fn or default_loss)


def _as_tuple(example_inputs) -> tuple:
    return example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)


def named_stages(stages) -> list:
    """``[(name, module), ...]`` from an ``nn.Sequential``/``nn.ModuleList``, a list of modules or of pairs, or a
    dict."""
    if isinstance(stages, torch.nn.Sequential):
        pairs = list(stages.named_children())
    elif isinstance(stages, dict):
        pairs = list(stages.items())
    elif isinstance(stages, (list, tuple, torch.nn.ModuleList)):
        pairs = [item if isinstance(item, tuple) and len(item) == 2 else (f"stage{k}", item)
                 for k, item in enumerate(stages)]
    else:
        raise MemschedError(f"stages must be an nn.Sequential, an nn.ModuleList, a list of modules "
                            f"or of (name, module) "
                            f"pairs, or a dict of them; got {type(stages).__name__}")
    for name, module in pairs:
        if not isinstance(name, str) or not callable(module):
            raise MemschedError(f"stage {name!r}: expected (name, module) with a callable module, "
                                f"got {type(module).__name__}")
    if not pairs:
        raise MemschedError("no stages to profile: give at least one module")
    return pairs


def run_stages(stages, inputs):
    """The plain forward: ``a_{k+1} = module_k(a_k, *inputs[1:])`` over ``stages`` (``(name, module)`` pairs) from
    ``a_0 = inputs[0]``; returns the last output."""
    activation, extra = inputs[0], inputs[1:]
    for _, module in stages:
        activation = module(activation, *extra)
    return activation


def trainable_parameters(stages) -> list:
    """The parameters of ``(name, module)`` pairs that require gradients, each once (shared ones too)."""
    return [parameter for _, parameter in named_parameters(stages).values()]


def named_parameters(stages) -> dict:
    """``{id: (stage.name, parameter)}`` of the parameters of ``(name, module)`` pairs that require gradients,
    each once, named at its first stage."""
    named = {}
    for stage, module in stages:
        for name, parameter in module.named_parameters() if isinstance(module, torch.nn.Module) else ():
            if parameter.requires_grad:
                named.setdefault(id(parameter), (f"{stage}.{name}", parameter))
    return named


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


def checked_device(device) -> torch.device:
    """``device`` as a torch device, or a one-line error when it is CUDA and this machine has none."""
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise MemschedError("--device cuda: CUDA is not available on this machine; use --device cpu")
    return device


@contextlib.contextmanager
def quiet_fake_tensor_log():
    """A stage failing on fake tensors makes torch log a traceback; the one-line error names it instead."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


# --------------------------------------------------------------------------------------------------
# A data-parallel rank's part of the batch (planner/execute/data_parallel.py)


def rank_slice(built, rank: int, world: int):
    """The staged model ``built`` on rank ``rank``'s part of its batch: its inputs cut by :func:`batch_part`, and
    the loss's target too when it closes over one (as the zoo's do: a row per sample or per token)."""
    inputs, cut, batch = _parts(built.example_inputs, rank, world)
    return dataclasses.replace(built, example_inputs=inputs, loss_fn=_sliced_loss(built.loss_fn, cut, batch))


def batch_part(inputs, rank: int, world: int):
    """``inputs`` (a tensor, or a tuple or dict of them and other values) with every tensor whose first dimension
    is the batch (the first tensor's) cut into ``world`` equal parts: a copy of part ``rank``. A batch that does not
    split evenly is refused in one line."""
    return _parts(inputs, rank, world)[0]


def _parts(inputs, rank: int, world: int) -> tuple:
    """``(inputs cut, cut, batch)``: :func:`batch_part`'s result, the function cutting a tensor whose first
    dimension is a multiple of the batch, and the batch."""
    flat, spec = tree_flatten(inputs)
    batch = batch_size(flat, "data parallelism splits")
    if batch % world:
        raise MemschedError(f"the batch of {batch} does not split over {world} data-parallel ranks; give a batch that "
                            f"is a multiple of {world} (--batch)")

    def cut(value):
        rows = value.shape[0] // world
        return value[rank * rows:(rank + 1) * rows].clone()

    parts = [cut(value) if _batch_sized(value, batch, exactly=True) else value for value in flat]
    return tree_unflatten(parts, spec), cut, batch


def batch_resized(inputs, size: int):
    """``inputs`` (as for :func:`batch_part`) with every tensor whose first dimension is the batch (the first
    tensor's) made ``size`` rows long, row ``i`` its row ``i`` modulo the batch: a batch of another size laid out
    as this one, its values this one's (token ids stay ids, labels labels). Fake tensors stay fake."""
    flat, spec = tree_flatten(inputs)
    batch = batch_size(flat, "a batch of another size repeats")
    rows = torch.arange(size) % batch
    return tree_unflatten([value.index_select(0, rows.to(value.device)) if _batch_sized(value, batch, exactly=True)
                           else value for value in flat], spec)


def batch_size(flat: list, what: str) -> int:
    """The batch of flat inputs: their first tensor's first size, refused in one line (``what`` does what with
    it) when there is no such tensor."""
    first = next((t for t in flat if isinstance(t, torch.Tensor)), None)
    if first is None or not first.dim() or not first.shape[0]:
        raise MemschedError(f"{what} the model's first input along its first dimension, the batch: it must be a "
                            "tensor with one")
    return first.shape[0]


def _batch_sized(value, batch: int, exactly: bool = False) -> bool:
    """A tensor whose first dimension is ``batch`` (or, not ``exactly``, a non-zero multiple of it)."""
    if not isinstance(value, torch.Tensor) or not value.dim() or not value.shape[0]:
        return False
    return value.shape[0] == batch if exactly else value.shape[0] % batch == 0


def _sliced_loss(loss_fn, cut, batch):
    """``loss_fn`` with the one tensor it closes over whose first dimension is a multiple of the batch (its target:
    a row per sample or per token), if any, cut to the rank's part."""
    cells = getattr(loss_fn, "__closure__", None) or ()
    found = [k for k, cell in enumerate(cells) if _batch_sized(_contents(cell), batch)]
    if not found:
        return loss_fn
    if len(found) > 1:
        raise MemschedError(f"data parallelism: the loss closes over {len(found)} tensors sized by the batch; it "
                            "can split one target")
    cells = tuple(types.CellType(cut(cell.cell_contents)) if k == found[0] else cell for k, cell in enumerate(cells))
    return types.FunctionType(loss_fn.__code__, loss_fn.__globals__, loss_fn.__name__, loss_fn.__defaults__, cells)


def _contents(cell):
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None
