"""The executor (planner/execute/chain.py): a planned step is the plain step, exactly, within the memory predicted.

Every check compares a planned step (``loss_fn(apply_plan(stages, plan, chain)(*inputs)).backward()``) with
the unmodified model run as ``loss_fn(stages in order)``, the random number generator seeded identically
before both (so dropout draws the same masks), and measures the planned step's live memory against the
simulator's prediction.
"""

import copy
import dataclasses

import pytest
import torch
from torch import nn
from torch.testing import assert_close
from torch.utils._pytree import tree_flatten, tree_map

from checks import one_line, raises_one_line
from planner import MemschedError, Op, Plan, Predicted, load_plan, save_plan, simulate
from planner.execute.chain import apply_plan
from planner.execute.live_memory import LiveMemoryTracker
from profiles.chain_profiler import profile_chain
from profiles.memory import storage_bytes
from profiles.spec import load_model
from solvers import solve, store_all_peak
from solvers.minimum import minimum_budget

QUICK = {"warmup": 0, "repeats": 1}
SEED = 1234
SOLVERS = ("rotor", "sqrt", "revolve", "recompute_all", "store_all")
FRACTIONS = (0.25, 0.50, 0.75)

# Small, but with activations large enough against the parameter gradients that 50% and 75% of the
# store-all peak are feasible (gpt-tiny down to 25%); gpt-tiny keeps its dropout (0.1), resnet-tiny its BatchNorm.
SMALL = {
    "mlp": "mlp:layers=10,width=8,batch=512",
    "gpt-tiny": "gpt-tiny:layers=6,d=16,heads=2,seq=32,vocab=32,batch=4",
    "resnet-tiny": "resnet-tiny:blocks=6,channels=4,size=8,batch=4",
}
# Below a solver's least budget on that model (measured: store_all needs the whole store-all peak; the
# others' least budgets lie above 25% on mlp and resnet-tiny, sqrt's above 50% on mlp): refused, not run.
NO_PLAN = {(name, "store_all", fraction) for name in SMALL for fraction in FRACTIONS} | {
    ("mlp", "sqrt", 0.5), *((name, solver, 0.25) for name in ("mlp", "resnet-tiny")
                            for solver in ("rotor", "sqrt", "revolve", "recompute_all"))}
PLANNED = [(name, solver, fraction) for name in SMALL for solver in SOLVERS for fraction in FRACTIONS
           if (name, solver, fraction) not in NO_PLAN]
# Memory fidelity: sizes at which even 25% of the store-all peak is feasible (minimum_budget <= 25%).
FIDELITY = {
    "mlp": "mlp",
    "gpt-tiny": "gpt-tiny:layers=8,d=64,heads=2,seq=64,batch=8",
    "resnet-tiny": "resnet-tiny:blocks=8,channels=16,size=16,batch=8",
}


# --------------------------------------------------------------------------------------------------
# Helpers


def profile(model):
    """The model's measured chain, its times replaced by ones proportional to its sizes.

    Measured times vary from run to run, and the plans (so the executor paths a test exercises) with them:
    with these, every run solves the same plans. The sizes, which the executor is judged on, are measured.
    """
    chain = profile_chain(model.stages, model.example_inputs, loss_fn=model.loss_fn, name=model.name, **QUICK)
    stages = tuple(dataclasses.replace(s, fwd_time=1e-9 * (s.saved_bytes + s.fwd_tmp_bytes),
                                       bwd_time=2e-9 * (s.saved_bytes + s.bwd_tmp_bytes)) for s in chain.stages)
    loss = dataclasses.replace(chain.loss, bwd_time=1e-9 * chain.loss.tmp_bytes)
    return dataclasses.replace(chain, stages=stages, loss=loss)


def parameters(model) -> dict:
    return {f"{name}.{key}": p for name, module in model.stages for key, p in module.named_parameters()}


def clear_grads(model) -> None:
    for p in parameters(model).values():
        p.grad = None


def grads(model) -> dict:
    return {key: None if p.grad is None else p.grad.clone() for key, p in parameters(model).items()}


