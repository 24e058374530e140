"""A fitted model in an ordinary training loop (profiles/fit.py): the model's output comes back (the logits held
across the backward at the predicted peak), eval mode and ``torch.no_grad()`` run the model itself, the state
dict is the model's, and Hugging Face's ``Trainer`` trains it with no wrapper, as it trains the model."""

import copy

import pytest
import torch

from checks import one_line
from discovery_models import MODELS
from planner.errors import MemschedError
from planner.execute.live_memory import LiveMemoryTracker

pytest.importorskip("transformers")
QUICK = dict(warmup=0, repeats=1, stage_options=0)  # one profiling run per stage: the tests need bytes, not seconds


@pytest.fixture(scope="module")
def gpt2():
    model, batch, _ = MODELS["gpt2"]()
    return model, batch


def _planned(output) -> bool:
    """Whether ``output``'s loss came from the plan (its backward is the plan's)."""
    return type(output.loss.grad_fn).__name__ == "_CaptureBackward"


def test_the_call_returns_the_models_output_and_holding_it_measures_the_prediction(gpt2, threads):
    """``out = fitted(**batch)``: the model's output type, its logits, the loss with the plan's backward; the
    logits held across ``out.loss.backward()`` are in the prediction (within 1% of the measured peak), after an
    evaluation as before it."""
    import solvers
    from planner import fit
    from planner.execute.chain import apply_plan
    from profiles.memory import storage_bytes
    from solvers.minimum import minimum_budget

    model, batch = gpt2
    model, twin = copy.deepcopy(model), copy.deepcopy(model)
    fitted = fit(model, batch, "50%", **QUICK)
    torch.manual_seed(0)
    out = fitted(**batch)
    torch.manual_seed(0)
    expected = twin(**batch, use_cache=False)  # as fit runs Hugging Face models: no generation cache
    assert type(out) is type(expected) and list(out.keys()) == list(expected.keys()) == ["loss", "logits"]
    assert _planned(out) and not out.logits.requires_grad
    assert torch.equal(out.loss.detach(), expected.loss.detach()) and torch.equal(out.logits, expected.logits)
    assert out["loss"] is out.loss and out[0] is out.loss  # as Trainer reads it
    out.loss.backward()
    expected.loss.backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad), name
    model.zero_grad(set_to_none=True)

    logits = storage_bytes([out.logits])
    assert fitted.discovery.returned_bytes == logits
    del out
    fitted.eval()  # an evaluation in between: train() brings the plan back
    with torch.no_grad():
        fitted(**batch)
    fitted.train()
    assert _planned(fitted(**batch))
    inputs = fitted.discovery.chain_inputs((), batch)  # the prelude's values, made before the window
    with LiveMemoryTracker() as tracker:
        out = fitted.discovery.output(fitted._current.run(*inputs))
        out.loss.backward()  # the output held: its logits live to the end of the step
        assert tracker.current >= logits
    model.zero_grad(set_to_none=True)
    measured = tracker.peak + storage_bytes(list(inputs))
    assert abs(measured / fitted.predicted.peak_bytes - 1) <= 0.01, (threads, measured, fitted.predicted)

    # at the least budget the peak comes after the last stage's backward, where only the caller holds the logits
    # (without counting them the prediction was 0.92 of this one)
    least = solvers.solve(fitted.chain, minimum_budget(fitted.chain), "rotor")
    run = apply_plan(fitted.discovery.staged.stages, least, fitted.chain)
    del out
    with LiveMemoryTracker() as tracker:
        out = fitted.discovery.output(run(*inputs))
        out.loss.backward()
    model.zero_grad(set_to_none=True)
    measured = tracker.peak + storage_bytes(list(inputs))
    assert abs(measured / least.predicted.peak_bytes - 1) <= 0.01, (threads, measured, least.predicted)


def test_an_output_without_the_loss_returns_the_loss_or_fails_in_one_line():
    from planner import fit

    model, pixels, loss_fn = MODELS["vit"]()
    fitted = fit(model, pixels, "80%", loss_fn=loss_fn, **QUICK)  # the output is the logits: the call returns the loss
    loss = fitted(pixels)
    assert loss.dim() == 0 and fitted.returns == "loss"
    loss.backward()
    model.zero_grad(set_to_none=True)
    with pytest.raises(MemschedError, match=r"does not hold the loss.*returns='loss'") as error:
        fit(model, pixels, "80%", loss_fn=loss_fn, returns="output", **QUICK)
    one_line(error)
    model, batch, _ = MODELS["gpt2"]()
    assert fit(model, batch, "80%", returns="loss", **QUICK)(**batch).dim() == 0


