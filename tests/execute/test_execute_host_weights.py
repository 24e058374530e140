"""Host-weight stages in the offload executor (planner/execute/offload.py): ``weights i`` and ``grads i``.

A plan that moves ``weights i`` keeps stage i's parameters on the host between steps (ZeRO-Offload / FSDP CPU
offload): ``Prefetch i weights`` makes a device copy before the stage computes, ``Release i weights`` drops it,
and after ``B i`` the gradients are copied out (``Offload i grads``) and freed on the device (``Release i
grads``), the optimizer stepping on the host. Plans are built by hand from compute schedules (store-all, Rotor,
with and without ``saved`` items offloaded) on small profiled models; each planned step is compared with the
plain step (loss, gradients), its peak measured by the live-memory tracker against the offload simulator's
prediction, and each transfer's memory change against the simulator's. On CPU the host tensors are NumPy-backed
(the tracker does not count them) and a device copy is a ``clone()`` (which it counts).
"""

import copy
import gc

import pytest
import torch
from test_execute_chain import SEED, SMALL, clear_grads, grads, parameters, plain_forward, profiled_models
from test_execute_fusion import store_all, store_all_offloaded, with_host_weights
from test_execute_offload import (
    CHANNEL,
    measured_step,
    plan_of,
    transfer_deltas,
    unchecked,  # noqa: F401 (a fixture: the executor's guards without the check)
    unvalidated_plan,
    without_transfers,
)
from torch import nn
from torch.testing import assert_close

from checks import one_line
from planner import MemschedError, Op, simulate
from planner.execute.chain import apply_plan
from planner.execute.offload import live_copies
from planner.ops import TRANSFER_OPS, host_weight_stages
from planner.setup import TrainingSetup
from solvers import solve, store_all_peak
from solvers.minimum import minimum_budget

SPECS = {"mlp": "mlp:layers=6", "gpt-tiny": SMALL["gpt-tiny"]}
DEFAULT_THREADS = torch.get_num_threads()  # what the ``models`` fixture profiles at
RATIOS = {}  # (model, plan) -> measured / predicted peak, printed at the end (pytest -s)


# --------------------------------------------------------------------------------------------------
# Plans by hand


def trainable(chain) -> set:
    return {k for k, stage in enumerate(chain.stages) if stage.param_bytes > 0}


def rotor_schedule(chain):
    """Rotor's at half the store-all peak (or its least budget): recomputations (F_ck / F_none, then F_all)."""
    plan = solve(chain, max(int(0.5 * store_all_peak(chain)), minimum_budget(chain)), "rotor")
    assert plan.recomputed_forwards > 0
    return plan.schedule


PLANS = {  # name -> schedule from the chain
    "store-all": lambda chain: with_host_weights(store_all(chain.length), trainable(chain)),
    "store-all, prefetch right before": lambda chain: with_host_weights(store_all(chain.length), trainable(chain), 0),
    "store-all, saved offloaded": lambda chain: with_host_weights(store_all_offloaded(chain.length), trainable(chain)),
    "store-all, odd stages": lambda chain: with_host_weights(store_all(chain.length),
                                                             {k for k in trainable(chain) if k % 2}),
    "rotor": lambda chain: with_host_weights(rotor_schedule(chain), trainable(chain)),
}


# --------------------------------------------------------------------------------------------------
# Fixtures and helpers


@pytest.fixture(scope="module")
def models():
    """``{name: (model, chain, plain loss, plain grads)}``; tests run on deep copies (a plan moves parameters)."""
    return profiled_models(SPECS)


@pytest.fixture
def threaded(models, threads, per_thread_count):
    """``models`` profiled at ``threads`` (once per count; at the default count, ``models`` itself)."""
    if threads not in per_thread_count:
        per_thread_count[threads] = models if threads == DEFAULT_THREADS else profiled_models(SPECS)
    return per_thread_count[threads]


@pytest.fixture(scope="module", autouse=True)
def report():
    yield
    if RATIOS:
        print("\nmeasured / predicted peak (host-weight plans)")
        for (name, plan), ratio in sorted(RATIOS.items()):
            print(f"  {name:10s} {plan:36s} {ratio:.4f}")


