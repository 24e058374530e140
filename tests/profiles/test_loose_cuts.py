"""Cuts whose value no backward keeps (profiles/loose_cuts.py): discovery joins the two stages around them, and the
plan's peak is then what the model predicts (a LoRA Llama measured 0.96 of its prediction before:
tests/profiles/test_fit_families.py measures it in a fresh process)."""

import torch
from torch import nn

from planner.execute.live_memory import LiveMemoryTracker
from profiles.discover import discover
from profiles.loose_cuts import loose_cuts
from profiles.memory import storage_bytes


def _model(frozen: bool):
    """Linear, GELU three times, then a head: the middle two linears frozen when ``frozen`` (a frozen matrix
    product saves no input, and GELU saves its input, not its result)."""
    torch.manual_seed(0)
    layers = [nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
              nn.Linear(64, 10)]
    if frozen:
        for layer in (layers[2], layers[4]):
            layer.requires_grad_(False)
    model = nn.Sequential(*layers)
    return model, torch.randn(512, 64)


def test_the_stages_around_a_cut_no_backward_keeps_are_one():
    trained, batch = _model(frozen=False)
    plain = discover(trained, batch)
    assert len(plain.staged.stages) == 4 and loose_cuts(plain.staged.stages, plain.staged.example_inputs) == []
    frozen, _ = _model(frozen=True)
    joined = discover(frozen, batch)
    assert [name for name, _ in joined.staged.stages] != [name for name, _ in plain.staged.stages]
    assert len(joined.staged.stages) == 2, joined.describe()
    assert loose_cuts(joined.staged.stages, joined.staged.example_inputs) == []


def test_the_loose_cuts_of_stages_as_they_were_cut_before():
    frozen, batch = _model(frozen=True)
    stages = [("first", frozen[:2]), ("second", frozen[2:4]), ("third", frozen[4:6]), ("head", frozen[6:])]
    assert loose_cuts(stages, (batch,)) == [1, 2]
    assert all(not isinstance(p, torch._subclasses.fake_tensor.FakeTensor) for p in frozen.parameters())


def test_a_fitted_model_with_frozen_layers_peaks_at_its_prediction():
    from planner import fit

    model, batch = _model(frozen=True)
    fitted = fit(model, batch, "90%", loss_fn=lambda out: out.square().mean(), warmup=0, repeats=1,
                 progress=False)
    inputs = fitted.discovery.chain_inputs((batch,), {})
    with LiveMemoryTracker() as tracker:
        fitted._current.run(*inputs).backward()
    measured = tracker.peak + storage_bytes(list(inputs))
    assert abs(measured / fitted.predicted.peak_bytes - 1) <= 0.01, (measured, fitted.predicted.peak_bytes)
