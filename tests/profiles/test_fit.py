"""``fit(model, example_inputs, budget)`` (profiles/fit.py, ``from planner import fit``) and ``memsched train
FILE:build`` on an unmodified Hugging Face GPT-2 with tied embeddings, dropout, a padding mask and labels."""

import copy
import subprocess
import sys
import textwrap

import pytest
import torch

import cli
from checks import one_line
from discovery_models import MODELS
from paths import ROOT
from planner.errors import MemschedError
from planner.execute.live_memory import LiveMemoryTracker

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def gpt2():
    model, batch, _ = MODELS["gpt2"]()
    return model, batch


def test_fit_trains_three_adam_steps_with_the_unmodified_models_losses(gpt2):
    from planner import fit

    model, batch = gpt2
    model, twin = copy.deepcopy(model), copy.deepcopy(model)
    fitted = fit(model, batch, "45%")  # the logits it returns are held to the step's end: 40% is below the least
    assert fitted.plan.recomputed_forwards > 0
    assert fitted.predicted.peak_bytes <= fitted.plan.budget_bytes
    assert len(fitted.chain.stages) == len(fitted.discovery.report) >= 3
    assert {id(p) for p in fitted.parameters()} == {id(p) for p in model.parameters()}
    ours, theirs = torch.optim.Adam(fitted.parameters(), lr=1e-2), torch.optim.Adam(twin.parameters(), lr=1e-2)
    for step in range(3):
        torch.manual_seed(step)
        loss = fitted(**batch).loss  # the model's output, its loss's backward the plan's
        loss.backward()
        ours.step()
        ours.zero_grad()
        torch.manual_seed(step)
        expected = twin(**batch).loss
        expected.backward()
        theirs.step()
        theirs.zero_grad()
        assert torch.equal(loss.detach(), expected.detach()), step
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), name


def test_fit_with_the_update_in_the_backward_trains_as_adam_after_it(gpt2):
    """``fit(..., update="in-backward")``: the loop has no optimizer; the losses and parameters are torch.optim
    Adam's (to the rounding of the fused kernel against the default one)."""
    from planner import fit

    model, batch = gpt2
    model, twin = copy.deepcopy(model), copy.deepcopy(model)
    fitted = fit(model, batch, "40%", update="in-backward", optimizer="adam", lr=1e-2)
    assert fitted.plan.update == "in-backward"
    theirs = torch.optim.Adam(twin.parameters(), lr=1e-2)
    for step in range(3):
        torch.manual_seed(step)
        loss = fitted(**batch)
        loss.backward()
        assert all(p.grad is None for p in model.parameters())  # each freed once its update ran
        torch.manual_seed(step)
        expected = twin(**batch).loss
        expected.backward()
        theirs.step()
        theirs.zero_grad()
        assert float(loss.detach()) == pytest.approx(float(expected.detach()), rel=1e-5), step
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-4, msg=name)


def test_a_fitted_step_measures_its_prediction(gpt2, threads):
    from planner import fit
    from profiles.memory import storage_bytes

    model, batch = gpt2
    fitted = fit(model, batch, "50%", returns="loss")  # the loss alone (test_fit_loop.py holds the output)
    inputs = fitted.discovery.chain_inputs((), batch)  # the prelude's values, made before the window
    with LiveMemoryTracker() as tracker:
        fitted._current.run(*inputs).backward()
    model.zero_grad(set_to_none=True)
    measured = tracker.peak + storage_bytes(list(inputs))
    assert abs(measured / fitted.predicted.peak_bytes - 1) <= 0.01, (threads, measured, fitted.predicted)


def test_a_batch_of_other_shapes_fails_in_one_line_or_is_planned_for(gpt2):
    from planner import fit

    model, batch = gpt2
    fitted = fit(model, batch, "80%")
    short = {key: value[:, :16] if value.dim() == 2 else value for key, value in batch.items()}
    with pytest.raises(MemschedError, match=r"attention_mask is \(4, 16\) int64 on cpu, the plan was made for "
                                            r"\(4, 32\) int64 on cpu.*replan=True") as error:
        fitted(**short)
    one_line(error)
    with pytest.raises(MemschedError, match="inputs are not those the model was planned for"):
        fitted(input_ids=batch["input_ids"])
    replanning = fit(model, batch, "80%", replan=True)
    first = replanning.plan
    replanning(**short).loss.backward()
    assert replanning.plan is not first and replanning.chain.measured_on.inputs[0][1].shape == (4, 16)
    replanning(**batch).loss.backward()
    assert replanning.plan is first  # the plan made for this layout, kept
    model.zero_grad(set_to_none=True)


def test_moving_or_casting_a_fitted_model_is_refused_in_one_line(gpt2):
    from planner import fit

    model, batch = gpt2
    fitted = fit(model, batch, "80%")
    for move in (lambda: fitted.to(torch.float64), lambda: fitted.double()):
        with pytest.raises(MemschedError, match="move or cast the model and its batch first, then call fit"):
            move()
    assert next(model.parameters()).dtype == torch.float32
    fitted.train()  # modes are no move
    assert fitted.training


@pytest.mark.parametrize("budget, message", [
    ("1KiB", "least"), (-3, "cannot read '-3'"), ("0%", "must be a positive amount"), (2.5, "give bytes"),
])
def test_a_budget_that_cannot_be_met_or_read_fails_in_one_line(gpt2, budget, message):
    from planner import fit

    model, batch = gpt2
    with pytest.raises(MemschedError, match=message):
        fit(model, batch, budget)


def test_importing_planner_stays_torch_free_until_fit_is_asked_for():
    code = ("import sys, planner; assert 'torch' not in sys.modules; "
            "fit = planner.fit; assert 'torch' in sys.modules; print(fit.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "profiles.fit"


FACTORY = '''
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel


    def build(batch=4):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(n_layer=3, n_embd=64, n_head=4, vocab_size=256, n_positions=32,
                                           bos_token_id=0, eos_token_id=0))
        ids = torch.randint(0, 256, (batch, 32))
        mask = torch.ones(batch, 32, dtype=torch.long)
        mask[1, 20:] = 0
        return model.train(), {"input_ids": ids, "attention_mask": mask, "labels": ids.clone()}
'''


def test_memsched_train_takes_a_factory_of_an_unmodified_hugging_face_model(tmp_path, capsys):
    path = tmp_path / "gpt2_factory.py"
    path.write_text(textwrap.dedent(FACTORY))
    assert cli.main(["train", f"{path}:build", "--budget", "50%", "--steps", "2"]) == 0
    out = capsys.readouterr()
    assert "stages discovered" in out.err and "transformer.h.2[ln_2,mlp]" in out.err, out.err
    assert "measured" in out.out, out.out
    chain = tmp_path / "chain.json"
    assert cli.main(["profile", f"{path}:build", "--batch", "2", "-o", str(chain), "--repeats", "1",
                     "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    assert "stages discovered" in out and f"chain written to {chain}" in out, out
