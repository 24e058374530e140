"""``fit(..., autocast=...)`` (profiles/precision.py): a step planned, profiled and run under the autocast state the
user trains with, on unmodified Hugging Face GPT-2 and Llama: the unmodified model's losses and gradients under
the same autocast, bit for bit; the measured peak of the user's loop (forward under autocast, backward after it)
within 1% of the prediction; fp16 with ``torch.amp.GradScaler``; a call under another autocast state refused in
one line."""

import copy

import pytest
import torch

from checks import one_line
from discovery_models import MODELS
from planner.errors import MemschedError
from planner.execute.live_memory import LiveMemoryTracker

pytest.importorskip("transformers")
QUICK = dict(warmup=0, repeats=1, stage_options=0)  # the profiler's times do not matter here, its bytes do


def _bf16():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _fitted(name, budget, at_fit, **settings):
    """``(model, twin, batch, fitted)``: a fresh model fitted for bf16 autocast, given as ``fit(...,
    autocast=torch.bfloat16)`` (``at_fit`` False) or as the state active at ``fit`` (``at_fit`` True), and an
    unmodified copy."""
    from planner import fit

    model, batch, _ = MODELS[name]()
    twin = copy.deepcopy(model)
    if at_fit:
        with _bf16():
            fitted = fit(model, batch, budget, **settings)
    else:
        fitted = fit(model, batch, budget, autocast=torch.bfloat16, **settings)
    return model, twin, batch, fitted


@pytest.fixture(scope="module")
def bf16_fits():
    """``{model name: _fitted(name, "50%", at_fit=False, **QUICK)}``, fitted on first use (the training test
    steps them; the refusal test only calls one)."""
    fits = {}

    def fitted(name):
        if name not in fits:
            fits[name] = _fitted(name, "50%", False, **QUICK)
        return fits[name]

    return fitted


def _trains_as_the_twin(model, twin, ours, theirs, steps: int = 3) -> None:
    """``steps`` Adam steps of ``model`` by ``ours()`` (the fitted model's loss) and of its unmodified ``twin`` by
    ``theirs()``, each forward under bf16 autocast at the same seed: losses and gradients equal bit for bit."""
    optimizers = torch.optim.Adam(model.parameters(), lr=1e-2), torch.optim.Adam(twin.parameters(), lr=1e-2)
    for step in range(steps):
        losses = []
        for forward in (ours, theirs):
            torch.manual_seed(step)
            with _bf16():
                loss = forward()
            loss.backward()
            losses.append(loss.detach())
        assert torch.equal(*losses), (step, losses)
        for (key, p), q in zip(model.named_parameters(), twin.parameters()):
            assert torch.equal(p.grad, q.grad), (step, key)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_bf16_autocast_trains_with_the_unmodified_models_losses_and_gradients(bf16_fits, name):
    """Three Adam steps: loss, every gradient and every parameter equal to the unmodified model's under the same
    autocast, bit for bit (the casts are the model's own, made as ops of the stages; dropout drawn alike)."""
    model, twin, batch, fitted = bf16_fits(name)
    assert fitted.plan.recomputed_forwards > 0
    _trains_as_the_twin(model, twin, lambda: fitted(**batch).loss, lambda: twin(**batch).loss)
    for (key, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), key


def test_a_bf16_step_measures_its_prediction(threads):
    """The user's loop, forward under the autocast active at ``fit`` and backward after it, peaks within 1% of the
    prediction (autocast's cache of cast weights, 5-8% of it when the stages ran fp32 graphs under autocast,
    stays empty: each cast is a value of the stage that makes it)."""
    from profiles.memory import storage_bytes

    model, _, batch, fitted = _fitted("gpt2", "45%", True, warmup=0, repeats=1, stage_options=2)
    assert fitted.plan.recomputed_forwards > 0
    with _bf16():
        inputs = fitted.discovery.chain_inputs((), batch)  # the prelude's values, made before the window
    with LiveMemoryTracker() as tracker:
        with _bf16():
            output = fitted.discovery.output(fitted._current.run(*inputs))
        output.loss.backward()  # the output held: its logits live to the end of the step
        del output
    model.zero_grad(set_to_none=True)
    measured = tracker.peak + storage_bytes(list(inputs))
    assert abs(measured / fitted.predicted.peak_bytes - 1) <= 0.01, (threads, measured, fitted.predicted)


def test_a_call_under_another_autocast_state_is_refused_in_one_line(bf16_fits):
    from planner import fit

    model, _, batch, fitted = bf16_fits("gpt2")
    plain = fit(copy.deepcopy(model), batch, "80%", **QUICK)  # fitted without autocast: called under it, refused
    with _bf16(), pytest.raises(MemschedError, match="called under bfloat16 autocast on cpu, but it was fitted "
                                                     r"under no autocast.*fit\(\.\.\., autocast=\.\.\.\)"):
        plain(**batch)  # not a "Tensor dtype mismatch" from inside the graph
    assert str(fitted.precision) == "bfloat16 autocast on cpu"
    for state, named in ((torch.autocast("cpu", enabled=False), "no autocast"),
                         (torch.autocast("cpu", dtype=torch.float16), "float16 autocast on cpu")):
        with state, pytest.raises(MemschedError, match=f"called under {named}, but it was fitted under bfloat16 "
                                                       f"autocast on cpu") as error:
            fitted(**batch)
        one_line(error)
    with pytest.raises(MemschedError, match="fit autocast must be torch.bfloat16, torch.float16"):
        fit(model, batch, "80%", autocast=torch.float64)


