"""A fitted model saved whole and loaded back (``torch.save(fitted)``, ``torch.load``, ``copy.deepcopy``): what is
kept and what is made again.

A :class:`profiles.fit.FittedModel` holds the model, its discovered stages (``torch.fx`` graph modules referring
to the model's own parameters: one pickle keeps them one tensor each), each plan with its chain, and the module
that runs each plan. That module is made by :func:`planner.execute.chain.apply_plan` from the stages, the plan
and the chain, and holds hooks and closures that cannot be pickled; so it is left out (:func:`state_to_save`)
and made again from what was saved (:func:`restore`), as ``fit`` made it. So are the two things that belong to
the session that fitted: the progress callable (the caller's, or the terminal's: a loaded model says nothing)
and the bound ``forward`` with the model's signature (:func:`forward_as`). What a saved model cannot carry is
refused in one line: a graph plan (its executor is made from the profiled joint graph, not kept) and a sharded
step (its stages are sharded over the ranks of a job that has ended).
"""

import dataclasses
import inspect
import types

from planner.errors import MemschedError
from planner.execute.chain import apply_plan


def forward_as(model):
    """A ``forward(self, *args, **kwargs)`` calling ``self._forward``, its signature and docstring ``model``'s. Bound
    to the fitted model as a method (at fit, and again when loaded)."""
    def forward(self, *args, **kwargs):
        return self._forward(*args, **kwargs)

    signature = inspect.signature(model.forward)
    itself = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    forward.__signature__ = signature.replace(parameters=[itself, *signature.parameters.values()])
    forward.__doc__ = model.forward.__doc__
    return forward


def state_to_save(fitted) -> dict:
    """``fitted.__dict__`` as a pickle keeps it: each plan's run, the progress callable and the bound forward left
    out, the current plan by its place among the plans; a graph plan or a sharded step refused in one line."""
    for planned in fitted._plans:
        if planned.predicted is not None:
            raise MemschedError("a model fitted with graph=True cannot be saved whole (its graph executor is made "
                                "from the profiled joint graph): save fitted.state_dict(), and fit again to train")
        if planned.plan.setup.sharded:
            raise MemschedError("a model fitted for a sharded step cannot be saved whole (its stages are sharded over "
                                "the job's ranks): save fitted.state_dict() on each rank, or the model's own")
    state = {key: value for key, value in fitted.__dict__.items() if key not in ("forward", "_say", "_current")}
    state["_plans"] = [dataclasses.replace(planned, run=None) for planned in fitted._plans]
    state["_current_index"] = next(k for k, planned in enumerate(fitted._plans) if planned is fitted._current)
    return state


def restore(fitted, state: dict) -> None:
    """``fitted`` made from what :func:`state_to_save` kept: each plan's run made again by ``apply_plan`` from its
    stages, plan and chain (with fit's ``compile``, optimizer and learning rate), quiet, its forward bound."""
    state = dict(state)
    current = state.pop("_current_index")
    fitted.__dict__.update(state)
    settings = fitted._settings
    fitted._plans = [dataclasses.replace(planned, run=apply_plan(
        planned.discovery.staged.stages, planned.plan, planned.chain, compile=settings["compile"],
        optimizer=settings["options"]["optimizer"], lr=settings["options"]["lr"])) for planned in fitted._plans]
    fitted._current = fitted._plans[current]
    fitted._say = _quiet
    fitted.forward = types.MethodType(forward_as(fitted._modules["model"]), fitted)


def _quiet(line: str) -> None:
    """A loaded model's progress: nothing (the session that fitted it has ended)."""
