"""memsched.graph/1 (planner/graph.py) and graph plans (planner/plan.py): round trips, fingerprints, validation."""

import copy
import json

import pytest

from checks import one_line
from planner.errors import MemschedError
from planner.graph import Graph, GraphNode, load_graph, save_graph
from planner.plan import Plan, check_plan_matches, load_plan, save_plan
from planner.simulate import simulate
from profiles.synthetic import random_chain, random_graph
from solvers import solve, solve_graph, store_all_graph_peak


def small_graph() -> Graph:
    """a -> b -> c (keep), a -> c; d reads b and nothing reads d."""
    return Graph("small", (GraphNode("a", 1.0, 10, ()), GraphNode("b", 2.0, 20, (0,), tmp_bytes=5),
                           GraphNode("c", 0.5, 3, (0, 1), keep=True), GraphNode("d", 0.25, 7, (1,))),
                 fixed_bytes=100).check()


def test_graph_round_trips(tmp_path):
    graph = random_graph(4, 30, shape="transformer")
    save_graph(graph, tmp_path / "g.json")
    assert load_graph(tmp_path / "g.json") == graph
    assert Graph.from_dict(graph.to_dict()) == graph
    assert load_graph(tmp_path / "g.json").fingerprint() == graph.fingerprint()


def test_defaults_and_properties():
    graph = Graph.from_dict({"format": "memsched.graph/1",
                             "nodes": [{"time": 1, "out_bytes": 4, "deps": []},
                                       {"time": 2, "out_bytes": 1e3, "deps": [0]}]})
    assert graph.nodes[1] == GraphNode("node1", 2.0, 1000, (0,))
    assert (graph.name, graph.device, graph.source, graph.fixed_bytes) == ("graph", "cpu", "measured", 0)
    assert graph.size == 2 and graph.consumers == ((1,), ()) and graph.compute_time == 3.0


def test_fingerprint_changes_with_any_field():
    base = small_graph().to_dict()
    prints = {Graph.from_dict(base).fingerprint()}
    for path, value in ((("nodes", 1, "time"), 2.5), (("nodes", 0, "out_bytes"), 11), (("fixed_bytes",), 1),
                        (("nodes", 3, "keep"), True), (("nodes", 1, "random"), True), (("nodes", 3, "deps"), [0, 1]),
                        (("nodes", 1, "params"), ["w"]), (("name",), "other")):
        data = copy.deepcopy(base)
        target = data
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        prints.add(Graph.from_dict(data).fingerprint())
    assert len(prints) == 9


def _mutated(change):
    data = small_graph().to_dict()
    change(data)
    return data


INVALID = [
    (lambda d: d["nodes"][2].update(deps=[0, 2]), ["nodes[2].deps[1] = 2", "earlier node", "cycle"]),
    (lambda d: d["nodes"][1].update(deps=[3]), ["nodes[1].deps[0] = 3", "earlier node"]),
    (lambda d: d["nodes"][2].update(deps=[0, 0]), ["nodes[2].deps[1] = 0", "twice"]),
    (lambda d: d["nodes"][2].update(deps=[-1]), ["nodes[2].deps[0] = -1"]),
    (lambda d: d["nodes"][2].update(deps=["a"]), ["nodes[2].deps[0]", "'a'"]),
    (lambda d: d["nodes"][1].update(out_bytes=-1), ["nodes[1].out_bytes", ">= 0"]),
    (lambda d: d["nodes"][1].update(tmp_bytes=1.5), ["nodes[1].tmp_bytes", "whole number"]),
    (lambda d: d["nodes"][1].update(time=float("inf")), ["nodes[1].time", "finite"]),
    (lambda d: d["nodes"][1].update(keep="yes"), ["nodes[1].keep", "true or false"]),
    (lambda d: d["nodes"][1].update(colour=1), ["nodes[1]", "unknown field 'colour'"]),
    (lambda d: d["nodes"][1].update(params="w"), ["nodes[1].params", "list"]),
    (lambda d: d["nodes"][3].update(name="a"), ["nodes[3].name 'a'", "nodes[0]", "unique"]),
    (lambda d: d["nodes"][1].pop("deps"), ["nodes[1]", "missing field 'deps'"]),
    (lambda d: d.update(format="memsched.chain/1"), ["format", "memsched.graph/1"]),
    (lambda d: d.update(format="memsched.graph/2"), ["memsched.graph/2", "not supported"]),
    (lambda d: d.update(nodes=[]), ["nodes", "non-empty"]),
    (lambda d: d.update(source="guessed"), ["source", "guessed"]),
    (lambda d: d.update(fixed_bytes=-3), ["fixed_bytes", ">= 0"]),
    (lambda d: d.update(extra=1), ["unknown field 'extra'"]),
]


@pytest.mark.parametrize("change, fragments", INVALID)
def test_invalid_graph_is_one_line_naming_the_field(tmp_path, change, fragments):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(_mutated(change)))
    with pytest.raises(MemschedError) as excinfo:
        load_graph(path)
    message = one_line(excinfo, str(path))
    for fragment in fragments:
        assert fragment in message


def test_graph_plan_round_trips_and_is_checked(tmp_path):
    graph = random_graph(2, 16, scale_bytes=1000)
    plan = solve_graph(graph, store_all_graph_peak(graph) - 1, "checkmate")
    save_plan(plan, tmp_path / "p.json")
    loaded = load_plan(tmp_path / "p.json")
    assert loaded == plan and loaded.kind == "graph" and loaded.gap == 0.0
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["schedule"][0] == {"op": "compute", "node": 0} and data["solver"]["gap"] == 0.0
    result = simulate(graph, loaded)
    assert (result.peak_bytes, result.time) == (plan.predicted.peak_bytes, plan.predicted.time)
    other = random_graph(3, 16, scale_bytes=1000)
    with pytest.raises(MemschedError, match="was solved for graph .* not for graph"):
        check_plan_matches(plan, other)
    chain = random_chain(4, 1)
    with pytest.raises(MemschedError, match="plan of kind 'graph'.*not for a chain"):
        check_plan_matches(plan, chain)
    chain_plan = solve(chain, 10**12)
    assert "gap" not in chain_plan.to_dict()["solver"]
    with pytest.raises(MemschedError, match="plan of kind 'chain'.*not for a graph"):
        check_plan_matches(chain_plan, graph)


@pytest.mark.parametrize("change, fragment", [
    (lambda d: d["schedule"][0].update(op="F_all"), "schedule[0]: unknown op 'F_all' in a plan of kind 'graph'"),
    (lambda d: d["schedule"][0].update(node=-1), "schedule[0]: node must be a non-negative integer"),
    (lambda d: d["schedule"][0].update(stage=0), "schedule[0]: unknown field 'stage'"),
    (lambda d: d["schedule"][0].pop("node"), "schedule[0]: missing field 'node'"),
    (lambda d: d["solver"].update(gap=-0.5), "solver.gap must be a fraction >= 0"),
    (lambda d: d.update(kind="tree"), "plan kind 'tree' is not supported"),
])
def test_invalid_graph_plans(change, fragment):
    graph = small_graph()
    data = solve_graph(graph, store_all_graph_peak(graph)).to_dict()
    change(data)
    with pytest.raises(MemschedError) as excinfo:
        Plan.from_dict(data)
    one_line(excinfo, fragment)
