"""`memsched profile --graph` and `memsched train --graph`: the graph executor measured against the prediction."""

import json

import pytest

from checks import measured_ratios, one_error_line, run
from planner.graph import load_graph

TINY = "gpt-tiny:layers=1,d=16,heads=2,seq=8,vocab=32,batch=4"
OTHER = "gpt-tiny:layers=1,d=16,heads=2,seq=8,vocab=32,batch=2"


@pytest.mark.slow
def test_profile_graph_writes_a_graph_and_train_follows_a_plan(capsys, tmp_path):
    path = tmp_path / "g.json"
    status, out, _ = run(capsys, "profile", TINY, "--graph", "--nodes", "30", "--repeats", "1", "-o", str(path))
    assert status == 0 and f"graph written to {path}" in out
    graph = load_graph(path)
    assert 2 <= graph.size <= 30 and any(node.keep for node in graph.nodes)

    plan_path = tmp_path / "plan.json"
    status, out, _ = run(capsys, "solve", str(path), "--budget", "75%", "--solver", "checkmate", "--time-limit", "20",
                         "-o", str(plan_path))
    assert status == 0, out
    status, out, _ = run(capsys, "train", TINY, "--graph", str(path), "--plan", str(plan_path), "--steps", "2")
    assert status == 0
    ratios = measured_ratios(out)
    assert len(ratios) == 2 and all(abs(ratio - 1) <= 0.05 for ratio in ratios), out
    assert "unmodified model: peak" in out and "less memory" in out


def test_train_graph_profiles_and_solves_when_given_a_budget(capsys):
    status, out, _ = run(capsys, "train", TINY, "--graph", "--nodes", "30", "--budget", "100%", "--steps", "1")
    assert status == 0
    assert "store_all" in out  # auto: storing everything fits
    assert measured_ratios(out) == [1.0]


def test_a_graph_plan_for_another_model_is_refused_before_training(capsys, tmp_path):
    path, other, plan_path = tmp_path / "g.json", tmp_path / "other.json", tmp_path / "plan.json"
    assert run(capsys, "profile", TINY, "--graph", "--nodes", "30", "--repeats", "1", "-o", str(path))[0] == 0
    assert run(capsys, "profile", OTHER, "--graph", "--nodes", "30", "--repeats", "1", "-o", str(other))[0] == 0
    assert run(capsys, "solve", str(other), "--budget", "100%", "-o", str(plan_path))[0] == 0
    line = one_error_line(*run(capsys, "train", TINY, "--graph", str(path), "--plan", str(plan_path)))
    assert "graph" in line
    # the plan with its own graph, on a model of another batch size: the captured step differs
    line = one_error_line(*run(capsys, "train", TINY, "--graph", str(other), "--plan", str(plan_path)))
    assert "another graph" in line or "differ" in line


def test_graph_and_chain_options_are_not_mixed(capsys, tmp_path):
    chain = tmp_path / "c.json"
    chain.write_text(json.dumps({}))
    line = one_error_line(*run(capsys, "train", TINY, "--graph", "--chain", str(chain), "--budget", "50%"))
    assert "--chain" in line
    line = one_error_line(*run(capsys, "train", TINY, "--budget", "50%", "--time-limit", "5"))
    assert "--time-limit" in line


def test_profile_graph_estimate_allocates_no_activations_and_gives_the_measured_sizes(capsys, tmp_path):
    estimated, measured = tmp_path / "e.json", tmp_path / "m.json"
    assert run(capsys, "profile", TINY, "--graph", "--estimate", "--nodes", "30", "-o", str(estimated))[0] == 0
    assert run(capsys, "profile", TINY, "--graph", "--nodes", "30", "--repeats", "1", "-o", str(measured))[0] == 0
    a, b = load_graph(estimated), load_graph(measured)
    assert a.source == "estimate" and b.source == "measured"
    assert [(n.name, n.deps, n.out_bytes) for n in a.nodes] == [(n.name, n.deps, n.out_bytes) for n in b.nodes]
    assert a.fixed_bytes == b.fixed_bytes
