"""``torch.compile(fitted)`` (issue 40, item 7): the planned step runs eagerly inside the compiled call, so Dynamo
compiles no frame of the executor's loop over the schedule, which it compiled again per operation before (the
recompile limit's warnings in four GPT-2 steps); the gradients are those of the fitted model called directly."""

import copy

import torch

from discovery_models import MODELS
from planner import fit


def test_a_compiled_fitted_model_trains_without_recompiling_and_as_the_fitted_model():
    model, batch, _ = MODELS["gpt2"]()
    fitted = fit(copy.deepcopy(model), batch, "60%", progress=False, stage_options=0, warmup=0, repeats=1)
    twin = copy.deepcopy(fitted)
    compiled = torch.compile(fitted)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):  # any recompilation raises
        for step in range(3):
            for module in (compiled, twin):
                module.zero_grad(set_to_none=True)
                torch.manual_seed(step)
                module(**batch).loss.backward()
            for mine, theirs in zip(fitted.parameters(), twin.parameters()):
                torch.testing.assert_close(mine.grad, theirs.grad, rtol=0, atol=0)