def plain_forward(model, inputs=None):
    inputs = model.example_inputs if inputs is None else inputs
    activation, extra = inputs[0], inputs[1:]
    for _, module in model.stages:
        activation = module(activation, *extra)
    return activation


def step(model, forward, seed=SEED, clear=True):
    """One training step ``loss_fn(forward()).backward()`` from seed ``seed``; returns ``(loss, {name: grad})``."""
    if clear:
        clear_grads(model)
    torch.manual_seed(seed)
    loss = model.loss_fn(forward())
    loss.backward()
    return loss.detach(), grads(model)


def plain_step(model, seed=SEED, inputs=None):
    loss, result = step(model, lambda: plain_forward(model, inputs), seed)
    clear_grads(model)
    return loss, result


def planned_step(model, plan, chain, seed=SEED, inputs=None):
    planned = apply_plan(model.stages, plan, chain)
    inputs = model.example_inputs if inputs is None else inputs
    loss, result = step(model, lambda: planned(*inputs), seed)
    clear_grads(model)
    return loss, result


def as_double(model):
    """The model converted to float64: its modules by ``.double()``, its floating example inputs too."""
    for _, module in model.stages:
        module.double()
    model.example_inputs = tree_map(
        lambda t: t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t, model.example_inputs)
    return model


def input_bytes(inputs) -> int:
    return storage_bytes([t for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)])


# --------------------------------------------------------------------------------------------------
# Fixtures: each model built and profiled once for the module


def profiled_models(specs: dict) -> dict:
    """``{model name: (model, chain, plain loss, plain gradients)}`` for ``{name: SPEC}``."""
    built = {}
    for name, spec in specs.items():
        model, _ = load_model(spec)
        chain = profile(model)
        loss, reference = plain_step(model)
        built[name] = (model, chain, loss, reference)
    return built


@pytest.fixture(scope="module")
def small():
    """``{model name: (model, chain, plain loss, plain gradients)}`` at the SMALL sizes."""
    return profiled_models(SMALL)



@pytest.fixture
def fidelity(per_thread_count, threads):
    """``{model name: (model, chain)}`` at the FIDELITY sizes, profiled at ``threads`` (once per count)."""
    if threads not in per_thread_count:
        built = {}
        for name, spec in FIDELITY.items():
            model, _ = load_model(spec)
            built[name] = (model, profile(model))
        per_thread_count[threads] = built
    return per_thread_count[threads]


# --------------------------------------------------------------------------------------------------
# 1. Exact gradients, every solver, every budget


@pytest.mark.parametrize("name, solver, fraction", PLANNED)
def test_planned_gradients_equal_the_plain_step(small, name, solver, fraction):
    model, chain, loss, reference = small[name]
    plan = solve(chain, int(fraction * store_all_peak(chain)), solver)
    planned_loss, planned = planned_step(model, plan, chain)
    assert_close(planned_loss, loss)
    assert_close(planned, reference)


@pytest.mark.parametrize("name, solver, fraction", sorted(NO_PLAN))
def test_a_budget_below_the_solvers_least_is_refused(small, name, solver, fraction):
    _, chain, _, _ = small[name]
    raises_one_line(solve, chain, int(fraction * store_all_peak(chain)), solver)


@pytest.mark.parametrize("name", SMALL)
def test_rotor_has_recomputing_plans_at_half_and_three_quarters(small, name):
    _, chain, _, _ = small[name]
    for fraction in (0.50, 0.75):
        plan = solve(chain, int(fraction * store_all_peak(chain)), "rotor")
        assert plan.recomputed_forwards > 0, (name, fraction)


@pytest.mark.parametrize("name", SMALL)
def test_store_all_at_the_store_all_peak(small, name):
    model, chain, loss, reference = small[name]
    plan = solve(chain, store_all_peak(chain), "store_all")
    planned_loss, planned = planned_step(model, plan, chain)
    assert_close(planned_loss, loss)
    assert_close(planned, reference)


