"""``fit`` on models whose forward writes in place: an encoder-decoder (Hugging Face T5: ``relative_buckets +=`` and
a label shift into ``new_zeros`` among the values its stages share) and a mixture of experts (Mixtral: routing
weights divided in place, dispatch buffers filled by ``index_put_``), and the rule under them: no stage re-run
applies an in-place write twice, no stage option drops a value an in-place write fills or changes later."""

import copy
import dataclasses

import pytest
import torch
from torch import nn

import solvers
from checks import one_line, seeded_losses, sized_times
from hf_families import mixtral, t5
from planner.errors import MemschedError
from planner.execute.live_memory import LiveMemoryTracker

pytest.importorskip("transformers")

FAST = dict(warmup=0, repeats=1)


class ScatterMoE(nn.Module):
    """Mixture-of-experts dispatch as it is often written: the output buffer made from a shape alone (so the
    prelude makes it, a value the stages share), filled by ``index_add_``, then read by the next layer."""

    def __init__(self, dim=16, experts=4, vocab=64):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.gate = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(experts))
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        h = self.embed(ids).reshape(-1, self.gate.in_features)
        for _ in range(2):
            chosen = self.gate(h).argmax(-1)
            out = torch.zeros(ids.numel(), self.gate.in_features)
            for k, expert in enumerate(self.experts):
                rows = (chosen == k).nonzero().squeeze(-1)
                out.index_add_(0, rows, torch.tanh(expert(h[rows])))
            h = h + out
        return self.head(h).logsumexp(-1).mean()


def _train_three_steps(model, batch, fitted, reference=None):
    """Three Adam steps of ``fitted`` and of ``reference(twin)`` (default: an untouched copy of ``model`` called
    as it is) from equal seeds: equal losses each step and equal parameters after."""
    twin = copy.deepcopy(model)
    reference = reference(twin) if reference else twin
    ours, theirs = torch.optim.Adam(fitted.parameters(), lr=1e-2), torch.optim.Adam(twin.parameters(), lr=1e-2)
    call = (lambda m: m(**batch)) if isinstance(batch, dict) else (lambda m: m(batch))
    for step in range(3):
        torch.manual_seed(step)
        output = call(fitted)  # the model's output (its loss planned), held across the backward as a loop does
        loss = getattr(output, "loss", output)
        loss.backward()
        del output
        ours.step()
        ours.zero_grad()
        torch.manual_seed(step)
        expected = call(reference)
        expected = getattr(expected, "loss", expected)
        expected.backward()
        theirs.step()
        theirs.zero_grad()
        assert torch.equal(loss.detach(), expected.detach()), step
    for (name, p), q in zip(fitted.model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), name


def _staged(model, batch):
    """``model``'s discovered stages run plainly with autograd, no plan: called as the model is, the loss."""
    from planner.execute.stages import run_stages
    from profiles.discover import discover

    discovery = discover(model, batch)
    return lambda **call: run_stages(discovery.staged.stages, tuple(discovery.chain_inputs((), call)))


def _as_called(fitted, result):
    """What the fitted call returns for a plan's ``result``: the model's output rebuilt, or the loss."""
    return fitted.discovery.output(result) if fitted.returns == "output" else result


def _measured_peak(fitted, run, batch):
    """Bytes: the peak of one step of ``run`` on ``batch`` (the prelude's values, made before, included)."""
    from profiles.memory import storage_bytes

    inputs = fitted.discovery.chain_inputs((), batch)
    with LiveMemoryTracker() as tracker:
        output = _as_called(fitted, run(*inputs))
        getattr(output, "loss", output).backward()  # the output held: its logits live to the end of the step
        del output
    fitted.model.zero_grad(set_to_none=True)
    return tracker.peak + storage_bytes(list(inputs))


@pytest.fixture(scope="module")
def fitted_t5():
    from planner import fit

    model, batch = t5()
    return copy.deepcopy(model), fit(model, batch, "70%", stage_options=0, **FAST), batch


