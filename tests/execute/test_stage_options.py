"""Stage options run by the chain executor: measured peak against the simulator's prediction and gradients bit for
bit against the plain step, at the default thread count and at one thread (issue 16).

Models: gpt-tiny (dropout inside its blocks: recomputed from the generator states it started from),
resnet-tiny (BatchNorm: recomputed without updating its statistics twice) and an unmodified Hugging Face GPT-2
cut by discovery (its stages are graphs already). Each is profiled with options at the thread count; the times
are then made proportional to sizes (an option's extra backward to what it drops), so that every run solves
the same plans, while the sizes, which the executor is judged on, are measured.
"""


import pytest
import torch

from checks import at_thread_count, sized_times
from discovery_models import MODELS as USER_MODELS
from planner.errors import MemschedError
from planner.execute.chain import apply_plan
from planner.execute.live_memory import LiveMemoryTracker
from planner.execute.selective import run_with_option
from profiles.chain_profiler import profile_chain
from profiles.discover import discover
from profiles.memory import storage_bytes
from profiles.zoo import MODELS
from solvers import solve, store_all_peak
from solvers.minimum import minimum_budget

SEED = 3


@pytest.fixture(scope="module", params=["default", 1])
def threads(request):
    yield from at_thread_count(request.param)


def staged(name):
    if name in MODELS:
        return MODELS[name]()
    model, inputs, loss_fn = USER_MODELS[name]()
    return discover(model, inputs, loss_fn, name=name).staged


def parameters(model) -> dict:
    return {f"{name}.{key}": p for name, module in model.stages for key, p in module.named_parameters()}


def buffers(model) -> dict:
    return {f"{name}.{key}": b.clone() for name, module in model.stages for key, b in module.named_buffers()}


def taken_grads(model) -> dict:
    grads = {key: p.grad for key, p in parameters(model).items()}
    for p in parameters(model).values():
        p.grad = None
    return grads


def plain_step(model):
    torch.manual_seed(SEED)
    activation, *extra = model.example_inputs
    for _, module in model.stages:
        activation = module(activation, *extra)
    model.loss_fn(activation).backward()
    return taken_grads(model)


@pytest.fixture(scope="module", params=["gpt-tiny", "resnet-tiny", "gpt2"])
def case(request, threads):
    model = staged(request.param)
    before = buffers(model)
    chain = profile_chain(model.stages, model.example_inputs, loss_fn=model.loss_fn, name=request.param,
                          warmup=0, repeats=1, options=4)
    assert buffers(model).keys() == before.keys()
    assert all(torch.equal(buffers(model)[k], v) for k, v in before.items()), "profiling changed the buffers"
    assert sum(len(s.options) for s in chain.stages) >= 2, [len(s.options) for s in chain.stages]
    state = buffers(model)
    expected = plain_step(model)
    after_plain = buffers(model)
    for name, module in model.stages:  # back to the state before the plain step
        for key, b in module.named_buffers():
            b.copy_(state[f"{name}.{key}"])
    return request.param, model, sized_times(chain), expected, after_plain


