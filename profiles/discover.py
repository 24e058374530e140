"""Stage discovery: a plain ``nn.Module`` and its example inputs made a chain of stages, with no glue code.

:func:`discover` captures ``loss(model(*args, **kwargs))`` with ``torch.export`` (non-strict: the model's own
Python runs, on fake tensors; the training IR keeps aten ops as eager dispatches them, dropout and in-place
BatchNorm updates included) and cuts the captured graph where the rest of the step depends on the part before it
through one tensor only:

1. **Two kinds of value.** A node is *differentiable* when it depends on a parameter that needs a gradient or
   on an input that does. The others (position ids, causal and padding masks, rotary tables, shifted labels)
   form the *prelude*: run once before the chain, their values are the chain's shared inputs (``extra``: stage
   ``k`` is called ``stage_k(a_k, *shared)``). A random op or a buffer write after the first differentiable node
   stays where it is, so that random numbers are drawn and statistics read in the model's order; an in-place
   write of a prelude value stays in the prelude unless a stage read that storage before it, and a stage that
   writes one of its inputs in place writes its own copy (a re-run must not apply a write twice).
2. **Cuts.** After differentiable node ``i``, the differentiable values made at or before ``i`` and read after
   it are the live set; where it is one tensor, the graph may be cut (a cut vertex of the dataflow, shared
   values aside). Residual blocks are cut between blocks, not inside them.
3. **Stages.** The pieces between cuts, a piece that calls no parameter merged into the one before it (into the
   next for the first), and, with ``max_stages``, the two neighbours with the deepest common module merged
   until that many remain; then two stages whose cut carries a value neither of their backwards keeps (frozen
   weights save no input: profiles/loose_cuts.py) are one. Each stage is a ``torch.fx.GraphModule`` that refers
   to the model's own parameters and buffers (tied ones stay one tensor); its name is the module that holds it
   (``transformer.h.3``).
4. **Checked.** The staged forward, prelude and stages, must give the loss the unmodified model gives with the
   same random seed, bit for bit (both run without autograd, so that discovery allocates no activation graph);
   buffers the model writes (BatchNorm statistics) are listed on each stage that reads them, so that a
   recomputation does not update them twice (:func:`planner.execute.autograd.running_statistics_kept`).

Under autocast, the captured step is taken down to ATen operations under it, so that autocast's casts are ops of
the graph and the stages compute in its precision wherever they run (profiles/precision.py).

What it cannot split fails in one line naming the reason: a forward ``torch.export`` cannot capture (its
message), a loss that is not a scalar, several inputs that need gradients, a staged loss that differs from the
model's. A model with no cut is one stage. Hugging Face models run with ``use_cache=False`` when their forward
takes it (a generation cache is not training state, and a recomputed layer would append to it again).
"""

import contextlib
import dataclasses
import enum
import inspect
import warnings
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_flatten, tree_flatten_with_path, tree_unflatten

from planner.errors import MemschedError
from planner.execute.stages import StagedModel, default_loss, preserved_state, run_stages
from planner.interrupts import interrupts_deferred
from planner.measured_on import TensorSpec
from profiles.capture_refusal import capture_refusal
from profiles.cuts import (
    Cut,
    OutputNotReturned,
    joined,
    leaf_name,
    merged,
    modules_of,
    prelude_module,
    shared_names,
    stage_module,
    stage_names,
    upcast_kept,
)
from profiles.loose_cuts import loose_cuts
from profiles.precision import eager_batch_norm, with_autocast_casts

VERIFY_SEED = 12345


def model_loss(output):
    """The default loss of a plain model: its output's ``loss`` (Hugging Face models given labels return one),
    else :func:`planner.execute.stages.default_loss` (the mean of its first tensor)."""
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    return default_loss(output) if loss is None else loss


def returned_loss(output):
    """The loss of a discovered chain: its last stage returns the loss itself, or ``(loss, *returned values)``."""
    return output[0] if isinstance(output, tuple) else output


class ExampleFailed(MemschedError):
    """The unmodified model (or its loss) raised on the example inputs."""


class _Place(enum.Enum):
    """In an output layout: the loss's place, a returned tensor's place (members survive a deep copy)."""

    LOSS = "loss"
    TENSOR = "tensor"


_LOSS, _TENSOR = _Place.LOSS, _Place.TENSOR


@dataclass(frozen=True)
class StageReport:
    """What a discovered stage holds: its name, the modules its ops run in, its op count and parameter count."""

    name: str
    modules: tuple
    ops: int
    parameters: int


