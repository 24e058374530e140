"""Gradient accumulation (issue 29): several micro-batches' gradients added into ``.grad`` before one optimizer
step, modelled (planner/accumulate.py), solved and simulated (``accumulate`` on the plan), run (every stage's
backward on its own) and measured.

Measured: with 4 micro-batches by a recomputing plan, each micro-batch's peak (the first from no gradient, the
later ones with every gradient held from their start) is within 1% of its prediction, on tiny Hugging Face GPT-2
(tied embeddings, dropout) and Llama, at one thread and at the default count; the accumulated gradients and the
parameters after the optimizer's step are those of the unmodified model doing the same accumulation. A plan
solved without accumulation (today's) under-predicts the later micro-batches by 24% (GPT-2) and 51% (Llama).
"""

import copy
import dataclasses
import warnings

import pytest
import torch
from torch.testing import assert_close

from checks import one_error_line, one_line
from discovery_models import MODELS, VOCAB
from planner.accumulate import accumulating_chain, held_gradient_bytes
from planner.chain import Chain, Loss, Stage, StageOption
from planner.errors import MemschedError
from planner.execute.chain import apply_plan
from planner.execute.live_memory import LiveMemoryTracker
from planner.plan import Plan, load_plan, save_plan
from planner.setup.training import TrainingSetup, parameters_of
from planner.shared import SharedParameter
from planner.simulate import micro_batch_peaks, simulate
from planner.simulate.chain import ChainSimulator
from profiles.memory import storage_bytes
from profiles.synthetic import random_chain
from solvers import solve, store_all_peak
from solvers.budgets import solve_for_budget
from solvers.extremes import store_all_schedule
from solvers.minimum import minimum_budget

MICRO_BATCHES = 4


def _two_stages() -> Chain:
    """Hand-checked below: input 10 bytes; stage 0 keeps 30 for its backward and has 100 bytes of gradients,
    stage 1 keeps 25 and has 8."""
    return Chain(name="two", device="cpu", input_bytes=10, loss=Loss(), stages=(
        Stage("a", 1.0, 2.0, out_bytes=20, saved_bytes=30, bwd_tmp_bytes=5, param_bytes=100),
        Stage("b", 1.0, 2.0, out_bytes=20, saved_bytes=25, bwd_tmp_bytes=3, param_bytes=8)))


def test_later_micro_batches_hold_every_gradient_and_make_their_own_as_transients():
    chain = _two_stages()
    store_all = store_all_schedule(2)
    # First micro-batch (the chain's own): Loss holds 10 + 30 + 25 + δ_2 20 = 85; B 1 peaks at 85 + δ_1 20 + 3 and
    # leaves 10 + 30 + δ_1 20 + 8 gradients = 68; after B 0 (made at once, as the model counts): 68 - 30 - 20 +
    # 100 + δ_0 10 = 128, its peak.
    first = ChainSimulator(chain).run(store_all)
    assert [step.peak for step in first.timeline] == [40, 65, 85, 108, 128] and first.peak_bytes == 128
    # Later ones: 108 bytes of gradients from the start; B 0's 100 new bytes exist beside them when its backward
    # ends (ā_1 and δ_1 freed): 108 + 10 + δ_0 10 + 100 = 228, then they are added into .grad and freed.
    assert held_gradient_bytes(chain) == 108
    later = accumulating_chain(chain)
    assert [(s.param_bytes, s.bwd_tmp_bytes) for s in later.stages] == [(0, 50), (0, 3)]
    result = ChainSimulator(later, held_bytes=108).run(store_all)
    assert [step.peak for step in result.timeline] == [148, 173, 193, 216, 228]
    assert result.timeline[-1].memory_after == 108 + 10 + 10  # the gradients, the input and δ_0
    assert store_all_peak(chain, MICRO_BATCHES) == 228 and store_all_peak(chain) == 128