@pytest.mark.parametrize("name", SMALL)
def test_float64_gradients_equal_the_plain_step(name):
    model, _ = load_model(SMALL[name])
    model = as_double(model)
    chain = profile(model)
    plan = solve(chain, int(0.5 * store_all_peak(chain)), "rotor")
    assert plan.recomputed_forwards > 0
    loss, reference = plain_step(model)
    assert all(g.dtype == torch.float64 for g in reference.values())
    planned_loss, planned = planned_step(model, plan, chain)
    assert_close(planned_loss, loss)
    assert_close(planned, reference)


def test_a_plan_read_back_from_a_file_runs_the_same(small, tmp_path):
    model, chain, loss, reference = small["gpt-tiny"]
    path = tmp_path / "plan.json"
    save_plan(solve(chain, int(0.5 * store_all_peak(chain)), "rotor"), path)
    planned_loss, planned = planned_step(model, load_plan(path), chain)
    assert_close(planned_loss, loss)
    assert_close(planned, reference)


class _UsesShared(nn.Module):
    def __init__(self, shared):
        super().__init__()
        self.shared = shared
        self.own = nn.Linear(16, 16)

    def forward(self, x):
        return torch.tanh(self.own(self.shared(x)))


@pytest.mark.parametrize("solver", ["rotor", "store_all"])
def test_a_parameter_shared_by_every_stage(solver):
    from planner.execute.stages import StagedModel

    torch.manual_seed(0)
    shared = nn.Linear(16, 16)
    model = StagedModel("tied", [(f"s{k}", _UsesShared(shared)) for k in range(4)], (torch.randn(256, 16),),
                       lambda y: (y ** 2).mean())
    chain = profile(model)
    loss, reference = plain_step(model)
    plan = solve(chain, store_all_peak(chain) if solver == "store_all" else minimum_budget(chain), solver)
    planned_loss, planned = planned_step(model, plan, chain)
    assert_close(planned_loss, loss)
    assert_close(planned, reference)


# --------------------------------------------------------------------------------------------------
# 2. The input gradient


@pytest.mark.parametrize("solver", ["rotor", "recompute_all"])
def test_input_gradient_equals_the_plain_step(solver):
    model, _ = load_model(SMALL["mlp"])
    x = model.example_inputs[0].clone().requires_grad_(True)
    model.example_inputs = (x,)
    chain = profile(model)
    plan = solve(chain, int(0.5 * store_all_peak(chain)), solver)
    assert plan.recomputed_forwards > 0

    loss, reference = plain_step(model)
    reference_x = x.grad.clone()
    x.grad = None
    planned_loss, planned = planned_step(model, plan, chain)
    assert x.grad is not None
    assert_close(x.grad, reference_x)
    assert_close(planned_loss, loss)
    assert_close(planned, reference)


# --------------------------------------------------------------------------------------------------
# 3. Recomputation replays dropout


def test_recomputation_replays_dropout(small):
    model, chain, loss, reference = small["gpt-tiny"]
    assert model.options["dropout"] > 0
    other_loss, _ = plain_step(model, seed=SEED + 1)
    assert other_loss != loss  # dropout is live: another seed, another loss
    plan = solve(chain, int(0.5 * store_all_peak(chain)), "recompute_all")
    assert plan.recomputed_forwards > 0
    planned_loss, planned = planned_step(model, plan, chain)
    assert_close(planned_loss, loss)
    assert_close(planned, reference)


# --------------------------------------------------------------------------------------------------
# 4. BatchNorm running statistics


