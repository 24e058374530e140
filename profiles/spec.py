"""What ``memsched profile SPEC`` names: a built-in model, or a factory in a Python file.

* ``gpt-tiny`` or ``gpt-tiny:layers=12,d=512``: a model of :mod:`profiles.zoo`;
* ``path/to/file.py:factory`` (``:build`` by default): ``factory()`` returns
  ``(stages, example_inputs)`` or ``(stages, example_inputs, loss_fn)``, where ``stages`` is the chain
  (an ``nn.Sequential``, an ``nn.ModuleList``, a list or a dict of modules); or ``(model, inputs)`` or
  ``(model, inputs, loss_fn)`` with any other ``nn.Module``, whose stages :mod:`profiles.discover` finds
  (``inputs``: a tensor, a tuple of positional arguments or a dict of keyword arguments).

``--batch N`` sets the built-in models' ``batch`` option, or is passed to the
factory as ``batch=N``. Every failure is a one-line :class:`MemschedError`.
"""

import contextlib
import importlib.util
import inspect
import itertools
import sys
from pathlib import Path

import torch

from planner.errors import MemschedError
from planner.execute.stages import StagedModel, batch_part, default_loss, named_stages, rank_slice
from profiles import zoo
from profiles.discover import discover
from profiles.fake_build import build_fake
from profiles.precision import Precision, named_dtype

_module_counter = itertools.count()


def load_model(spec: str, *, batch: int = None, estimate: bool = False, part: tuple = None, autocast: str = None,
               device_spec=None):
    """``(model, fake_mode)``: the :class:`planner.execute.stages.StagedModel` that ``spec`` names, its parameters,
    buffers and inputs fake tensors of one fresh ``FakeTensorMode`` when ``estimate`` (``fake_mode`` is then that
    mode, else None; see :func:`profiles.fake_build.build_fake`). ``part=(rank, world)``: on that data-parallel
    rank's part of the batch (planner/execute/stages.py's ``batch_part``), cut before the stages are found.
    ``autocast`` (``"bf16"``, ``"fp16"``): a whole model's step captured under that autocast (by CUDA's op lists
    for a CUDA ``device_spec``: profiles/precision.py), its stages computing in it."""
    precision = None if autocast is None else Precision("cpu", named_dtype(autocast, "--autocast")).for_target(
        device_spec)
    if _is_file_spec(spec):
        path, _, function = spec.partition(".py:") if ".py:" in spec else (spec[:-3], "", "build")
        factory = _file_factory(Path(path + ".py"), function or "build", batch)
        name = Path(path).stem
    else:
        model_name, options = zoo.parse_spec(spec)
        if batch is not None:
            options["batch"] = batch
        factory = lambda: zoo.build(model_name, **options)  # noqa: E731
        name = model_name
    if estimate:
        mode, built = _call(lambda: build_fake(factory), spec)
        return _as_model(built, name, spec, precision=precision), mode
    return _as_model(_call(factory, spec), name, spec, part, precision), None


def _is_file_spec(spec: str) -> bool:
    return spec.endswith(".py") or ".py:" in spec


def _file_factory(path: Path, function: str, batch):
    if not path.is_file():
        raise MemschedError(f"{path}: no such file (SPEC is a built-in model name or path/to/file.py:factory)")
    module_name = f"memsched_user_model_{next(_module_counter)}"
    loader_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[module_name] = module
    try:
        loader_spec.loader.exec_module(module)
    except Exception as exc:  # the user's file: any failure is theirs to fix
        raise MemschedError(f"{path}: importing it failed: {type(exc).__name__}: {_one_line(exc)}") from None
    factory = getattr(module, function, None)
    if not callable(factory):
        raise MemschedError(f"{path}: has no function {function!r} (write path/to/file.py:FUNCTION)")
    if batch is None:
        return factory
    if "batch" not in inspect.signature(factory).parameters:
        raise MemschedError(f"{path}:{function}() takes no 'batch' argument, so --batch cannot be applied; "
                            f"add one or drop --batch")
    return lambda: factory(batch=batch)


def _call(factory, spec):
    try:
        return factory()
    except MemschedError:
        raise
    except Exception as exc:
        raise MemschedError(f"{spec}: building the model failed: {type(exc).__name__}: {_one_line(exc)}") from None


def _as_model(built, name, spec, part=None, precision=None):
    if part is not None:  # the rank's part of the batch; a whole model's stages are then found on it
        if isinstance(built, tuple) and len(built) in (2, 3) and _is_plain_module(built[0]):
            built = (built[0], batch_part(built[1], *part), *built[2:])
        else:
            return rank_slice(_as_model(built, name, spec, precision=precision), *part)
    whole = isinstance(built, tuple) and len(built) in (2, 3) and _is_plain_module(built[0])
    if precision is not None and not whole:
        raise MemschedError(f"{spec}: --autocast captures a whole model's step under autocast, and this SPEC gives "
                            "its stages: return (model, inputs) from the factory, or drop --autocast")
    if isinstance(built, StagedModel):
        return built
    if not isinstance(built, tuple) or len(built) not in (2, 3):
        raise MemschedError(f"{spec}: the factory must return (stages, example_inputs), (model, inputs) "
                            f"or either with a loss_fn, "
                            f"got {type(built).__name__}"
                            + (f" of length {len(built)}" if isinstance(built, tuple) else ""))
    loss_fn = built[2] if len(built) == 3 else None
    if loss_fn is not None and not callable(loss_fn):
        raise MemschedError(f"{spec}: the factory's loss_fn must be callable, got {type(loss_fn).__name__}")
    if _is_plain_module(built[0]):
        with precision.capturing() if precision else contextlib.nullcontext():
            return discover(built[0], built[1], loss_fn, name=name).staged
    stages, example_inputs = built[0], built[1]
    if isinstance(example_inputs, dict):
        raise MemschedError(f"{spec}: keyword inputs (a dict) are for a whole model whose stages memsched finds; "
                            f"stages given as a list take a tensor or a tuple")
    return StagedModel(name=name, stages=named_stages(stages),
                       example_inputs=example_inputs if isinstance(example_inputs, tuple) else (example_inputs,),
                       loss_fn=loss_fn or default_loss)


def _is_plain_module(model) -> bool:
    """A whole model (stages to discover), not a container of stages."""
    return isinstance(model, torch.nn.Module) and not isinstance(model, (torch.nn.Sequential, torch.nn.ModuleList,
                                                                         torch.nn.ModuleDict))


def _one_line(exc) -> str:
    return " ".join(str(exc).split())


def built_model(spec: str, batch: int = None, part: tuple = None):
    """The model of ``spec`` alone (module level, so that ``functools.partial(built_model, spec)`` can be sent to
    worker processes)."""
    return load_model(spec, batch=batch, part=part)[0]