@pytest.mark.slow
@pytest.mark.parametrize("where", ["least", "30%", "60%"])
def test_options_run_at_their_predicted_peak_with_the_plain_gradients(case, threads, where):
    name, model, chain, expected, after_plain = case
    low, high = minimum_budget(chain, options=True), store_all_peak(chain)
    budget = {"least": low, "30%": low + (high - low) * 3 // 10, "60%": low + (high - low) * 6 // 10}[where]
    plan = solve(chain, budget, "hierarchical")
    chosen = [op for op in plan.schedule if op.option is not None]
    if where != "least":
        assert chosen, f"{name} at {where}: no option chosen"
    state = buffers(model)
    planned = apply_plan(model.stages, plan, chain)
    torch.manual_seed(SEED)
    with LiveMemoryTracker() as tracker:
        model.loss_fn(planned(*model.example_inputs)).backward()
    got = taken_grads(model)
    measured = tracker.peak + storage_bytes([t for t in model.example_inputs if isinstance(t, torch.Tensor)])
    ratio = measured / plan.predicted.peak_bytes
    what = f"{name} hierarchical at {where} ({len(chosen)} options), {threads} threads"
    print(f"{what}: predicted {plan.predicted.peak_bytes} B, measured {measured} B (ratio {ratio:.4f}), "
          f"overhead {plan.predicted.overhead:.3f} (rotor at this budget: "
          f"{solve(chain, max(budget, minimum_budget(chain)), 'rotor').predicted.overhead:.3f})")
    assert abs(ratio - 1) <= 0.01, what
    assert got.keys() == expected.keys()
    for key, grad in expected.items():
        assert torch.equal(got[key], grad), f"{what}: {key} differs from the plain step"
    now = buffers(model)
    for key, value in after_plain.items():  # running statistics updated once, as by the plain step
        assert torch.equal(now[key], value), f"{what}: buffer {key}"
    for n, module in model.stages:
        for key, b in module.named_buffers():
            b.copy_(state[f"{n}.{key}"])


def test_a_plan_with_options_needs_its_chain(case):
    """A plan choosing options is refused without the chain that says what they keep; one choosing none (gpt2's
    at its least budget: no option pays there) runs without it."""
    name, model, chain, _, _ = case
    plan = solve(chain, minimum_budget(chain, options=True), "hierarchical")
    if any(op.option is not None for op in plan.schedule):
        with pytest.raises(MemschedError, match="apply the plan with its chain"):
            apply_plan(model.stages, plan)
    else:
        assert name == "gpt2", name  # the others choose options at their least budget
        apply_plan(model.stages, plan)


def test_estimate_gives_the_options_of_the_real_profile():
    from profiles.fake_build import build_fake

    real_model = MODELS["gpt-tiny"]()
    real = profile_chain(real_model.stages, real_model.example_inputs, loss_fn=real_model.loss_fn, warmup=0,
                         repeats=1, options=4)
    _, fake_model = build_fake(lambda: MODELS["gpt-tiny"]())
    estimated = profile_chain(fake_model.stages, fake_model.example_inputs, loss_fn=fake_model.loss_fn,
                              estimate=True, options=4)

    def sizes(chain):
        return [sorted((o.recompute, o.saved_bytes, o.own_saved_bytes) for o in s.options) for s in chain.stages]

    assert any(s.options for s in estimated.stages)
    real_by_recompute = [{o.recompute: o.saved_bytes for o in s.options} for s in real.stages]
    for stage, known in zip(estimated.stages, real_by_recompute):
        for option in stage.options:  # the candidates may differ (times differ), their sizes do not
            if option.recompute in known:
                assert option.saved_bytes == known[option.recompute]
    assert sizes(estimated) and len(estimated.stages) == len(real.stages)


def test_a_position_beyond_the_stage_graph_is_refused():
    model = MODELS["mlp"](layers=2)
    name, module = model.stages[0]
    with pytest.raises(ValueError, match="is not one"):
        run_with_option(module, (10**6,), model.example_inputs[0])


def test_an_option_frees_exactly_the_values_it_drops_even_those_saved_by_their_own_operation():
    """ReLU and softmax save their own result, packed while the operation runs, before the executor hears the
    result is dropped: the option must still free it (measured: resnet-tiny's BatchNorm + ReLU option kept all
    8 MiB its block saves until this was handled)."""
    from planner.execute.selective import forward_nodes, operations, stage_graph

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                 torch.nn.Softmax(dim=-1), torch.nn.Linear(256, 8))
    x = torch.randn(512, 64, requires_grad=True)
    nodes = forward_nodes(module, (x,))
    names = [str(node.target) for node in operations(stage_graph(module, (x,)))]
    assert [name.split(".")[1] for name in names] == ["linear", "relu", "linear", "softmax", "linear"], names
    dropped = (0, 1, 2, 3)  # recomputed from the stage's input: nothing more held
    freed = sum(n.bytes for n in nodes if n.position in dropped and n.saved)
    assert freed == 2 * 512 * 256 * 4  # the ReLU's and the softmax's results

    def kept(run):
        with LiveMemoryTracker() as tracker:
            start = tracker.current
            output = run(x)
            held = tracker.current - start
        output.sum().backward()
        grads = [p.grad.clone() for p in module.parameters()] + [x.grad.clone()]
        module.zero_grad(set_to_none=True)
        x.grad = None
        return held, grads

    plain_held, plain_grads = kept(module)
    option_held, option_grads = kept(lambda t: run_with_option(module, dropped, t))
    assert plain_held - option_held == freed
    for got, want in zip(option_grads, plain_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