def test_a_shared_parameter_is_held_once_and_options_make_their_gradients_transient_too():
    chain = _two_stages()
    option = StageOption(recompute=(0,), fwd_time=1.0, bwd_time=3.0, saved_bytes=20, own_saved_bytes=20,
                         bwd_tmp_bytes=7)
    chain = dataclasses.replace(chain, stages=(dataclasses.replace(chain.stages[0], options=(option,)),
                                               chain.stages[1]),
                                shared=(SharedParameter(name="tied", stages=(0, 1), bytes=8),))
    later = accumulating_chain(chain)
    assert held_gradient_bytes(chain) == 108  # the tied gradient counted once, in its owner's param_bytes
    # its contributions are summed before they go into .grad: the sum is held from its owner's backward on
    assert [stage.param_bytes for stage in later.stages] == [0, 8]
    assert later.stages[0].options[0].bwd_tmp_bytes == 100 - 20 - 20  # its gradients beside what B 0 left
    assert later.shared == chain.shared and later.fingerprint() != chain.fingerprint()


def test_a_plan_records_accumulate_simulates_through_it_and_fits_its_budget(tmp_path):
    chain = random_chain(8, seed=3, tmp=True, params=True)
    held = held_gradient_bytes(chain)
    budget = (held + minimum_budget(accumulating_chain(chain)) + store_all_peak(chain, MICRO_BATCHES)) // 2
    plan = solve(chain, budget, "rotor", setup=TrainingSetup(accumulate=MICRO_BATCHES))
    assert plan.accumulate == MICRO_BATCHES and plan.fingerprint == chain.fingerprint()
    assert plan.budget_bytes == budget and plan.recomputed_forwards > 0
    assert simulate(chain, plan).peak_bytes == plan.predicted.peak_bytes <= budget
    peaks = micro_batch_peaks(chain, plan)
    assert peaks == (ChainSimulator(chain).run(plan.schedule).peak_bytes,) + (plan.predicted.peak_bytes,) * 3
    assert peaks[0] < peaks[1]
    save_plan(plan, tmp_path / "p.json")
    assert load_plan(tmp_path / "p.json") == plan and plan.to_dict()["accumulate"] == MICRO_BATCHES
    plain = solve(chain, budget, "rotor")  # today's plan: its JSON has no such field, and reads back as before
    assert "accumulate" not in plain.to_dict() and Plan.from_dict(plain.to_dict()).accumulate == 1
    assert micro_batch_peaks(chain, plain) == (plain.predicted.peak_bytes,)


def test_a_budget_given_as_a_percentage_or_left_by_a_device_is_the_accumulating_steps():
    chain = random_chain(8, seed=3, tmp=True, params=True)
    plan, _ = solve_for_budget(chain, "80%", "rotor", TrainingSetup(accumulate=MICRO_BATCHES))
    assert plan.budget_bytes == int(0.8 * store_all_peak(chain, MICRO_BATCHES)) > 0.8 * store_all_peak(chain)
    least = held_gradient_bytes(chain) + minimum_budget(accumulating_chain(chain))
    setup = TrainingSetup(optimizer="sgd", accumulate=MICRO_BATCHES)
    device = least - 1 + setup.resident_bytes(parameters_of(chain))  # one byte short of the accumulating floor
    with pytest.raises(MemschedError, match=f"--budget auto leaves .* below the minimum feasible .*{least} bytes"):
        solve_for_budget(chain, "auto", "rotor", setup, device)