@pytest.mark.parametrize("solver", ["rotor", "recompute_all"])
def test_batchnorm_running_statistics_after_a_planned_step(small, solver):
    original, chain, _, _ = small["resnet-tiny"]
    plan = solve(chain, int(0.5 * store_all_peak(chain)), solver)
    assert plan.recomputed_forwards > 0
    plain_model, planned_model = copy.deepcopy(original), copy.deepcopy(original)
    before = {f"{n}.{k}": b.clone() for n, m in original.stages for k, b in m.named_buffers()}

    plain_step(plain_model)
    planned_step(planned_model, plan, chain)

    plain_buffers = {f"{n}.{k}": b for n, m in plain_model.stages for k, b in m.named_buffers()}
    planned_buffers = {f"{n}.{k}": b for n, m in planned_model.stages for k, b in m.named_buffers()}
    assert plain_buffers.keys() == planned_buffers.keys() == before.keys()
    assert any(k.endswith("running_mean") for k in before)
    assert_close(planned_buffers, plain_buffers)
    for key, buffer in planned_buffers.items():
        if key.endswith("num_batches_tracked"):
            assert buffer.item() == before[key].item() + 1, key  # one update per step, not one per forward
        elif key.endswith("running_mean"):
            assert not torch.equal(buffer, before[key]), key


# --------------------------------------------------------------------------------------------------
# 5. Gradients accumulate across steps


@pytest.mark.parametrize("name", SMALL)
def test_grad_accumulates_across_two_planned_steps(small, name):
    model, chain, _, reference = small[name]
    plan = solve(chain, int(0.5 * store_all_peak(chain)), "rotor")
    planned = apply_plan(model.stages, plan, chain)
    step(model, lambda: planned(*model.example_inputs))
    _, twice = step(model, lambda: planned(*model.example_inputs), clear=False)
    clear_grads(model)
    assert_close(twice, {key: 2 * g for key, g in reference.items()})


def test_unfused_stages_give_the_same_gradients(small):
    """``fuse=False`` (a pipeline's recomputing device) runs one autograd call per stage, so each stage's
    gradients are added into ``.grad`` before the next stage's are made; gradients, accumulated over two
    backwards as over a pipeline's micro-batches, are those of the plain step."""
    model, chain, _, reference = small["gpt-tiny"]
    plan = solve(chain, int(0.6 * store_all_peak(chain)), "rotor")
    assert apply_plan(model.stages, plan, chain).continued  # the plan has stages to fuse
    planned = apply_plan(model.stages, plan, chain, fuse=False)
    assert not planned.continued and not planned.absorbed
    step(model, lambda: planned(*model.example_inputs))
    _, twice = step(model, lambda: planned(*model.example_inputs), clear=False)
    clear_grads(model)
    assert_close(twice, {key: 2 * g for key, g in reference.items()})


class _AddedParameters(nn.Module):
    """``x + a + b`` with ``a`` and ``b`` of ``x``'s full shape: autograd hands both the incoming gradient itself."""

    def __init__(self, shape):
        super().__init__()
        self.a = nn.Parameter(torch.randn(shape))
        self.b = nn.Parameter(torch.randn(shape))

    def forward(self, x):
        return x + self.a + self.b


class _SummedScale(nn.Module):
    """``tanh(linear(x)) * s.sum()``: the gradient of ``s`` comes back from autograd as a zero-stride expansion."""

    def __init__(self, width):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.s = nn.Parameter(torch.full((width,), 0.25))

    def forward(self, x):
        return torch.tanh(self.linear(x)) * self.s.sum()


def _custom_model(stages, x):
    from planner.execute.stages import StagedModel

    return StagedModel("custom", stages, (x,), lambda y: (y ** 2).mean())


def test_parameters_given_the_same_gradient_tensor_accumulate_separately():
    torch.manual_seed(0)
    stages = [("lin0", nn.Sequential(nn.Linear(8, 8), nn.Tanh())), ("add", _AddedParameters((16, 8))),
              ("lin1", nn.Sequential(nn.Linear(8, 8), nn.Tanh()))]
    model = _custom_model(stages, torch.randn(16, 8))
    chain = profile(model)
    plan = solve(chain, store_all_peak(chain), "store_all")
    _, one = plain_step(model)
    planned = apply_plan(model.stages, plan, chain)
    step(model, lambda: planned(*model.example_inputs))
    a, b = model.stages[1][1].a, model.stages[1][1].b
    shared = a.grad.untyped_storage().data_ptr() == b.grad.untyped_storage().data_ptr()
    _, twice = step(model, lambda: planned(*model.example_inputs), clear=False)
    clear_grads(model)
    assert_close(twice, {key: 2 * g for key, g in one.items()})
    assert not shared, "a.grad and b.grad are one tensor"