def host_weight_parameters(model, stages) -> list:
    return [p for k, (_, module) in enumerate(model.stages) if k in stages for p in module.parameters()]


def snapshot(params) -> list:
    return [(p.data.data_ptr(), p.data.clone()) for p in params]


# --------------------------------------------------------------------------------------------------
# 1. The plain step, at the predicted peak; the parameters back on the host


@pytest.mark.slow
@pytest.mark.parametrize("plan_name", PLANS)
@pytest.mark.parametrize("name", SPECS)
def test_host_weight_plan_is_the_plain_step_at_the_predicted_peak(threaded, name, plan_name):
    original, chain, loss, reference = threaded[name]
    model = copy.deepcopy(original)
    schedule = PLANS[plan_name](chain)
    stages = host_weight_stages(schedule)
    assert stages and any(op.what == "grads" for op in schedule)
    plan = plan_of(chain, schedule)
    params = host_weight_parameters(model, stages)
    apply_plan(model.stages, plan, chain)  # puts them on the host (new tensors, the same values)
    before = snapshot(params)
    assert all(torch.equal(value, q) for (_, value), q in zip(before, host_weight_parameters(original, stages)))
    gc.collect()
    slots_before = live_copies()[0]

    planned_loss, planned, measured = measured_step(model, plan, chain)  # (applies the plan again; grads cleared)
    assert_close(planned_loss, loss)
    assert_close(planned, reference)
    for p, (pointer, value) in zip(params, before):  # the step left them there, unchanged
        assert p.data.data_ptr() == pointer and torch.equal(p.data, value)
    gc.collect()
    assert live_copies() == (slots_before, 0), "storages or host copies left in a box after the step"

    predicted = plan.predicted.peak_bytes
    RATIOS[(name, plan_name)] = measured / predicted
    assert abs(measured / predicted - 1) <= 0.02, (measured, predicted, measured / predicted)
    if plan_name == "store-all":
        # The same compute schedule with every parameter on the device: the tracker counts its gradients but
        # not its parameters (resident before the step), so its device total is its measured peak plus all the
        # parameters. Here the peak (at the loss, where the activations are) holds at most two stages' weights
        # (the last stage's, and one prefetched), the gradients leaving as they come: it is below that total
        # by about all but two stages' parameters.
        plain = plan_of(chain, without_transfers(schedule))
        _, _, plain_measured = measured_step(model, plain, chain)
        sizes = [chain.stages[k].param_bytes for k in stages]
        assert measured <= plain_measured + 2 * max(sizes), (measured, plain_measured)
        assert measured <= plain_measured + sum(sizes) - (len(sizes) - 2) * min(sizes)


@pytest.mark.parametrize("solver", ["rotor", "offload_greedy"])
@pytest.mark.parametrize("name", SPECS)
def test_a_plan_of_the_weight_solver(models, name, solver):
    """A plan solved with every stage's weights on the host (solvers/weights.py, at 60% of the store-all peak)
    runs as the hand-built ones."""
    original, chain, loss, reference = models[name]
    plan = solve(chain, int(0.6 * store_all_peak(chain)), solver, TrainingSetup(host_weights="all"), transfer=CHANNEL)
    assert host_weight_stages(plan.schedule) == trainable(chain)
    planned_loss, planned, measured = measured_step(copy.deepcopy(original), plan, chain)
    assert_close(planned_loss, loss)
    assert_close(planned, reference)
    RATIOS[(name, f"{solver} weights=all at 60%")] = measured / plan.predicted.peak_bytes
    assert abs(measured / plan.predicted.peak_bytes - 1) <= 0.02, (measured, plan.predicted.peak_bytes)


