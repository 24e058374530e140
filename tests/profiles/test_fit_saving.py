"""A fitted model saved whole and loaded back (profiles/fit_saving.py), and its state dict loaded into an unmodified
model: ``torch.save(fitted)`` failed on a progress lambda (issue 40, item 3), and the model it saved with progress
on had lost its forward ("missing the required forward function")."""

import copy
import io

import torch

from checks import raises_one_line
from discovery_models import MODELS
from planner import fit

QUICK = dict(warmup=0, repeats=1, stage_options=0)


def saved_and_loaded(fitted):
    buffer = io.BytesIO()
    torch.save(fitted, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def grads(module) -> list:
    return [p.grad.clone() for p in module.parameters()]


def test_a_fitted_model_saved_whole_trains_by_its_plan_when_loaded():
    model, batch, _ = MODELS["gpt2"]()
    for progress in (False, print):  # (the lambda fit makes for progress=False, the caller's own callable)
        fitted = fit(copy.deepcopy(model), batch, "50%", progress=progress, **QUICK)
        loaded = saved_and_loaded(fitted)
        assert loaded.plan.to_dict() == fitted.plan.to_dict() and loaded.predicted == fitted.predicted
        torch.manual_seed(1)  # (its dropout draws as the original's)
        out = loaded(**batch)
        assert type(out.loss.grad_fn).__name__ == "_CaptureBackward"  # the plan's backward, not the model's
        out.loss.backward()
        torch.manual_seed(1)
        fitted(**batch).loss.backward()
        torch.testing.assert_close(grads(loaded), grads(fitted), rtol=0, atol=0)
        assert all(p.grad is None for p in model.parameters())  # each copy's own parameters
    # its state dict loads into the unmodified model, keys and values
    fresh = copy.deepcopy(model)
    fresh.load_state_dict(loaded.state_dict())
    for (name, mine), theirs in zip(fresh.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(mine, theirs), name


def test_what_a_saved_model_cannot_carry_is_refused_in_one_line():
    model, batch, _ = MODELS["gpt2"]()
    fitted = fit(model, batch, "90%", graph=True, progress=False, **QUICK)
    message = raises_one_line(torch.save, fitted, io.BytesIO())
    assert "graph=True" in message and "state_dict()" in message