def test_an_expanded_parameter_gradient_accumulates():
    torch.manual_seed(0)
    model = _custom_model([("s0", _SummedScale(8)), ("s1", _SummedScale(8))], torch.randn(16, 8))
    chain = profile(model)
    plan = solve(chain, store_all_peak(chain), "store_all")
    _, one = plain_step(model)
    planned = apply_plan(model.stages, plan, chain)
    _, first = step(model, lambda: planned(*model.example_inputs), clear=False)
    strides = {key: p.grad.stride() for key, p in parameters(model).items()}
    _, twice = step(model, lambda: planned(*model.example_inputs), clear=False)
    clear_grads(model)
    assert strides == {key: p.stride() for key, p in parameters(model).items()}
    assert_close(twice, {key: 2 * g for key, g in one.items()})


# --------------------------------------------------------------------------------------------------
# 6. Autocast


@pytest.mark.parametrize("solver", ["rotor", "recompute_all"])
def test_autocast_bfloat16_step_matches_the_plain_step(small, solver):
    model, chain, _, _ = small["gpt-tiny"]
    plan = solve(chain, int(0.5 * store_all_peak(chain)), solver)
    assert plan.recomputed_forwards > 0
    planned = apply_plan(model.stages, plan, chain)

    def step_under_autocast(forward):
        clear_grads(model)
        torch.manual_seed(SEED)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            output = forward()
            assert output.dtype == torch.bfloat16  # the head's Linear ran in bfloat16
            loss = model.loss_fn(output)
        del output
        loss.backward()
        result = grads(model)
        clear_grads(model)
        return loss.detach(), result

    loss, reference = step_under_autocast(lambda: plain_forward(model))
    planned_loss, planned_grads = step_under_autocast(lambda: planned(*model.example_inputs))
    assert_close(planned_loss, loss, rtol=1e-2, atol=1e-2)
    assert_close(planned_grads, reference, rtol=1e-2, atol=1e-2)


# --------------------------------------------------------------------------------------------------
# 7. Memory fidelity


# Rotor at every budget; the other solvers (where they fit) at one.
# (store_all has no plan below the store-all peak.)
FIDELITY_PLANS = [("rotor", fraction) for fraction in FRACTIONS] + [(s, 0.50) for s in SOLVERS[1:-1]]


@pytest.mark.parametrize(("solver", "fraction"), FIDELITY_PLANS)
@pytest.mark.parametrize("name", FIDELITY)
def test_measured_peak_matches_the_prediction(fidelity, name, solver, fraction):
    model, chain = fidelity[name]
    peak = store_all_peak(chain)
    assert minimum_budget(chain) <= 0.25 * peak  # the size is large enough for every budget below
    budget = int(fraction * peak)
    plan = solve(chain, budget, solver)  # rotor must have a plan at every budget above the minimum, the others at 50%
    planned = apply_plan(model.stages, plan, chain)
    clear_grads(model)
    torch.manual_seed(SEED)
    with LiveMemoryTracker() as tracker:
        model.loss_fn(planned(*model.example_inputs)).backward()
    clear_grads(model)
    measured = tracker.peak + input_bytes(model.example_inputs)
    predicted = plan.predicted.peak_bytes
    # The issue asks for 5%; the executor and the model agree to 0.8% here (measured 0.992-1.000 of predicted),
    # so 2% guards that agreement.
    assert abs(measured / predicted - 1) <= 0.02, (measured, predicted, measured / predicted)
    assert measured <= budget, (measured, budget)


def measured_and_predicted(model, chain, schedule):
    """``(measured peak, simulated peak)`` of one planned step running ``schedule``."""
    predicted = simulate(chain, schedule).peak_bytes
    plan = Plan(problem_name=chain.name, fingerprint=chain.fingerprint(), solver="by hand", budget_bytes=predicted,
                predicted=Predicted(peak_bytes=predicted, time=0.0, baseline_time=0.0), schedule=tuple(schedule))
    planned = apply_plan(model.stages, plan, chain)
    clear_grads(model)
    with LiveMemoryTracker() as tracker:
        model.loss_fn(planned(*model.example_inputs)).backward()
    clear_grads(model)
    return tracker.peak + input_bytes(model.example_inputs), predicted