def test_each_weight_transfer_changes_the_memory_as_simulated(models, monkeypatch):
    """Each Prefetch/Release of weights and each Release of grads allocates/frees exactly the bytes the
    simulator moves (param_bytes; Offload none), when the plan says."""
    original, chain, _, _ = models["gpt-tiny"]
    model = copy.deepcopy(original)
    plan = plan_of(chain, PLANS["rotor"](chain))
    timeline = simulate(chain, plan.schedule, CHANNEL).timeline
    seen = transfer_deltas(model, plan, chain, monkeypatch)
    moves = [step for step in timeline if step.op.kind in TRANSFER_OPS and step.op.what in ("weights", "grads")]
    assert {step.op.kind for step in moves} == {"Prefetch", "Release", "Offload"}
    for step in moves:
        moved = step.memory_after - step.memory_before
        assert seen[step.index] == moved, (str(step.op), seen[step.index], moved)
        if step.op.kind != "Offload":
            assert abs(moved) == chain.stages[step.op.stage].param_bytes > 0


def test_parameters_stay_on_the_host_and_an_optimizer_steps_on_them(models):
    """After the step: host data unchanged (the same tensors), host gradients equal to the plain step's; an
    optimizer step changes them, and the next step starts from the updated host data (as a plain model would)."""
    original, chain, _, _ = models["mlp"]
    model, twin = copy.deepcopy(original), copy.deepcopy(original)
    schedule = PLANS["store-all"](chain)
    stages = host_weight_stages(schedule)
    planned = apply_plan(model.stages, plan_of(chain, schedule), chain)
    params = host_weight_parameters(model, stages)
    assert params and all(p.device.type == "cpu" for p in params)
    before = snapshot(params)  # apply_plan put them on the host: the step keeps these tensors
    optimizer = torch.optim.SGD(list(parameters(model).values()), lr=0.1)
    twin_optimizer = torch.optim.SGD(list(parameters(twin).values()), lr=0.1)
    for step in range(2):
        clear_grads(model)
        clear_grads(twin)
        torch.manual_seed(SEED + step)
        loss = model.loss_fn(planned(*model.example_inputs))
        loss.backward()
        torch.manual_seed(SEED + step)
        twin_loss = twin.loss_fn(plain_forward(twin))
        twin_loss.backward()
        assert_close(loss.detach(), twin_loss.detach())
        assert_close(grads(model), grads(twin))
        if step == 0:
            for p, (pointer, value) in zip(params, before):
                assert p.data.data_ptr() == pointer and torch.equal(p.data, value)
                assert p.grad is not None and p.grad.device == p.device
        optimizer.step()
        twin_optimizer.step()
        assert_close({k: p.detach() for k, p in parameters(model).items()},
                     {k: p.detach() for k, p in parameters(twin).items()})
    assert not torch.equal(params[0].data, before[0][1]), "the optimizer step changed nothing"
    assert params[0].data.data_ptr() == before[0][0]
    clear_grads(model)


def test_two_steps_accumulate_on_the_host(models):
    original, chain, _, reference = models["gpt-tiny"]
    model = copy.deepcopy(original)
    plan = plan_of(chain, PLANS["store-all"](chain))
    planned = apply_plan(model.stages, plan, chain)
    clear_grads(model)
    for _ in range(2):
        torch.manual_seed(SEED)
        model.loss_fn(planned(*model.example_inputs)).backward()
    assert_close(grads(model), {key: 2 * g for key, g in reference.items()})
    clear_grads(model)
    gc.collect()
    assert live_copies()[1] == 0


def test_two_forwards_one_backward(models):
    """Two planned forwards summed into one loss: each step's gradients land on the host and add up."""
    original, chain, _, reference = models["mlp"]
    model = copy.deepcopy(original)
    planned = apply_plan(model.stages, plan_of(chain, PLANS["rotor"](chain)), chain)
    clear_grads(model)
    torch.manual_seed(SEED)
    first = model.loss_fn(planned(*model.example_inputs))
    torch.manual_seed(SEED)
    (first + model.loss_fn(planned(*model.example_inputs))).backward()
    assert_close(grads(model), {key: 2 * g for key, g in reference.items()})
    clear_grads(model)


def test_inference_runs_on_the_host_weights(models):
    original, chain, _, _ = models["mlp"]
    model = copy.deepcopy(original)
    planned = apply_plan(model.stages, plan_of(chain, PLANS["store-all"](chain)), chain)
    with torch.no_grad():
        assert_close(planned(*model.example_inputs), plain_forward(model))