def test_fp16_with_a_grad_scaler_trains_as_the_unmodified_model():
    """``scaler.scale(loss).backward()`` runs the plan on the scaled loss: over three steps of ``scaler.step`` /
    ``update``, the losses, the scaled gradients, the parameters and the scale equal the unmodified model's with
    its own scaler, bit for bit."""
    from planner import fit

    model, batch, _ = MODELS["gpt2"]()
    twin, initial = copy.deepcopy(model), copy.deepcopy(model)
    fitted = fit(model, batch, "50%", autocast=torch.float16, **QUICK)
    assert fitted.plan.recomputed_forwards > 0
    runs = [(lambda: fitted(**batch).loss, model, torch.optim.Adam(model.parameters(), lr=1e-2)),
            (lambda: twin(**batch).loss, twin, torch.optim.Adam(twin.parameters(), lr=1e-2))]
    scalers = torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")
    for step in range(3):
        losses = []
        for (forward, _, _), scaler in zip(runs, scalers):
            torch.manual_seed(step)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = forward()
            scaler.scale(loss).backward()
            losses.append(loss.detach())
        assert losses[0].dtype == torch.float32 and torch.equal(*losses), (step, losses)
        for (key, p), q in zip(model.named_parameters(), twin.parameters()):
            assert torch.equal(p.grad, q.grad), (step, key)
        for (_, _, optimizer), scaler in zip(runs, scalers):
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
        assert scalers[0].get_scale() == scalers[1].get_scale(), step
    for (key, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), key
    assert not torch.equal(model.lm_head.weight, initial.lm_head.weight)  # the scaler stepped (no overflow)


def test_batch_norm_under_bf16_autocast_trains_as_the_unmodified_model_and_splits_across_it(threads):
    """A ConvNeXt-like model with BatchNorm (its running statistics updated in place, as eager does, not written
    back at the graph's end: profiles/precision.py's ``eager_batch_norm``) under bf16 autocast: stages cut between
    blocks across the normalisations (a block whose input only a cast reads is no cut: nothing saves that input),
    three Adam steps equal to the unmodified model's (loss, gradients, parameters and running statistics, bit for
    bit), and the step's peak within 1% of the prediction."""
    from planner import fit

    model, batch, _ = MODELS["convnext"]()
    twin = copy.deepcopy(model)
    fitted = fit(model, batch, "85%", autocast=torch.bfloat16, returns="loss", **QUICK)
    names = [stage.name for stage in fitted.chain.stages]  # a BatchNorm with the convolution after it (below)
    assert {"stages.1[0,1]", "stages.1[2,3]"} <= set(names) and len(names) >= 8, names  # 4, statistics written back
    assert fitted.plan.recomputed_forwards > 0
    measured = _bf16_step_peak(fitted, batch)
    assert abs(measured / fitted.predicted.peak_bytes - 1) <= 0.01, (threads, measured, fitted.predicted)
    model.load_state_dict(twin.state_dict())  # that step updated the statistics: start again from the twin's
    model.zero_grad(set_to_none=True)
    _trains_as_the_twin(model, twin, lambda: fitted(*batch), lambda: twin(*batch)["loss"])
    for (key, value), expected in zip(model.state_dict().items(), twin.state_dict().values()):
        assert torch.equal(value, expected), key  # parameters and running statistics alike


def test_a_bf16_convnext_is_cut_only_where_autograd_keeps_the_value_and_measures_its_prediction(threads):
    """Under bf16 autocast a downsampling BatchNorm's fp32 output is read only by the next convolution's cast,
    which autograd saves instead: nothing keeps that output, so no stage ends there (the cut check ran the
    normalisation with its running statistics requiring a gradient, which it refused, and cut there; the chain
    then held the output to the next backward and the store-all step was predicted 4.7% over its measured peak).
    Each BatchNorm runs in the stage of the convolution after it, and the step peaks within 1% of the
    prediction."""
    from planner import fit

    model, batch, _ = MODELS["convnext"]()
    fitted = fit(model, batch, "100%", autocast=torch.bfloat16, returns="loss", progress=False, **QUICK)
    names = [stage.name for stage in fitted.chain.stages]
    assert "stages.1.0" not in names and "stages.2.0" not in names and len(names) >= 6, names
    measured = _bf16_step_peak(fitted, batch)
    model.zero_grad(set_to_none=True)
    assert abs(measured / fitted.predicted.peak_bytes - 1) <= 0.01, (threads, measured, fitted.predicted)


def _bf16_step_peak(fitted, batch) -> int:
    """Bytes: the peak of one planned step of ``fitted`` on the positional ``batch``, its forward under bf16
    autocast, the prelude's values (made before the window) counted."""
    from profiles.memory import storage_bytes

    with _bf16():
        inputs = fitted.discovery.chain_inputs(batch, {})
    torch.manual_seed(0)
    with LiveMemoryTracker() as tracker:
        with _bf16():
            loss = fitted._current.run(*inputs)
        loss.backward()
    return tracker.peak + storage_bytes(list(inputs))