def test_eval_and_no_grad_run_the_model_itself_and_train_brings_the_plan_back():
    """ConvNeXt-like (BatchNorm statistics, stochastic depth; a dict with the loss and logits): in eval mode,
    with and without gradients, the fitted model is the unmodified model in eval mode (no statistic updated);
    under no_grad in training mode it is the model too; ``train()`` brings the plan back, losses and
    statistics those of the unmodified model."""
    from planner import fit

    model, batch, _ = MODELS["convnext"]()
    twin = copy.deepcopy(model)
    fitted = fit(model, batch, "60%", **QUICK)
    statistics = [b.clone() for b in model.buffers()]

    for evaluate in (fitted.eval, model.eval):
        fitted.train()
        evaluate()
        twin.eval()
        for grad in (False, True):
            with torch.set_grad_enabled(grad):
                out, expected = fitted(*batch), twin(*batch)
            assert type(out) is dict and not _planned_dict(out)
            assert torch.equal(out["logits"], expected["logits"]) and torch.equal(out["loss"], expected["loss"])
        assert all(torch.equal(b, s) for b, s in zip(model.buffers(), statistics))  # eval updates nothing

    fitted.train()
    twin.train()
    with torch.no_grad():  # training mode, no gradients: the model itself (its statistics move as the twin's)
        torch.manual_seed(1)
        out = fitted(*batch)
        torch.manual_seed(1)
        expected = twin(*batch)
    assert torch.equal(out["loss"], expected["loss"])
    for step in range(2):
        torch.manual_seed(10 + step)
        out = fitted(*batch)
        torch.manual_seed(10 + step)
        expected = twin(*batch)
        assert _planned_dict(out) and torch.equal(out["loss"].detach(), expected["loss"].detach()), step
        out["loss"].backward()
        expected["loss"].backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad), name
    for (name, b), c in zip(model.named_buffers(), twin.buffers()):
        assert torch.equal(b, c), name


def _planned_dict(output) -> bool:
    return type(output["loss"].grad_fn).__name__ == "_CaptureBackward"


def test_a_module_left_in_another_mode_fails_in_one_line(gpt2):
    from planner import fit

    model, batch = gpt2
    fitted = fit(model, batch, "80%", **QUICK)
    model.transformer.h[1].eval()
    try:
        with pytest.raises(MemschedError, match=r"transformer\.h\.1 is in eval mode.*fitted\.eval\(\)") as error:
            fitted(**batch)
        one_line(error)
    finally:
        model.train()


def test_the_state_dict_is_the_models_own(gpt2):
    """Keys without a prefix, loaded by an unmodified model and back; ``assign=True`` refused in one line."""
    from planner import fit

    model, batch = gpt2
    model, other = copy.deepcopy(model), copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.01)
    fitted = fit(model, batch, "50%", **QUICK)
    state = fitted.state_dict()
    assert list(state) == list(model.state_dict())
    fresh = copy.deepcopy(other)
    fresh.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    fitted.load_state_dict(other.state_dict())  # copied into the tensors the plan's stages hold
    torch.manual_seed(0)
    out = fitted(**batch)
    torch.manual_seed(0)
    expected = other(**batch)
    assert torch.equal(out.loss.detach(), expected.loss.detach())
    out.loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    model.zero_grad(set_to_none=True)
    with pytest.raises(MemschedError, match=r"assign=True.*load without assign") as error:
        fitted.load_state_dict(other.state_dict(), assign=True)
    one_line(error)
    assert fitted.to("cpu") is fitted and fitted.to(torch.float32) is fitted  # moves nothing: itself


def test_hugging_face_trainer_trains_the_fitted_model_as_the_model(tmp_path):
    """Three steps of ``Trainer`` on a tiny in-memory data set, the fitted model given as it is: the logged losses
    and the parameters are those of the unmodified model behind an identical Trainer."""
    pytest.importorskip("accelerate")  # Trainer's own requirement (the test extra installs it)
    from transformers import default_data_collator

    from hf_trainer import trainer_losses
    from planner import fit

    model, _, _ = MODELS["gpt2"]()
    twin = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(7)
    data = []
    for k in range(6):
        ids = torch.randint(0, 256, (32,), generator=generator)
        mask = torch.ones(32, dtype=torch.long)
        mask[20 + k:] = 0
        data.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    fitted = fit(model, default_data_collator(data[:2]), "60%", **QUICK)

    def train(module, folder):
        return trainer_losses(module, data, str(tmp_path / folder), steps=3, batch_size=2, lr=1e-2, seed=3)

    ours, theirs = train(fitted, "fitted"), train(twin, "twin")
    assert "num_items_in_batch" in fitted.discovery.keywords  # Trainer's loss argument, planned for at its first
    assert len(ours) == 3 and ours == theirs
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), name


def test_a_deep_copy_of_a_fitted_model_runs_by_its_own_parameters(gpt2):
    """``copy.deepcopy(fitted)`` (as tests and checkpoints make) calls the copy's plan on the copy's parameters:
    its gradients land on its own, none on the original's, and its output is rebuilt as the model's."""
    from planner import fit

    model, batch = gpt2
    fitted = fit(copy.deepcopy(model), batch, "50%", **QUICK)
    copied = copy.deepcopy(fitted)
    out = copied(**batch)
    assert type(out) is type(fitted(**batch)) and _planned(out)
    out.loss.backward()
    assert all(p.grad is None for p in fitted.parameters())
    assert all(p.grad is not None for p in copied.parameters())