def test_what_accumulation_does_not_mix_with_is_refused_in_one_line():
    chain = _two_stages()
    data = solve(chain, 300, "rotor", setup=TrainingSetup(accumulate=2)).to_dict()
    cases = [
        (lambda: Plan.from_dict({**data, "accumulate": 0}), "accumulate: the micro-batches .* got 0"),
        (lambda: Plan.from_dict({**data, "accumulate": True}), "got True"),
        (lambda: Plan.from_dict({**data, "update": "in-backward"}), "does not mix with --update in-backward"),
        (lambda: solve(chain, 300, "rotor", TrainingSetup(accumulate=2, update="in-backward")),
         "does not mix with --update"),
        (lambda: solve(chain, 300, "offload", TrainingSetup(accumulate=2)), "does not mix with offloading"),
        (lambda: solve(chain, 100, "rotor", TrainingSetup(accumulate=2)), r"budget 100 B does not hold the gradients"),
        (lambda: solve(chain, 150, "rotor", TrainingSetup(accumulate=2)),
         "leaving 42 B of the budget 150 B for the rest of the step: budget 42 B .* is below the minimum feasible"),
    ]
    for call, message in cases:
        with pytest.raises(MemschedError, match=message) as error:
            call()
        one_line(error)


def _micro_batches(seed: int) -> list:
    """Batches laid out as the models' example batch: other tokens, the same padding."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(MICRO_BATCHES):
        ids = torch.randint(0, VOCAB, (4, 32), generator=generator)
        mask = torch.ones(4, 32, dtype=torch.long)
        mask[1, 20:] = 0
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": ids.clone()})
    return batches


@pytest.fixture(scope="module")
def fitted():
    """GPT-2 and Llama, each fitted at half its accumulating step's store-all peak over 4 micro-batches (rotor:
    no stage options, for speed)."""
    pytest.importorskip("transformers")
    from planner import fit

    models = {}
    for name in ("gpt2", "llama"):
        model, batch, _ = MODELS[name]()
        models[name] = (model, fit(model, batch, "50%", accumulate=MICRO_BATCHES, stage_options=0, warmup=0,
                                   repeats=1))
    return models


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_each_micro_batch_peaks_as_predicted(fitted, name, threads):
    model, planned = fitted[name]
    assert planned.plan.accumulate == MICRO_BATCHES and planned.plan.recomputed_forwards > 0
    predicted = planned.micro_batch_peaks
    assert predicted[0] < predicted[1] == planned.predicted.peak_bytes <= planned.plan.budget_bytes
    measured = []
    for batch in _micro_batches(7):
        inputs = planned.discovery.chain_inputs((), batch)  # the prelude's values, made before the window
        held = storage_bytes([p.grad for p in model.parameters() if p.grad is not None])  # earlier micro-batches'
        with LiveMemoryTracker() as tracker:
            planned._current.run(*inputs).backward()
        measured.append(tracker.peak + storage_bytes(list(inputs)) + held)
        del inputs
    model.zero_grad()  # set_to_none (the default): the next step's first micro-batch starts without gradients
    assert all(p.grad is None for p in model.parameters())
    ratios = [m / p for m, p in zip(measured, predicted)]
    assert all(abs(ratio - 1) <= 0.01 for ratio in ratios), (name, threads, measured, predicted)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_accumulated_gradients_and_the_step_are_the_unmodified_models(fitted, name):
    """Two steps of 4 micro-batches, Adam after each: gradients and parameters bit for bit. A tied parameter's
    contributions (GPT-2's embedding) are summed before they go into ``.grad``, as autograd sums them; added into
    ``.grad`` stage by stage they differed from the second micro-batch on (1e-8), which Adam's normalisation of
    near-zero gradients carried into the second step's parameters (1e-4)."""
    model, planned = fitted[name]
    twin = copy.deepcopy(model)
    ours, theirs = torch.optim.Adam(model.parameters(), lr=1e-2), torch.optim.Adam(twin.parameters(), lr=1e-2)
    for step in range(2):
        for k, batch in enumerate(_micro_batches(step)):
            torch.manual_seed(100 * step + k)  # dropout: the same masks in both
            planned(**batch).backward()
            torch.manual_seed(100 * step + k)
            twin(**batch).loss.backward()
        for (parameter_name, p), q in zip(model.named_parameters(), twin.parameters()):
            assert_close(p.grad, q.grad, rtol=0, atol=0, msg=parameter_name)
        ours.step()
        theirs.step()
        ours.zero_grad()
        theirs.zero_grad()
        for (parameter_name, p), q in zip(model.named_parameters(), twin.parameters()):
            assert_close(p, q, rtol=0, atol=0, msg=parameter_name)


def test_an_accumulating_plan_runs_eagerly():
    pytest.importorskip("transformers")
    from planner import fit

    model, batch, _ = MODELS["llama"]()
    with pytest.raises(MemschedError, match="accumulate=2 does not mix with compile=True") as error:
        fit(model, batch, "50%", accumulate=2, compile=True)
    one_line(error)
    with pytest.raises(MemschedError, match="fit accumulate: .* got 0"):
        fit(model, batch, "50%", accumulate=0)
    chain = _two_stages()
    plan = solve(chain, 300, "rotor", setup=TrainingSetup(accumulate=2))
    stages = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
    with pytest.raises(MemschedError, match="does not mix with --compile"):
        apply_plan(stages, plan, compile=True)
    assert not apply_plan(stages, plan).continued  # each stage's backward on its own


def test_accumulation_the_plan_was_not_told_about_is_said_once_in_one_line():
    """Issue 38: a plan solved without accumulation, run with gradients already in .grad, holds them from the step's
    start, which its peak does not count (1.045x its prediction on GPT-2, 1.40x on a tiny BART): said once, in one
    line naming accumulate=; an accumulating plan and a step from no gradient say nothing."""
    stages = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    x = torch.randn(3, 2)
    for setup, said in ((TrainingSetup(), True), (TrainingSetup(accumulate=2), False)):
        run = apply_plan(stages, solve(_two_stages(), 300, "rotor", setup=setup))
        stages.zero_grad()
        with warnings.catch_warnings(record=True) as first:
            warnings.simplefilter("always")
            run(x).sum().backward()  # from no gradient
            run(x).sum().backward()  # accumulated into the first's
            run(x).sum().backward()
        told = [str(w.message) for w in first if "accumulate=K" in str(w.message)]
        assert len(told) == (1 if said else 0), [str(w.message) for w in first]
        for message in told:
            one_line(MemschedError(message), "does not count", "zero_grad()")


SMALL = "gpt-tiny:layers=3,d=32,heads=2,seq=16,vocab=64,batch=4"


def _run(capsys, *argv):
    import cli

    status = cli.main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_train_accumulates_and_reports_each_micro_batch_against_its_prediction(capsys, tmp_path):
    chain = str(tmp_path / "chain.json")  # profiled quickly, without stage options
    assert _run(capsys, "profile", SMALL, "-o", chain, "--warmup", "0", "--repeats", "1", "--options", "0")[0] == 0
    status, out, err = _run(capsys, "train", SMALL, "--chain", chain, "--budget", "60%", "--steps", "1",
                            "--accumulate", "4")
    assert status == 0, err
    assert "accumulate 4 micro-batches per optimizer step" in out and "recomputed 0 forwards" not in out
    lines = [line for line in out.splitlines() if line.startswith("step 1 by micro-batch")]
    assert len(lines) == 1
    ratios = [float(part.split()[-1]) for part in lines[0].split(": ", 1)[1].split(", ")]
    assert len(ratios) == 4 and all(abs(ratio - 1) <= 0.01 for ratio in ratios), lines


@pytest.mark.parametrize("extra, message", [
    (["--plan", "plan.json"], "--accumulate are for solving: drop them with --plan"),
    (["--graph"], "--accumulate 2 does not mix with --graph"),
    (["--dp", "2"], "--accumulate 2 does not mix with --dp"),
])
def test_train_refuses_accumulate_with_what_it_does_not_mix_with(capsys, extra, message):
    status, out, err = _run(capsys, "train", SMALL, "--budget", "50%", "--accumulate", "2", *extra)
    one_error_line(status, out, err, message)