@dataclass
class Discovery:
    """A model cut into a chain: :attr:`staged` is the chain (stages, example ``(a_0, *shared)``, loss);
    :meth:`chain_inputs` turns a batch given as the model takes it into the chain's inputs."""

    staged: StagedModel
    prelude: torch.fx.GraphModule  # the input tensors -> (a_0, *shared)
    treespec: object  # the structure of (args, kwargs)
    leaf_specs: tuple  # per flat leaf of (args, kwargs): a TensorSpec and device for a tensor, else the value
    shared_names: tuple  # a name per shared value
    report: tuple  # a StageReport per stage
    defaults: dict  # keyword arguments discovery adds when a batch lacks them (use_cache=False)
    output_layout: tuple = None  # with returns: (treespec of the model's output, per leaf _LOSS, _TENSOR or a value)
    returned_bytes: int = 0  # bytes of the returned tensors' storages (the loss's left out)

    @property
    def keywords(self) -> tuple:
        """The keyword arguments the plan was made for (discovery's defaults included)."""
        return tuple(self.treespec.children_specs[1].context)

    def output(self, stage_output):
        """The model's output rebuilt from the last stage's ``(loss, *returned tensors)``: the same type and
        values, with the loss where the model puts it (discovered with ``returns``)."""
        spec, kinds = self.output_layout
        returned = iter(stage_output[1:])
        leaves = [stage_output[0] if kind is _LOSS else next(returned) if kind is _TENSOR else kind for kind in kinds]
        return tree_unflatten(leaves, spec)

    def chain_inputs(self, args: tuple, kwargs: dict) -> tuple:
        """``(a_0, *shared)`` for a batch laid out as at discovery (else a one-line :class:`MemschedError`)."""
        return tuple(self.prelude(*_tensor_leaves(self.check_batch(args, kwargs))))

    def check_batch(self, args: tuple, kwargs: dict) -> list:
        """The flat leaves of ``(args, kwargs)``, refused in one line unless they are laid out as at discovery: the
        same structure, the same values where no tensor, tensors of the same shape, dtype and device."""
        kwargs = dict(sorted({**self.defaults, **kwargs}.items()))
        flat, treespec = tree_flatten_with_path((tuple(args), kwargs))
        if treespec != self.treespec:
            raise MemschedError(f"{self.staged.name}: the inputs are not those the model was planned for: "
                                f"{_arguments(treespec)} given, {_arguments(self.treespec)} planned")
        for (path, got), planned in zip(flat, self.leaf_specs):
            if _leaf_spec(got) != planned:
                raise MemschedError(f"{self.staged.name}: {leaf_name(path)} is {_shown(_leaf_spec(got))}, the plan "
                                    f"was made for {_shown(planned)}: call with inputs of the planned shapes, or "
                                    f"plan again (fit(..., replan=True))")
        return [leaf for _, leaf in flat]

    def describe(self) -> list:
        """Lines for people: the stages found, what each holds, and the shared inputs."""
        lines = [f"{self.staged.name}: {len(self.report)} stages discovered (torch.export, cut where one tensor "
                 f"carries the step on); shared inputs: {', '.join(self.shared_names) or 'none'}"]
        width = max(len(r.name) for r in self.report)
        for k, r in enumerate(self.report):
            modules = ", ".join(r.modules[:4]) + (f" and {len(r.modules) - 4} more" if len(r.modules) > 4 else "")
            lines.append(f"  {k:3d} {r.name:<{width}}  {r.ops:4d} ops  {r.parameters:>10,} parameters  {modules}")
        return lines


