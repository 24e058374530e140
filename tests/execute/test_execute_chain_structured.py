"""The chain executor (planner/execute/chain.py) on stages with extra arguments and structured activations.

Tuples and dicts between stages, an output derived from another output of the same stage, a view of the
input handed on, an extra input that needs its gradient: each planned step is the plain step, exactly (the
comparison of tests/execute/test_execute_chain.py), and inference returns the plain output.
"""


import pytest
import torch
from test_execute_chain import plain_forward, plain_step, planned_step, profile
from torch import nn
from torch.testing import assert_close

from paths import FIXTURES
from planner.execute.chain import apply_plan
from profiles.spec import load_model
from solvers import solve, store_all_peak
from solvers.minimum import minimum_budget

MASKED = str(FIXTURES / "masked_model.py") + ":build"


# --------------------------------------------------------------------------------------------------
# Extra arguments


@pytest.fixture(scope="module")
def masked():
    model, _ = load_model(MASKED)
    chain = profile(model)
    loss, reference = plain_step(model)
    return model, chain, loss, reference


@pytest.mark.parametrize("solver", ["rotor", "recompute_all"])
def test_stages_with_a_mask_argument(masked, solver):
    model, chain, loss, reference = masked
    assert len(model.example_inputs) == 2  # (ids, mask): the mask goes to every stage
    plan = solve(chain, int(0.75 * store_all_peak(chain)), solver)
    assert plan.recomputed_forwards > 0
    planned_loss, planned = planned_step(model, plan, chain)
    assert_close(planned_loss, loss)
    assert_close(planned, reference)


class _TupleOut(nn.Module):
    """Returns ``(y, y.relu())``: the second output is computed from the first, inside the stage."""

    def __init__(self, width):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        y = self.linear(x)
        return y, y.relu()


class _IndependentTupleOut(nn.Module):
    """Returns ``(first(x), second(x).relu())``: neither output is computed from the other."""

    def __init__(self, width):
        super().__init__()
        self.first = nn.Linear(width, width)
        self.second = nn.Linear(width, width)

    def forward(self, x):
        return self.first(x), self.second(x).relu()


class _TupleToDict(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.first = nn.Linear(width, width)
        self.second = nn.Linear(width, width)

    def forward(self, pair):
        y, r = pair
        return {"a": torch.tanh(self.first(y)) * r, "b": self.second(r).sigmoid()}


class _DictIn(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, named):
        return self.linear(named["a"] + named["b"])


def _structured(first_stage):
    """stage0 returns a tuple, stage1 takes it and returns a dict, stage2 takes the dict and returns a tensor."""
    from planner.execute.stages import StagedModel

    torch.manual_seed(0)
    width, batch = 16, 64
    stages = [("tuple", first_stage(width)), ("dict", _TupleToDict(width)), ("tensor", _DictIn(width))]
    target = torch.randn(batch, width)
    model = StagedModel("structured", stages, (torch.randn(batch, width),), lambda y: ((y - target) ** 2).mean())
    chain = profile(model)
    loss, reference = plain_step(model)
    return model, chain, loss, reference


@pytest.fixture(scope="module")
def structured():
    return _structured(_TupleOut)


@pytest.fixture(scope="module")
def independent():
    return _structured(_IndependentTupleOut)


@pytest.mark.parametrize("solver", ["rotor", "recompute_all", "sqrt", "revolve"])
def test_tuple_and_dict_activations(independent, solver):
    model, chain, loss, reference = independent
    plan = solve(chain, minimum_budget(chain), solver)  # three stages: only the least memory forces recomputation
    assert plan.recomputed_forwards > 0
    planned_loss, planned = planned_step(model, plan, chain)
    assert_close(planned_loss, loss)
    assert_close(planned, reference)


@pytest.mark.parametrize("solver", ["store_all", "rotor", "recompute_all"])
def test_tuple_whose_second_output_is_computed_from_the_first(structured, solver):
    model, chain, loss, reference = structured
    budget = store_all_peak(chain) if solver == "store_all" else minimum_budget(chain)
    plan = solve(chain, budget, solver)
    planned_loss, planned = planned_step(model, plan, chain)
    assert_close(planned_loss, loss)
    assert_close(planned, reference)


def test_a_stage_returning_an_output_and_a_view_of_it():
    from planner.execute.stages import StagedModel

    class WithView(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(8, 8)

        def forward(self, x):
            h = torch.tanh(self.linear(x))
            return h, h[:, 0]

    class Combine(nn.Module):
        def forward(self, pair):
            h, first = pair
            return h * first[:, None]

    torch.manual_seed(0)
    model = StagedModel("view", [("view", WithView()), ("combine", Combine())], (torch.randn(16, 8),),
                       lambda y: (y ** 2).mean())
    chain = profile(model)
    _, reference = plain_step(model)
    _, planned = planned_step(model, solve(chain, store_all_peak(chain), "store_all"), chain)
    assert_close(planned, reference)


def test_an_extra_input_that_requires_grad_gets_its_gradient():
    from planner.execute.stages import StagedModel

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(8, 8)

        def forward(self, x, scale):
            return torch.tanh(self.linear(x)) * scale

    torch.manual_seed(0)
    scale = torch.rand(16, 8).requires_grad_(True)
    model = StagedModel("extra", [(f"s{k}", Scaled()) for k in range(3)], (torch.randn(16, 8), scale),
                       lambda y: (y ** 2).mean())
    chain = profile(model)
    plan = solve(chain, store_all_peak(chain), "store_all")
    plain_step(model)
    reference = scale.grad.clone()
    scale.grad = None
    planned_step(model, plan, chain)
    assert scale.grad is not None, "the extra input's gradient was dropped"
    assert_close(scale.grad, reference)


# --------------------------------------------------------------------------------------------------
# Inference


def test_inference_with_extra_arguments_and_structured_outputs(masked, structured, independent):
    for model, chain, _, _ in (masked, structured, independent):
        planned = apply_plan(model.stages, solve(chain, minimum_budget(chain), "recompute_all"), chain)
        with torch.no_grad():
            assert_close(planned(*model.example_inputs), plain_forward(model))