@pytest.fixture(scope="module")
def fitted_mixtral():
    """Mixtral fitted, and of the plans for its chain with the expert blocks' options alone, from the least budget
    up, the first that runs one: ``(model copy, fitted, batch, plan, the plan's run)``."""
    from planner import fit
    from planner.execute.chain import apply_plan
    from solvers.minimum import minimum_budget

    model, batch = mixtral()
    twin = copy.deepcopy(model)
    fitted = fit(model, batch, "85%", slots=100, **FAST)
    chain = sized_times(dataclasses.replace(fitted.chain, stages=tuple(  # only the expert blocks' options, and
        stage if "mlp" in stage.name else dataclasses.replace(stage, options=())  # times by bytes: the same plans
        for stage in fitted.chain.stages)))  # on a loaded machine (measured 0.003-0.039 s for one expert block)
    low, high = minimum_budget(chain), solvers.store_all_peak(chain)
    for step in range(10):
        plan = solvers.solve(chain, low + (high - low) * step // 10, "hierarchical", slots=100)
        if any(op.option is not None for op in plan.schedule):
            return twin, fitted, batch, plan, apply_plan(fitted.discovery.staged.stages, plan, chain)
    raise AssertionError(f"no plan runs an expert block with an option: {[s.options for s in chain.stages]}")


def test_t5_with_labels_fits_and_trains_as_its_stages_do_without_a_plan(fitted_t5):
    """Bit for bit against the discovered stages run without a plan. Against the unmodified model the first loss
    is equal and the gradients differ in their last bits (3e-8 at most): with its masks, T5's decoder runs other
    attention kernels under torch.export's capture than eagerly (its stages, planless, differ from it as much)."""
    model, fitted, batch = fitted_t5
    assert fitted.plan.recomputed_forwards > 0
    assert fitted.predicted.peak_bytes <= fitted.plan.budget_bytes
    _train_three_steps(model, batch, copy.deepcopy(fitted), reference=lambda twin: _staged(twin, batch))
    twin, copied = copy.deepcopy(model), copy.deepcopy(fitted)
    loss, expected = seeded_losses(copied, twin, batch)
    assert torch.equal(loss.detach(), expected.detach())
    for (name, p), q in zip(copied.model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_mixtral_fits_and_trains_as_the_unmodified_model(fitted_mixtral):
    model, fitted, batch, _, _ = fitted_mixtral
    _train_three_steps(model, batch, copy.deepcopy(fitted))


def test_mixtral_trains_as_the_unmodified_model_with_options_dropping_values_inside_its_expert_blocks(
        fitted_mixtral):
    model, fitted, batch, plan, run = fitted_mixtral
    moe = [stage for stage in fitted.chain.stages if "mlp" in stage.name]
    assert moe and all(stage.options for stage in moe)
    _train_three_steps(model, batch, _Called(*copy.deepcopy((fitted, run))))


class _Called(torch.nn.Module):
    """A plan's run called as the model is (its inputs through the fitted model's prelude)."""

    def __init__(self, fitted, run):
        super().__init__()
        self.model, self.fitted, self.run = fitted.model, fitted, run

    def forward(self, **batch):
        return _as_called(self.fitted, self.run(*self.fitted.discovery.chain_inputs((), batch)))


@pytest.mark.parametrize("which", ["t5", "mixtral"])
def test_a_fitted_step_of_an_in_place_writing_model_measures_its_prediction(which, fitted_t5, fitted_mixtral,
                                                                            threads):
    """T5 at its fitted plan; Mixtral at the plan running an expert block with an option."""
    if which == "t5":
        _, fitted, batch = fitted_t5
        run, predicted = fitted._current.run, fitted.predicted
    else:
        _, fitted, batch, plan, run = fitted_mixtral
        predicted = plan.predicted
    measured = _measured_peak(fitted, run, batch)
    assert abs(measured / predicted.peak_bytes - 1) <= 0.01, (threads, measured, predicted)


def test_a_buffer_the_prelude_makes_and_a_stage_fills_in_place_is_not_filled_twice():
    """``out = zeros(...)`` from a shape is a shared value; its ``index_add_`` runs in a stage that the plan
    recomputes: the stage writes its own copy, so the recomputation does not add the experts' outputs again."""
    from planner import fit

    torch.manual_seed(0)
    model = ScatterMoE().train()
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(3))
    twin = copy.deepcopy(model)
    fitted = fit(model, ids, "80%", stage_options=0, **FAST)
    assert fitted.plan.recomputed_forwards > 0
    _train_three_steps(twin, ids, fitted)


class Dispatch(nn.Module):
    """``buf = empty_like(x); buf[idx] = f(x); return g(buf)`` and a sum read before an in-place division."""

    def __init__(self, dim=8):
        super().__init__()
        self.f, self.g = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x):
        order = torch.argsort(x[:, 0])
        buf = torch.empty_like(x)
        buf[order] = torch.relu(self.f(x))
        weights = (2 * x).abs() + 1
        total = weights.sum(-1, keepdim=True)
        weights /= total
        return self.g(torch.tanh(buf)) * weights