def discover(model: torch.nn.Module, example_inputs, loss_fn=None, *, name: str = None,
             max_stages: int = None, returns: bool = False) -> Discovery:
    """``model`` (a plain module) and ``example_inputs`` (a tensor, a tuple of positional arguments, or a dict of
    keyword arguments) as a chain of stages, as the module docstring describes; ``loss_fn(output)`` (default
    :func:`model_loss`) makes the scalar loss; at most ``max_stages`` stages when given. With ``returns`` the
    model's output must hold the loss (``output.loss``), and the last stage returns ``(loss, *the output's other
    tensors, detached)``, from which :meth:`Discovery.output` rebuilds the output."""
    name = name or type(model).__name__
    if not isinstance(model, torch.nn.Module):
        raise MemschedError(f"{name}: stage discovery takes an nn.Module, got {type(model).__name__}")
    if max_stages is not None and max_stages < 1:
        raise MemschedError(f"max_stages must be at least 1, got {max_stages}")
    args, kwargs = _as_call(model, example_inputs, name)
    leaves, treespec = tree_flatten((args, kwargs))
    tensors = _tensor_leaves(leaves)
    step = _Step(model, loss_fn or model_loss, treespec, leaves, returns)
    written, reference = _reference_run(step, tensors, name)
    graph_module = _export(step, tensors, name)
    cut = Cut(graph_module, tensors, written, name)
    pieces = merged(cut.pieces(), max_stages)
    while True:  # a cut whose value no backward keeps joins its two stages (profiles/loose_cuts.py) unless its
        # fp32 copy is kept (a 16-bit residual stream: cuts.upcast_kept, held by the executor as the model counts)
        shared = cut.later_shared(pieces)
        stages, reports = [], []
        for piece, stage_name in zip(pieces, stage_names([piece.nodes for piece in pieces])):
            module = stage_module(graph_module, piece, shared, written)
            stages.append((stage_name, module))
            reports.append(StageReport(stage_name, modules_of(piece.nodes), len(piece.nodes),
                                       sum(p.numel() for p in module.parameters())))
        prelude = prelude_module(graph_module, cut, [pieces[0].incoming] + shared)
        staged = StagedModel(name=name, stages=stages, example_inputs=tuple(prelude(*tensors)),
                             loss_fn=returned_loss)
        loose = [k for k in loose_cuts(stages, staged.example_inputs) if not upcast_kept(pieces[k].incoming)]
        if not loose:
            break
        pieces = joined(pieces, loose)
    discovery = Discovery(staged, prelude, treespec, tuple(_leaf_spec(leaf) for leaf in leaves),
                          shared_names(cut, shared, (args, kwargs)), tuple(reports),
                          {key: value for key, value in kwargs.items() if key not in _as_dict(example_inputs)},
                          step.output_layout, _storage_bytes(cut.returned, cut.loss))
    _check_staged(discovery, tensors, reference, model)
    discovery.staged = dataclasses.replace(staged, report=tuple(discovery.describe()))
    return discovery


# --------------------------------------------------------------------------------------------------
# The captured step


