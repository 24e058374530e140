"""``fit(..., batch=...)`` (profiles/fit_batch.py): a micro-batch of another size than the example's, and
``batch="auto"``, the one that trains fastest on a device, searched on fake tensors as ``memsched plan --batch auto``
searches; the chosen plan then trains the real model at that micro-batch with its gradients and predicted peak."""

import copy
import dataclasses

import pytest
import torch

from checks import raises_one_line
from discovery_models import MODELS
from paths import ROOT, load_fixture
from planner import fit
from planner.devices import DeviceSpec
from planner.execute.live_memory import LiveMemoryTracker
from planner.execute.stages import batch_resized
from planner.setup.training import resident_on_device
from profiles.device_plan import best, plan_for_device
from profiles.memory import storage_bytes

pytest.importorskip("transformers")

QUICK = dict(warmup=0, repeats=1, stage_options=0, returns="loss")
# This CPU as a device of 12 MiB with a cost per operation: small micro-batches are launch-bound, large ones
# must recompute (its figures only time the estimate)
HERE = DeviceSpec("here", 12 << 20, 2e10, 2e10, 1e10, 1e10, 1e10, allocator="cpu", op_overhead_s=2e-5)


@pytest.fixture(scope="module")
def searched():
    """GPT-2 (dropout, a padding mask, labels; an example batch of 4) fitted with ``batch="auto"`` on
    :data:`HERE`, the lines it said, and an unmodified twin."""
    model, batch, _ = MODELS["gpt2"]()
    twin = copy.deepcopy(model)
    said = []
    fitted = fit(model, batch, "auto", device_spec=HERE, batch="auto", progress=said.append, **QUICK)
    return fitted, batch, twin, said


def test_batch_auto_searches_doubling_micro_batches_and_plans_the_fastest(searched):
    fitted, batch, _, said = searched
    tried = fitted.searched
    sizes = [c.batch for c in tried]
    assert sizes == [2 ** k for k in range(len(sizes))] and len(sizes) >= 4
    chosen = best(tried)
    assert fitted.micro_batch == chosen.batch != 4 and fitted.accumulate == 1
    assert chosen.plan.recomputed_forwards > 0  # the fastest on 12 MiB recomputes: a larger batch that pays for it
    assert chosen.peak <= HERE.memory_bytes
    # the model found and planned for real at that size is the candidate found on fake tensors
    assert dict(fitted.chain.measured_on.inputs)["0"].shape[0] == chosen.batch
    assert fitted.plan.schedule == chosen.plan.schedule
    assert fitted.predicted.peak_bytes == chosen.plan.predicted.peak_bytes
    assert resident_on_device(fitted.chain, fitted.plan.setup) + fitted.predicted.peak_bytes == chosen.peak
    assert any(line.startswith(f"chosen     micro-batch {chosen.batch} x 1: ") for line in said)
    assert sum(line.startswith("batch auto: micro-batch ") for line in said) == len(tried)


