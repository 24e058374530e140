"""Tied weights and parameters without a gradient on the graph path (capture, profile, solve, executor).

The model is tests/fixtures/tied_lm.py: a token embedding whose weight is also the output head's, given to the
CLI as a ``path/to/file.py:build`` SPEC. Its graph is profiled and solved once through the CLI
(``memsched profile --graph --estimate``: sizes exact, times from FLOPs, so Checkmate's plan is the same on
every run), then run by the graph executor and by ``memsched train --graph``, at the default thread count and at one
thread, each against the plain eager step.

Memory is counted as in tests/execute/test_execute_graph.py: the tracker counts what the step allocates (gradients
``None`` before), and the parameters, buffers, inputs and targets are the graph's ``fixed_bytes``.
"""


import pytest
import torch
from torch import nn
from torch.testing import assert_close

import cli
from checks import measured_ratios, run
from paths import FIXTURES
from planner.execute.graph import GraphExecutor
from planner.execute.live_memory import LiveMemoryTracker
from planner.graph import load_graph
from planner.plan import load_plan
from profiles.graph_profiler import profile_graph
from profiles.spec import load_model
from solvers import solve_graph, store_all_graph_peak

SPEC = str(FIXTURES / "tied_lm.py") + ":build"
NODES = 30
BUDGET = "80%"  # of the store-all peak: Checkmate's plan recomputes and is save-only
TIED = ("embed.tok.weight", "head.lm_head.weight")



def build():
    return load_model(SPEC)[0]


def parameters(model) -> dict:
    """Every name of every parameter (a tied one under both names) -> the parameter."""
    return {f"{stage}.{name}": p for stage, module in model.stages
            for name, p in module.named_parameters(remove_duplicate=False)}


def plain_grads(model) -> dict:
    """The unmodified model's step: gradients by every parameter name."""
    activation = model.example_inputs[0]
    for _, module in model.stages:
        activation = module(activation)
    model.loss_fn(activation).backward()
    return {name: p.grad for name, p in parameters(model).items()}


def assert_plain_grads(model, where):
    grads = plain_grads(build())
    for name, parameter in parameters(model).items():
        assert_close(parameter.grad, grads[name], msg=lambda m, name=name: f"{where}: {name}: {m}")
    first, second = (parameters(model)[name] for name in TIED)
    assert first is second and first.grad is second.grad  # one parameter, one gradient: the sum of both uses


def clear_grads(model):
    for parameter in parameters(model).values():
        parameter.grad = None


@pytest.fixture(scope="module")
def solved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tied")
    graph_path, plan_path = folder / "graph.json", folder / "plan.json"
    assert cli.main(["profile", SPEC, "--graph", "--estimate", "--nodes", str(NODES), "-o", str(graph_path)]) == 0
    assert cli.main(["solve", str(graph_path), "--budget", BUDGET, "--solver", "checkmate", "--time-limit", "20",
                     "-o", str(plan_path)]) == 0
    return graph_path, plan_path, load_graph(graph_path), load_plan(plan_path)


@pytest.fixture(scope="module")
def executor(solved):
    _, _, graph, plan = solved
    model = build()
    return model, GraphExecutor(model, plan, graph)


def test_a_tied_weight_is_one_parameter_with_one_gradient(solved, executor):
    _, _, graph, plan = solved
    model, run_by_plan = executor
    distinct = {p.untyped_storage()._cdata: p.untyped_storage().nbytes() for p in parameters(model).values()}
    target = model.loss_fn.__closure__[0].cell_contents
    assert graph.fixed_bytes == sum(distinct.values()) + sum(t.untyped_storage().nbytes()
                                                             for t in [*model.example_inputs, target])
    first = {}
    for name, parameter in parameters(model).items():
        first.setdefault(id(parameter), name)
    names = set(first.values())
    assert TIED[1] not in names and {p for node in graph.nodes for p in node.params} == names
    readers = [node for node in graph.nodes if TIED[0] in node.params and not node.backward]
    assert len(readers) >= 2  # the embedding lookup and the logits
    assert sorted(run_by_plan.joint.param_grads.values()) == sorted(f"stages.{name}" for name in names)
    assert plan.recomputed_forwards > 0


def test_graph_executor_runs_the_plain_step_at_the_predicted_peak(solved, executor, threads):
    _, _, graph, plan = solved
    model, run_by_plan = executor
    clear_grads(model)
    with LiveMemoryTracker() as tracker:
        run_by_plan.step()
    measured, predicted = tracker.peak + graph.fixed_bytes, plan.predicted.peak_bytes
    print(f"graph executor, {threads} threads: measured {measured} B, predicted {predicted} B "
          f"({measured / predicted:.4f}), {plan.recomputed_forwards} recomputations")
    assert abs(measured / predicted - 1) <= 0.01
    assert_plain_grads(model, f"graph executor, {threads} threads")
    grads = {name: p.grad.clone() for name, p in parameters(model).items()}
    run_by_plan.step()  # a second step adds into .grad once per parameter, as autograd does
    for name, parameter in parameters(model).items():
        assert_close(parameter.grad, 2 * grads[name])


def test_train_graph_follows_the_plan(solved, threads, capsys):
    graph_path, plan_path, _, _ = solved
    status, out, _ = run(capsys, "train", SPEC, "--graph", str(graph_path), "--plan", str(plan_path), "--steps", "1")
    assert status == 0, out
    ratios = measured_ratios(out)
    print(f"memsched train --graph, {threads} threads: measured/predicted {ratios}")
    assert len(ratios) == 1 and abs(ratios[0] - 1) <= 0.01, out


class SharedThrice(nn.Module):
    """One weight under three names, a Linear never called and one called only on a branch not taken."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.b.weight = self.c.weight = self.a.weight
        self.unused, self.branch = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.c(torch.relu(self.b(torch.relu(self.a(x)))))
        return self.branch(h) if h.shape[0] > 100 else h


@pytest.fixture(scope="module")
def shared():
    torch.manual_seed(0)
    model, x = SharedThrice(), torch.randn(4, 8)
    graph = profile_graph(model, (x,), None, nodes=20, estimate=True, name="shared")
    plan = solve_graph(graph, store_all_graph_peak(graph), solver="store_all")
    return model, x, graph, plan, GraphExecutor(model, plan, graph, example_inputs=(x,))


def test_parameters_without_a_gradient_keep_grad_none(shared, threads):
    model, x, graph, plan, executor = shared
    assert graph.fixed_bytes == sum(p.numel() * 4 for p in model.parameters()) + x.numel() * 4  # unused included
    assert {p for node in graph.nodes for p in node.params} == {f"model.{name}" for name in
                                                                ("a.weight", "a.bias", "b.bias", "c.bias")}
    model.zero_grad(set_to_none=True)
    with LiveMemoryTracker() as tracker:
        executor.step()
    assert tracker.peak + graph.fixed_bytes == plan.predicted.peak_bytes
    grads = {name: p.grad for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    model(x).mean().backward()
    for name, parameter in model.named_parameters():
        if parameter.grad is None:
            assert grads[name] is None, name
        else:
            assert_close(grads[name], parameter.grad, msg=lambda m, name=name: f"{name}: {m}")
    assert {name for name, grad in grads.items() if grad is None} == {"unused.weight", "unused.bias",
                                                                     "branch.weight", "branch.bias"}