@pytest.fixture(scope="module")
def logits_heavy():
    """A gpt-tiny whose logits dwarf everything else, so that the loss is where a step peaks."""
    model, _ = load_model("gpt-tiny:layers=2,d=16,heads=2,seq=32,vocab=256,batch=2")
    return model, profile(model)


def _checkpoints_then(last_forward, length):
    """F_ck 0..L-2, then ``last_forward`` L-1, the loss, and each stage recomputed with F_all before its B."""
    schedule = [Op("F_ck", i) for i in range(length - 1)] + [Op(last_forward, length - 1), Op("Loss")]
    for i in reversed(range(length)):
        if i < length - 1 or last_forward != "F_all":
            schedule.append(Op("F_all", i))
        schedule.append(Op("B", i))
    return schedule


def test_measured_peak_when_the_last_stage_runs_with_autograd_before_the_loss(logits_heavy):
    model, chain = logits_heavy
    measured, predicted = measured_and_predicted(model, chain, _checkpoints_then("F_all", chain.length))
    assert abs(measured / predicted - 1) <= 0.05, (measured, predicted, measured / predicted)


def test_measured_peak_when_the_last_stage_is_checkpointed_before_the_loss(logits_heavy):
    model, chain = logits_heavy
    measured, predicted = measured_and_predicted(model, chain, _checkpoints_then("F_ck", chain.length))
    assert abs(measured / predicted - 1) <= 0.05, (measured, predicted, measured / predicted)


# --------------------------------------------------------------------------------------------------
# 8. Inference


@pytest.mark.parametrize("name", SMALL)
def test_inference_returns_the_plain_output(small, name):
    model, chain, _, _ = small[name]
    planned = apply_plan(model.stages, solve(chain, int(0.5 * store_all_peak(chain)), "rotor"), chain)
    with torch.no_grad():
        torch.manual_seed(SEED)
        expected = plain_forward(model)
        torch.manual_seed(SEED)
        output = planned(*model.example_inputs)
    assert output.grad_fn is None
    assert_close(output, expected)


# --------------------------------------------------------------------------------------------------
# 9. Errors


def test_a_plan_for_another_stage_count_is_refused(small):
    model, chain, _, _ = small["mlp"]
    plan = solve(chain, int(0.5 * store_all_peak(chain)), "rotor")
    with pytest.raises(MemschedError) as excinfo:
        apply_plan(model.stages[:-1], plan)
    one_line(excinfo, str(chain.length), str(chain.length - 1))
    longer, _ = load_model(SMALL["mlp"].replace("layers=10", "layers=11"))
    with pytest.raises(MemschedError) as excinfo:
        apply_plan(longer.stages, plan)
    one_line(excinfo, str(chain.length), str(chain.length + 1))


def test_a_plan_for_another_fingerprint_is_refused(small):
    model, chain, _, _ = small["mlp"]
    plan = solve(chain, int(0.5 * store_all_peak(chain)), "rotor")
    stages = list(chain.stages)
    stages[1] = dataclasses.replace(stages[1], fwd_time=stages[1].fwd_time + 1e-3)
    changed = dataclasses.replace(chain, stages=tuple(stages))
    assert changed.fingerprint() != chain.fingerprint()
    with pytest.raises(MemschedError) as excinfo:
        apply_plan(model.stages, plan, changed)
    one_line(excinfo)


def test_stage_names_other_than_the_chains_are_refused(small):
    model, chain, _, _ = small["mlp"]
    plan = solve(chain, int(0.5 * store_all_peak(chain)), "rotor")
    renamed = [(name if k != 3 else "renamed", module) for k, (name, module) in enumerate(model.stages)]
    with pytest.raises(MemschedError) as excinfo:
        apply_plan(renamed, plan, chain)
    one_line(excinfo, "renamed", chain.stages[3].name)
