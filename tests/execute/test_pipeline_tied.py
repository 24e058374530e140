"""Tied weights in pipelines (planner/shared.py): a small language model whose output head reuses its token
embedding's weight, split so that the embedding and the head are on different devices.

The chain counts the tied weight once (in the head's ``param_bytes``); its ``shared`` list says which stages
read it. The pipeline simulator gives the embedding's device a copy of its own (parameters, optimizer state,
gradient), and the executor sums the two copies' gradients after the backward: the gradients and the losses
of two Adam steps equal single-process training, and each rank's measured peak is within 2% of the
prediction (before: the embedding's device measured 1.88 of its prediction, its copy's gradient and state
uncounted, and its gradients were the embedding's part alone). A plan that does not count the copy is
refused in one line. One 2-process run (5-15 s); the ranks run at one thread, the profile is checked at the
default thread count and at one.
"""

import dataclasses
import functools
import json

import pytest
import torch

from checks import default_threads, one_line
from oracles.pipeline_plans import store_all_split
from planner import MemschedError
from planner.chain import Chain, load_chain, save_chain
from planner.setup.training import TrainingSetup
from planner.shared import SharedParameter
from planner.simulate import simulate
from planner.simulate.pipeline import device_state, transfer_seconds
from profiles.chain_profiler import profile_chain
from profiles.memory import memory_meter
from profiles.spec import built_model

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="torch.distributed with the gloo backend is not available in this PyTorch build")

GPT = "gpt-tiny:layers=2,d=32,heads=2,seq=16,vocab=256,dropout=0"  # embed | block0 | block1 | head
MICRO, M = 2, 4
TIE = SharedParameter(name="embed.tok.weight", stages=(0, 3), bytes=256 * 32 * 4)
SPLIT = [(0, 2), (2, 4)]  # the embedding with block0 on device 0, the head on device 1


def tied_lm(batch):
    """gpt-tiny whose head's output projection *is* the token embedding's weight (GPT-2's tied lm_head)."""
    model = built_model(GPT, batch=batch)
    model.stages[-1][1].out.weight = model.stages[0][1].tok.weight
    return model


def profiled(threads=None):
    """The tied model's chain at one micro-batch, as the profiler records it (at ``threads``, else the default)."""
    model = tied_lm(MICRO)
    before = torch.get_num_threads()
    torch.set_num_threads(threads or default_threads())
    try:
        chain = profile_chain(model.stages, model.example_inputs, loss_fn=model.loss_fn, warmup=0, repeats=1,
                              name="tied-lm")
    finally:
        torch.set_num_threads(before)
    return chain


@pytest.fixture(scope="module")
def chain():
    return profiled()


@pytest.mark.parametrize("threads", [None, 1])
def test_the_chain_counts_the_tied_weight_once_in_the_head(threads):
    """The profile does not double count: its param_bytes add up to the model's distinct parameters, the tied
    weight in the head's (the last reader, whose backward makes the gradient)."""
    chain = profiled(threads)
    model = tied_lm(MICRO)
    distinct = {id(p): p for _, module in model.stages for p in module.parameters()}
    assert sum(s.param_bytes for s in chain.stages) == sum(p.numel() * 4 for p in distinct.values())
    assert chain.shared == (TIE,)
    assert chain.stages[0].param_bytes == 16 * 32 * 4  # the position table alone
    head = model.stages[-1][1]
    assert chain.stages[3].param_bytes == TIE.bytes + sum(p.numel() * 4 for p in head.ln.parameters()) \
        + head.out.bias.numel() * 4


def test_chain_json_keeps_shared_and_old_chains_stay_valid(chain, tmp_path):
    save_chain(chain, tmp_path / "chain.json")
    data = json.loads((tmp_path / "chain.json").read_text())
    assert data["shared"] == [{"name": "embed.tok.weight", "stages": [0, 3], "bytes": TIE.bytes}]
    assert load_chain(tmp_path / "chain.json") == chain
    untied = dataclasses.replace(chain, shared=())
    assert "shared" not in untied.to_dict() and untied.fingerprint() != chain.fingerprint()
    del data["shared"]
    assert Chain.from_dict(data) == untied
    for entry, fragment in [({"name": "w", "stages": [3, 0], "bytes": 4}, "shared[0].stages must be distinct"),
                            ({"name": "w", "stages": [0], "bytes": 4}, "shared[0].stages must list at least two"),
                            ({"name": "w", "stages": [0, 3], "bytes": 10**9}, "more than its param_bytes"),
                            ({"name": "w", "stages": [0, 3]}, "bytes")]:
        with pytest.raises(MemschedError) as info:
            Chain.from_dict({**data, "shared": [entry]})
        one_line(info, fragment)


