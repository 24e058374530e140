"""The one line that says why ``torch.export`` could not capture a model's forward: the line of the model where it
stopped, what stopped it, and what to do (issue 40, item 5).

torch's own message runs to 500+ characters and points into torch (``_export/non_strict_utils.py``); the line that
matters is the model's: the innermost frame of the failure's traceback (or of the exceptions it was raised from)
that is neither torch's, nor Python's library, nor memsched's. A guard on a data-dependent value (a branch or a
shape decided by the batch's values, as DeBERTa-v2's loss does with ``(labels >= 0).nonzero()``) is the usual cause;
when the line belongs to a loss the model computes from the batch's labels, capturing the forward without them and
computing the loss outside the model (``loss_fn=``) avoids it.
"""

import os
import sysconfig
import traceback

import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_NOT_THE_MODELS = tuple(os.path.realpath(path) + os.sep for path in (
    os.path.dirname(torch.__file__), *(os.path.join(_ROOT, package) for package in ("planner", "profiles", "solvers"))))
_LIBRARY = os.path.realpath(sysconfig.get_paths()["stdlib"]) + os.sep
_INSTALLED = tuple(os.path.realpath(sysconfig.get_paths()[key]) + os.sep for key in ("purelib", "platlib"))
DATA_DEPENDENT = ("data-dependent", "data dependent", "GuardOnDataDependentSymNode", "DataDependentOutputException")
MOST = 160  # characters of torch's message kept


def capture_refusal(name: str, exc: BaseException) -> str:
    """``{name}: stage discovery cannot capture the forward with torch.export at FILE:LINE (`code`): what; fix``."""
    frame = _models_frame(exc)
    where = f" at {os.path.basename(frame.filename)}:{frame.lineno} (`{(frame.line or '').strip()}`)" if frame else ""
    text = " ".join(f"{type(exc).__name__} {exc}".split())
    if any(word in text for word in DATA_DEPENDENT):
        labels = frame is not None and "label" in (frame.line or "")
        fix = ("capture the forward without the labels: call fit with the batch less its labels and loss_fn= "
               "computing the loss from the output (as your loop then does)" if labels else
               "give the stages by hand (a list of modules), or make that line independent of the batch's values")
        return (f"{name}: stage discovery cannot capture the forward with torch.export{where}: a value computed "
                f"from the batch decides a branch or a shape there (torch: a guard on a data-dependent value); {fix}")
    brief = " ".join(str(exc).split())[:MOST] or type(exc).__name__
    return (f"{name}: stage discovery cannot capture the forward with torch.export{where}: "
            f"{type(exc).__name__}: {brief}; give the stages by hand (a list of modules)")


def _models_frame(exc):
    """The innermost frame of the model's own code in ``exc``'s traceback or in those it was raised from."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if _models(f.filename)]
        if frames:
            return frames[-1]
        exc = exc.__cause__ or exc.__context__
    return None


def _models(filename: str) -> bool:
    """Whether ``filename`` may be the model's code: not torch's nor memsched's, not generated, and not Python's
    library unless an installed package (transformers in a Python without a virtual environment)."""
    path = os.path.realpath(filename)
    if filename.startswith("<") or path.startswith(_NOT_THE_MODELS):
        return False
    return not path.startswith(_LIBRARY) or path.startswith(_INSTALLED)