def test_an_option_never_drops_a_value_an_in_place_write_fills_or_changes_after_it():
    """On the graph as discovery captures it (in-place writes kept): the buffer ``index_put_`` fills and the sum
    read before ``/=`` are never dropped, every candidate keeps them, gradients with the most dropped are the plain
    ones, and an option naming the buffer is refused in one line."""
    from planner.execute.selective import forward_nodes, operations, run_with_option
    from profiles.options import candidate_recomputes

    torch.manual_seed(0)
    x = torch.randn(6, 8)
    stage = torch.export.export(Dispatch(), (x,), strict=False).module()
    nodes = forward_nodes(stage, (x.detach().requires_grad_(),))
    graph_nodes = operations(stage)
    kinds = {str(n.target): nodes[k] for k, n in enumerate(graph_nodes)}
    assert "aten.index_put_.default" in kinds and "aten.div_.Tensor" in kinds, sorted(kinds)
    assert not kinds["aten.empty_like.default"].recomputable  # its contents come from the index_put_
    assert not kinds["aten.sum.dim_IntList"].recomputable  # read before weights /= total
    assert kinds["aten.relu.default"].recomputable and kinds["aten.tanh.default"].recomputable
    candidates = candidate_recomputes(nodes, 8)
    assert candidates and all(nodes[p].recomputable for recompute in candidates for p in recompute)
    plain_input, option_input = x.clone().requires_grad_(), x.clone().requires_grad_()
    stage(plain_input).square().sum().backward()
    plain = [p.grad.clone() for p in stage.parameters()] + [plain_input.grad]
    stage.zero_grad()
    recompute = tuple(k for k, n in enumerate(nodes) if n.recomputable and n.bytes)
    run_with_option(stage, recompute, option_input).square().sum().backward()
    for a, b in zip(plain, [p.grad for p in stage.parameters()] + [option_input.grad]):
        assert torch.equal(a, b)
    empty = next(k for k, n in enumerate(graph_nodes) if str(n.target) == "aten.empty_like.default")
    with pytest.raises(MemschedError, match=r"a stage option recomputes empty_like.*in-place write fills"):
        run_with_option(stage, (empty,), x)


class Counter(nn.Module):
    """A stage that is not repeatable: it advances the positions it is given in place, so its first run works and
    a second indexes past the table."""

    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(4, 8)

    def forward(self, x, positions):
        positions.add_(2)
        return x * self.table(positions).sum()


def test_a_stage_that_fails_when_run_again_says_so_in_one_line():
    from profiles.chain_profiler import profile_chain

    stages = [("counter", Counter())]
    with pytest.raises(MemschedError) as error:
        profile_chain(stages, (torch.randn(3, 8), torch.tensor([0, 1, 0])), warmup=0, repeats=1)
    message = one_line(error, "stage 0 (counter)", "again")
    assert "failed on its example input" not in message, message