def test_each_device_counts_its_copy_and_one_device_counts_it_once(chain):
    """Device 0 holds a copy: its resident state and its gradients grow by the copy's, and so does its peak
    (the gradient exists from its first backward on); the head's device, and a single device holding both
    readers, are as without the tie. With a channel, the copy's gradient sum is timed once per step."""
    untied = dataclasses.replace(chain, shared=())
    setup = TrainingSetup()
    with_tie, without = (simulate(c, store_all_split(c, SPLIT, M, "1f1b")) for c in (chain, untied))
    parameters = TIE.bytes // 4
    n0 = sum(s.param_bytes for s in chain.stages[:2]) // 4
    resident = setup.resident_bytes(n0 + parameters) - setup.resident_bytes(n0)
    gradient = setup.gradient_bytes(n0 + parameters) - setup.gradient_bytes(n0)
    first, last = with_tie.devices
    assert first.resident_bytes - without.devices[0].resident_bytes == resident
    assert first.gradient_bytes - without.devices[0].gradient_bytes == gradient
    assert first.peak_bytes - without.devices[0].peak_bytes == resident + gradient
    assert last == without.devices[1]
    whole = [simulate(c, store_all_split(c, [(0, 4)], M, "1f1b")).devices[0] for c in (chain, untied)]
    assert whole[0] == whole[1]
    assert device_state(chain, 0, 4, setup, M) == device_state(untied, 0, 4, setup, M)
    def timed(c):
        plan = store_all_split(c, SPLIT, M, "1f1b")
        return simulate(c, dataclasses.replace(plan, pipeline=dataclasses.replace(
            plan.pipeline, bandwidth=1e6, latency=1e-4)))

    result = timed(chain)
    assert result.devices[0].sync == transfer_seconds(gradient, 1e6, 1e-4) and result.devices[1].sync == 0.0
    assert result.time == pytest.approx(timed(untied).time + result.devices[0].sync, rel=1e-12)


def untied_lm(batch):
    return built_model(GPT, batch=batch)


def test_a_plan_that_does_not_count_the_copy_is_refused_in_one_line(chain):
    from planner.execute.pipeline import run_pipeline

    untied = dataclasses.replace(chain, shared=())
    with pytest.raises(MemschedError) as info:
        run_pipeline(functools.partial(tied_lm, M * MICRO), store_all_split(untied, SPLIT, M, "1f1b"), 1,
                     meter=memory_meter)
    message = one_line(info, "untie it, or keep stages 0 to 3 on one device")
    assert message.startswith("pipeline: parameter embed.tok.weight is read by stage 0 (embed) on device 0 and "
                              "stage 3 (head) on device 1, but the plan does not count a copy of it on device 0")
    with pytest.raises(MemschedError, match=r"counts a parameter shared by stages 0 \(embed\), 3 \(head\) on devices "
                                            r"\[0, 1\], which this model's stages do not share"):
        run_pipeline(functools.partial(untied_lm, M * MICRO), store_all_split(chain, SPLIT, M, "1f1b"), 1,
                     meter=memory_meter)
    # On one device nothing is copied, so a plan of the untied chain that keeps both readers together is fine.
    from planner.execute.pipeline_rank import synced_parameters

    assert synced_parameters(tied_lm(M * MICRO), store_all_split(untied, [(0, 4)], M, "1f1b")) == []
    assert [entry for entry, _, _ in synced_parameters(tied_lm(M * MICRO), store_all_split(chain, SPLIT, M, "1f1b"))] \
        == [TIE]


def single_process(steps, lr):
    """Losses of ``steps`` Adam steps of the whole batch in one process, and the first step's gradients by
    'stage.parameter' (the tied weight under both its names). Adam takes one step on zero gradients first, as
    the executor does to create its state."""
    model = tied_lm(M * MICRO)
    parameters = list({id(p): p for _, module in model.stages for p in module.parameters()}.values())
    optimizer = torch.optim.Adam(parameters, lr=lr)
    for p in parameters:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    losses, grads = [], None
    for _ in range(steps):
        for p in parameters:
            p.grad = None
        x = model.example_inputs[0]
        for _, module in model.stages:
            x = module(x)
        loss = model.loss_fn(x)
        loss.backward()
        losses.append(float(loss.detach()))
        if grads is None:
            grads = {f"{name}.{n}": p.grad.clone() for name, module in model.stages
                     for n, p in module.named_parameters()}
        optimizer.step()
    return losses, grads


@pytest.mark.multiprocess
def test_tied_weight_across_devices_trains_as_one_process(chain):
    from planner.execute.pipeline import run_pipeline

    plan = store_all_split(chain, SPLIT, M, "1f1b")
    results = run_pipeline(functools.partial(tied_lm, M * MICRO), plan, 2, meter=memory_meter, lr=1e-2,
                           return_grads=True, progress_timeout=120)
    losses, grads = single_process(2, 1e-2)
    merged = {name: grad for r in results for name, grad in r.grads.items()}
    assert set(merged) == set(grads)
    for name, grad in grads.items():
        torch.testing.assert_close(merged[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    assert results[-1].losses == pytest.approx(losses, rel=1e-5)  # the second step ran on the updated copies
    for r in results:
        assert r.measured == pytest.approx(r.predicted_window, rel=0.02), (r.rank, r.measured, r.predicted_window)
        assert r.peaks[0] - r.peaks[-1] == pytest.approx(r.recv_buffer_bytes, rel=0.01), (r.rank, r.peaks)