class _Step(torch.nn.Module):
    """``loss_fn(model(*args, **kwargs))`` from the tensors of the flat inputs (the other leaves fixed)."""

    def __init__(self, model, loss_fn, treespec, leaves, returns=False):
        super().__init__()
        self.model = model
        self.loss_fn, self.treespec, self.returns = loss_fn, treespec, returns
        self.leaves = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        self.positions = [k for k, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        self.output_layout = None

    def forward(self, *tensors):
        leaves = list(self.leaves)
        for position, tensor in zip(self.positions, tensors):
            leaves[position] = tensor
        args, kwargs = tree_unflatten(leaves, self.treespec)
        output = self.model(*args, **kwargs)
        loss = self.loss_fn(output)
        if not self.returns:
            return loss
        flat, spec = tree_flatten(output)
        if not any(leaf is loss for leaf in flat):
            raise OutputNotReturned(f"{type(self.model).__name__}: the model's output does not hold the loss: return "
                                    f"the loss only (fit(..., returns='loss'))")
        self.output_layout = (spec, tuple(_LOSS if leaf is loss else _TENSOR if isinstance(leaf, torch.Tensor)
                                          else leaf for leaf in flat))
        return (loss, *[leaf.detach() for leaf in flat if isinstance(leaf, torch.Tensor) and leaf is not loss])


def _as_call(model, example_inputs, name) -> tuple:
    """``(args, kwargs)`` from a tensor, a tuple of arguments or a dict of keyword arguments; ``use_cache=False``
    added for a forward that takes it."""
    if isinstance(example_inputs, dict):
        args, kwargs = (), dict(example_inputs)
    elif isinstance(example_inputs, (tuple, list)):
        args, kwargs = tuple(example_inputs), {}
    elif isinstance(example_inputs, torch.Tensor):
        args, kwargs = (example_inputs,), {}
    else:
        raise MemschedError(f"{name}: example inputs must be a tensor, a tuple of positional arguments or a dict of "
                            f"keyword arguments, got {type(example_inputs).__name__}")
    kwargs = _with_defaults(model, kwargs)
    if not _tensor_leaves(tree_flatten((args, kwargs))[0]):
        raise MemschedError(f"{name}: the example inputs hold no tensor")
    return args, kwargs


def _with_defaults(model, kwargs: dict) -> dict:
    """``kwargs`` sorted by name (the order a caller writes them in does not matter), ``use_cache=False`` added
    for a forward that takes it."""
    kwargs = dict(sorted(kwargs.items()))
    with contextlib.suppress(TypeError, ValueError):
        if "use_cache" in inspect.signature(model.forward).parameters and "use_cache" not in kwargs:
            kwargs = dict(sorted({**kwargs, "use_cache": False}.items()))
    return kwargs


def _as_dict(example_inputs) -> dict:
    return example_inputs if isinstance(example_inputs, dict) else {}


def _tensor_leaves(leaves) -> list:
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


def _reference_run(step, tensors, name) -> tuple:
    """``(written buffers, loss)``: the unmodified model's loss at :data:`VERIFY_SEED` without autograd, and the
    names of the buffers that run wrote (their version counter or their values moved); state restored after."""
    buffers = dict(step.named_buffers(remove_duplicate=False))
    versions = {key: (buffer._version, buffer.clone()) for key, buffer in buffers.items()}
    with _verifying(step, tensors):
        try:
            loss = returned_loss(step(*tensors))
        except MemschedError:
            raise
        except Exception as exc:  # the user's model: any failure is theirs to fix
            raise ExampleFailed(f"{name}: the model failed on its example inputs: {type(exc).__name__}: "
                                f"{_one_line(exc)}") from None
        # a kernel may write a buffer without moving its version counter (CPU BatchNorm's statistics)
        written = {key for key, buffer in buffers.items() if buffer._version != versions[key][0]
                   or not (_fake(buffer) or torch.equal(buffer, versions[key][1]))}
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        raise MemschedError(f"{name}: the loss must be a floating-point scalar tensor, got "
                            f"{_describe(loss)}: pass loss_fn(output) returning one")
    return written, loss


def _export(step, tensors, name) -> torch.fx.GraphModule:
    """The step captured by ``torch.export`` (non-strict), its parameters and buffers the model's own."""
    try:
        with warnings.catch_warnings(), interrupts_deferred():  # (a Ctrl-C inside the capture aborted the process)
            warnings.simplefilter("ignore")
            program = torch.export.export(step, tuple(tensors), strict=False)
            program = with_autocast_casts(program, _device(tensors).type)  # autocast's casts as ops, when on
    except Exception as exc:  # noqa: BLE001 (every failure of the capture is reported in one line)
        raise MemschedError(capture_refusal(name, exc)) from None
    return eager_batch_norm(program.module())


# --------------------------------------------------------------------------------------------------
# The check


def _check_staged(discovery, tensors, reference, model) -> None:
    """The staged forward's loss must equal the unmodified model's, bit for bit (same seed, no autograd)."""
    staged = discovery.staged
    if _fake(reference):  # an estimate (fake tensors) has no values to compare
        return
    with _verifying(model, tensors):
        loss = returned_loss(run_stages(staged.stages, tuple(discovery.prelude(*tensors))))
    if not torch.equal(loss.reshape(()), reference.reshape(())):
        raise MemschedError(f"{staged.name}: the discovered stages compute the loss {float(loss)!r} where the model "
                            f"computes {float(reference)!r}; give the stages by hand (a list of modules)")


@contextlib.contextmanager
def _verifying(module, tensors):
    """The conditions both sides of the check run in: no autograd, :data:`VERIFY_SEED`, and ``module``'s
    buffers, gradients and random state restored afterwards."""
    with preserved_state([module], _device(tensors)), torch.no_grad():
        torch.manual_seed(VERIFY_SEED)
        yield


def _storage_bytes(nodes, loss) -> int:
    """Bytes of the storages of ``nodes``' captured values, each once, ``loss``'s left out."""
    sizes = {}
    for node in (loss, *nodes):
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            sizes.setdefault(value.untyped_storage()._cdata, 0 if node is loss else value.untyped_storage().nbytes())
    return sum(sizes.values())


def _fake(tensor) -> bool:
    return isinstance(tensor, FakeTensor)


def _device(tensors):
    return tensors[0].device if tensors else torch.device("cpu")


def _leaf_spec(leaf):
    """What must match in an input leaf: a tensor's spec and device, any other value itself."""
    return (TensorSpec.of(leaf), str(leaf.device)) if isinstance(leaf, torch.Tensor) else leaf


def _shown(spec) -> str:
    return f"{spec[0]} on {spec[1]}" if isinstance(spec, tuple) and spec and isinstance(spec[0], TensorSpec) \
        else repr(spec)


def _arguments(treespec) -> str:
    args, kwargs = tree_unflatten([None] * treespec.num_leaves, treespec)
    return f"{len(args)} positional and keywords ({', '.join(kwargs) or 'none'})"


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def _one_line(exc) -> str:
    return " ".join(str(exc).split())
