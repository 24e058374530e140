"""The graph profiler (profiles/graph_profiler.py): a valid, deterministic graph whose sizes are exact.

Exactness against a real step is checked in tests/execute/test_execute_graph.py (the executor's memory after
every operation is the simulator's); here: the graph's structure, determinism, estimates equal to
measurements, the node target, and one-line errors.
"""

import pytest
import torch

from checks import one_line
from planner.errors import MemschedError
from planner.graph import Graph
from profiles import zoo
from profiles.graph_profiler import profile_graph

GPT = "gpt-tiny:layers=2,d=16,heads=2,seq=16,vocab=32,batch=4"
RESNET = "resnet-tiny:blocks=2,channels=4,size=8,batch=4"
UNET = "unet-tiny:levels=2,channels=4,size=16,batch=2"


def build(spec):
    name, options = zoo.parse_spec(spec)
    return zoo.build(name, **options)


def profile(spec, **options):
    model = build(spec)
    options = {"nodes": 40, "warmup": 0, "repeats": 1, **options}
    return model, profile_graph(model.stages, model.example_inputs, model.loss_fn, name=spec.split(":")[0], **options)


def sizes(graph):
    return [(n.name, n.deps, n.out_bytes, n.params, n.keep, n.random, n.backward) for n in graph.nodes]


def test_graph_structure_of_a_transformer():
    model, graph = profile(GPT, estimate=True)
    assert isinstance(graph, Graph) and graph.source == "estimate" and graph.size <= 40
    Graph.from_dict(graph.to_dict())  # valid memsched.graph/1
    tensors = [t for _, m in model.stages for t in [*m.parameters(), *m.buffers()]] + list(model.example_inputs)
    target = model.loss_fn.__closure__[0].cell_contents  # the targets the loss closes over
    assert graph.fixed_bytes == sum(t.untyped_storage().nbytes() for t in tensors + [target])
    parameters = {f"{s}.{k}" for s, m in model.stages for k, _ in m.named_parameters()}
    assert {p for n in graph.nodes for p in n.params} == parameters
    keep = [n for n in graph.nodes if n.keep]
    assert keep and any(not n.backward for n in keep)  # the loss (forward) and the parameter gradients
    assert (sum(n.out_bytes for n in keep if n.backward)
            >= sum(p.numel() * 4 for _, m in model.stages for p in m.parameters()))
    assert any(n.random for n in graph.nodes) and not any(n.random for n in graph.nodes if n.backward)
    forward = [k for k, n in enumerate(graph.nodes) if not n.backward]
    assert forward == list(range(len(forward)))  # the forward first, then the backward


def test_estimates_are_deterministic_and_equal_the_measured_sizes():
    for spec in (RESNET, UNET):
        _, estimate = profile(spec, estimate=True)
        _, again = profile(spec, estimate=True)
        _, measured = profile(spec)
        assert estimate.fingerprint() == again.fingerprint()
        assert sizes(estimate) == sizes(measured), spec
        # Transients too, except that a fake (meta) batch-norm backward allocates the input gradient even
        # when its output_mask drops it, which the CPU kernel does not: estimates may only overstate.
        for e, m in zip(estimate.nodes, measured.nodes):
            assert e.tmp_bytes == m.tmp_bytes or (e.tmp_bytes > m.tmp_bytes and "batch_norm_backward" in e.name), e.name
        assert measured.source == "measured" and all(n.time > 0 for n in measured.nodes)
        assert estimate.fixed_bytes == measured.fixed_bytes


def test_capture_leaves_the_model_as_it_was():
    model = build(RESNET)
    buffers = [b.clone() for _, m in model.stages for b in m.buffers()]
    state = torch.get_rng_state()
    profile_graph(model.stages, model.example_inputs, model.loss_fn, nodes=40, warmup=0, repeats=1)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(a, b) for a, b in zip(buffers, [b for _, m in model.stages for b in m.buffers()]))
    assert all(p.grad is None for _, m in model.stages for p in m.parameters())


def test_node_target():
    _, fine = profile(GPT, nodes=1000, estimate=True)
    _, coarse = profile(GPT, nodes=20, estimate=True)
    assert coarse.size <= 20 < fine.size
    # Coarsening keeps every byte: the parameter gradients kept and the store-all peak's floor, the fixed bytes.
    assert fine.fixed_bytes == coarse.fixed_bytes
    assert sum(n.out_bytes for n in fine.nodes if n.keep) == sum(n.out_bytes for n in coarse.nodes if n.keep)


@pytest.mark.parametrize("call, expected", [
    (lambda m: profile_graph(m.stages, m.example_inputs, m.loss_fn, nodes=0), "nodes must be a whole number"),
    (lambda m: profile_graph(m.stages, (m.example_inputs[0], 3), m.loss_fn), "example_inputs must be"),
    (lambda m: profile_graph(m.stages, m.example_inputs, lambda out: out.sum() + undefined_name),  # noqa: F821
     "capturing the joint graph failed"),
])
def test_bad_input_is_one_line(call, expected):
    with pytest.raises(MemschedError) as info:
        call(build(RESNET))
    one_line(info, expected)