def test_the_chosen_micro_batch_trains_as_the_unmodified_model_at_its_predicted_peak(searched, threads):
    fitted, batch, twin, _ = searched
    resized = batch_resized(batch, fitted.micro_batch)
    assert resized["input_ids"].shape == (fitted.micro_batch, batch["input_ids"].shape[1])
    assert torch.equal(resized["labels"][4:8], batch["labels"])  # rows cycled from the example's
    inputs = fitted.discovery.chain_inputs((), resized)
    torch.manual_seed(0)
    with LiveMemoryTracker() as tracker:
        loss = fitted._current.run(*inputs)
        loss.backward()
    measured = tracker.peak + storage_bytes(list(inputs))
    assert abs(measured / fitted.predicted.peak_bytes - 1) <= 0.01, (threads, measured, fitted.predicted)
    torch.manual_seed(0)
    expected = twin(**resized).loss
    expected.backward()
    assert torch.equal(loss.detach(), expected.detach())
    for (name, p), q in zip(fitted.model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    fitted.model.zero_grad(set_to_none=True)
    twin.zero_grad(set_to_none=True)


def test_fit_searches_as_memsched_plan_does_on_a_model_built_at_each_batch():
    """The table of ``fit(..., batch="auto")`` on a live model (its example resized) is ``memsched plan --batch
    auto``'s on the same model built at each micro-batch by its factory."""
    spec = str(ROOT / "tests" / "fixtures" / "hf_gpt2.py") + ":build"
    device = dataclasses.replace(HERE, memory_bytes=8 << 20)
    tried = plan_for_device(spec, device, "auto")
    model, example = load_fixture("hf_gpt2").build()
    fitted = fit(model, example, "auto", device_spec=device, batch="auto", progress=False, **QUICK)
    assert [c.batch for c in fitted.searched] == [c.batch for c in tried] and tried[-1].plan is None
    for ours, theirs in zip(fitted.searched, tried):
        assert (ours.accumulate, ours.peak, ours.why) == (theirs.accumulate, theirs.peak, theirs.why), ours.batch
        assert ours.seconds == pytest.approx(theirs.seconds, rel=1e-9), ours.batch
        assert (ours.plan and ours.plan.schedule) == (theirs.plan and theirs.plan.schedule), ours.batch


def test_a_global_batch_accumulates_each_micro_batch_to_it():
    model, batch, _ = MODELS["gpt2"]()
    fitted = fit(model, batch, "auto", device_spec=HERE, batch="auto", global_batch=8, progress=False, **QUICK)
    assert [(c.batch, c.accumulate) for c in fitted.searched][:4] == [(1, 8), (2, 4), (4, 2), (8, 1)]
    assert fitted.accumulate * fitted.micro_batch == 8 and fitted.plan.setup.accumulate == fitted.accumulate
    sized = fit(model, batch, "90%", batch=2, global_batch=8, progress=False, **QUICK)  # measured here, at 2
    assert (sized.micro_batch, sized.accumulate, sized.searched) == (2, 4, ())
    assert dict(sized.chain.measured_on.inputs)["0"].shape[0] == 2


def test_a_micro_batch_size_plans_the_example_resized():
    model, batch, _ = MODELS["gpt2"]()
    fitted = fit(model, batch, "60%", batch=8, progress=False, **QUICK)
    assert fitted.micro_batch == 8 and dict(fitted.chain.measured_on.inputs)["0"].shape[0] == 8
    fitted(**batch_resized(batch, 8)).backward()
    assert all(p.grad is not None for p in model.parameters())
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("options, words", [
    (dict(batch="auto", budget="60%"), ["batch='auto' needs device_spec=", "give device_spec="]),
    (dict(batch=0), ["fit batch", "an int from 1 to 65536", "0"]),
    (dict(batch="big"), ["fit batch", "'big'"]),
    (dict(batch=True), ["fit batch", "True"]),
    (dict(batch=2, global_batch=0), ["fit global_batch", "positive int"]),
    (dict(batch=2, global_batch=8, accumulate=2), ["global_batch= does not mix with accumulate=2"]),
    (dict(batch=3, global_batch=8), ["global_batch=8 is not a multiple of the micro-batch 3"]),
    (dict(batch=2, global_batch=8, returns="output"), ["global_batch=8", "returns='loss'"]),
    (dict(batch="auto", device_spec=DeviceSpec("tiny", 2 << 20, 1e10, 1e10, 1e10, 1e10, 1e10, "cpu")),
     ["GPT2LMHeadModel does not fit tiny at a micro-batch of 1", "of device memory"]),
])
def test_batch_refusals_are_one_line(options, words):
    model, batch, _ = MODELS["gpt2"]()
    options = dict(QUICK, progress=False, **options)
    budget = options.pop("budget", "auto" if "device_spec" in options else "60%")
    message = raises_one_line(fit, model, batch, budget, **options)
    assert all(word in message for word in words), message


def test_a_loss_closing_over_the_examples_targets_cannot_take_another_batch_in_one_line():
    model, pixels, loss_fn = MODELS["vit"]()  # its loss closes over 4 labels
    message = raises_one_line(fit, model, pixels, "60%", loss_fn=loss_fn, batch=8, progress=False, **QUICK)
    assert "failed on its example inputs" in message and "given 8 rows" in message and "pass the targets" in message
    message = raises_one_line(fit, model, pixels, "auto", loss_fn=loss_fn, device_spec=HERE, batch="auto",
                              progress=False, **QUICK)
    assert "given 1 rows" in message and "pass the targets among the inputs" in message