def test_a_plan_without_weight_transfers_keeps_the_parameters_where_they_are(models):
    original, chain, loss, reference = models["mlp"]
    model = copy.deepcopy(original)
    plan = plan_of(chain, store_all_offloaded(chain.length))
    planned = apply_plan(model.stages, plan, chain)
    assert planned.host_weights == {}
    planned_loss, planned_grads, _ = measured_step(model, plan, chain)
    assert_close(planned_loss, loss)
    assert_close(planned_grads, reference)


# --------------------------------------------------------------------------------------------------
# 2. Reading weights on the host fails loudly; invalid transfers and tied weights are refused


@pytest.mark.parametrize("missing", [Op("F_all", 1), Op("B", 1)])
def test_weights_read_on_the_host_fail_loudly(models, missing, unchecked):
    """Without the prefetch before ``missing``, the stage would compute on host data: a one-line error, and the
    parameters are back on the host with their gradients as before the step."""
    original, chain, _, _ = models["mlp"]
    model = copy.deepcopy(original)
    schedule = list(with_host_weights(store_all(chain.length), trainable(chain), ahead=0))
    position = schedule.index(missing)
    assert schedule[position - 1] == Op("Prefetch", 1, "weights")
    del schedule[position - 1]
    with pytest.raises(MemschedError, match="simulator|schedule|host|Prefetch"):
        simulate(chain, schedule, CHANNEL)  # the simulator refuses it...
    planned = apply_plan(model.stages, unvalidated_plan(chain, schedule), chain)
    params = host_weight_parameters(model, host_weight_stages(schedule))
    before = snapshot(params)
    clear_grads(model)
    with pytest.raises(MemschedError) as excinfo:  # ... and the executor's own guard catches it
        model.loss_fn(planned(*model.example_inputs)).backward()
    one_line(excinfo, str(missing), "weights 1", "on the host", "Prefetch 1 weights")
    for p, (pointer, value) in zip(params, before):
        assert p.data.data_ptr() == pointer and torch.equal(p.data, value)
        assert p.grad is None or missing.kind == "B"  # (a stage whose grads were released keeps them)
    clear_grads(model)


@pytest.mark.parametrize(("change", "words"), [
    (lambda s: s + [Op("Offload", 0, "weights")], ("Offload 0 weights", "never offloaded")),
    (lambda s: s + [Op("Prefetch", 0, "grads")], ("Prefetch 0 grads", "never prefetched")),
    (lambda s: s[:-3] + [op for op in s[-3:] if op != Op("Release", 0, "weights")],
     ("ends with weights 0 on the device",)),
    (lambda s: [op for op in s if op.what != "grads" or op.stage != 2], ("ends with grads 2 on the device",)),
    (lambda s: [Op("Offload", 1, "grads")] + s, ("Offload 1 grads", "never made")),
])
def test_invalid_weight_transfers_fail_loudly(models, change, words, unchecked):
    original, chain, _, _ = models["mlp"]
    model = copy.deepcopy(original)
    schedule = change(list(with_host_weights(store_all(chain.length), trainable(chain))))
    planned = apply_plan(model.stages, unvalidated_plan(chain, schedule), chain)
    params = host_weight_parameters(model, host_weight_stages(schedule))
    before = snapshot(params)
    with pytest.raises(MemschedError) as excinfo:
        model.loss_fn(planned(*model.example_inputs)).backward()
    one_line(excinfo, *words)
    for p, (pointer, value) in zip(params, before):
        assert p.data.data_ptr() == pointer and torch.equal(p.data, value)
    clear_grads(model)


class _Tied(nn.Module):
    def __init__(self, shared):
        super().__init__()
        self.shared = shared

    def forward(self, x):
        return torch.tanh(self.shared(x))


def test_tied_weights_cannot_be_host_weights(models):
    _, chain, _, _ = models["mlp"]
    shared = nn.Linear(4, 4)
    stages = [(f"layer{k}", _Tied(shared) if k in (0, 2) else nn.Linear(4, 4)) for k in range(chain.length)]
    schedule = with_host_weights(store_all(chain.length), {2})
    with pytest.raises(MemschedError) as excinfo:
        apply_plan(stages, unvalidated_plan(chain, schedule))
    one_line(excinfo, "stage 2", "stage 0", "tied")
