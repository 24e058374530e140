"""A budget Checkmate's class cannot meet is not called infeasible when Moccasin's can: ``auto`` falls back to
Moccasin over any order, and each solver's error names the schedule class it proved empty.

The graphs are tiny random training graphs whose classes the exhaustive search of tests/graph_brute.py
separates: ``REORDER`` (5 nodes) fits 67 bytes in any order (the kept loss computed after the backward, no
recomputation) but needs 71 in a frontier-advancing schedule; ``NONE`` (7 nodes) has no schedule below 142
bytes though its lower bound is 138, and none with two computations per node at 142; ``THIRD`` (7 nodes) fits
148 bytes in a frontier-advancing schedule but not with two computations per node.
"""

import pytest

import cli
from checks import one_line
from oracles.graph_brute import fastest_time, least_peak
from planner.errors import MemschedError
from planner.graph import save_graph
from profiles.synthetic import random_graph
from solvers import graph_lower_bound, solve_graph


def reorder_graph():
    return random_graph(1, 5, scale_bytes=20)


def none_graph():
    return random_graph(2, 7, scale_bytes=20)


def third_graph():
    return random_graph(5, 7, scale_bytes=20, shape="resnet")


def error_of(*args, **kwargs) -> str:
    with pytest.raises(MemschedError) as info:
        solve_graph(*args, **kwargs)
    message = one_line(info)
    assert "infeasible" not in message, message
    return message


def test_the_classes_differ_as_the_tests_assume():
    reorder, none, third = reorder_graph(), none_graph(), third_graph()
    assert (least_peak(reorder), least_peak(reorder, frontier=True)) == (67, 71)
    assert fastest_time(reorder, 70) == pytest.approx(reorder.compute_time, rel=1e-12)  # a reordering alone
    assert (graph_lower_bound(none), least_peak(none)) == (138, 142)
    assert fastest_time(none, 142, max_computations=2) == float("inf")
    assert least_peak(third, frontier=True) == 148
    assert fastest_time(third, 148, max_computations=2) == float("inf")


def test_auto_falls_back_to_moccasin_when_no_frontier_advancing_schedule_fits():
    graph = reorder_graph()
    for budget in (67, 70):
        plan = solve_graph(graph, budget, "auto")
        assert plan.solver == "moccasin" and plan.optimal and plan.params == {"max_computations": 2}
        assert plan.predicted.peak_bytes <= budget
        assert plan.predicted.time == pytest.approx(fastest_time(graph, budget), rel=1e-9)
    assert solve_graph(graph, 71, "auto").solver == "store_all"
    plan = solve_graph(graph, 70, "auto", time_limit=20)
    assert plan.solver == "moccasin" and plan.params == {"max_computations": 2, "time_limit": 20}


def test_checkmate_names_its_class_and_moccasin():
    message = error_of(reorder_graph(), 70, "checkmate")
    assert message.startswith("checkmate: no frontier-advancing schedule (first computations in index order) "
                              "fits 70 B (70 bytes)"), message
    assert "the least memory of any frontier-advancing schedule is 71 B (71 bytes)" in message
    assert "moccasin (any order) may: --solver moccasin" in message


def test_moccasin_names_its_class_and_what_may_fit():
    message = error_of(reorder_graph(), 70, "moccasin", first_order="index")
    assert message.startswith("moccasin: no schedule with at most 2 computations per node (first computations "
                              "in index order) fits 70 B"), message
    assert "--max-computations 3 or --first-order free" in message
    message = error_of(third_graph(), 148, "moccasin")
    assert "at most 2 computations per node (any order)" in message
    assert "a frontier-advancing one fits" in message and "--solver checkmate" in message
    assert solve_graph(third_graph(), 148, "checkmate").predicted.peak_bytes <= 148


def test_auto_names_both_classes_when_neither_fits():
    graph = none_graph()
    message = error_of(graph, 141, "auto")
    assert message.startswith("no frontier-advancing schedule (first computations in index order) fits 141 B"), message
    assert "nor one with at most 2 computations per node in any order (moccasin)" in message
    assert "--solver moccasin --max-computations 3" in message
    error_of(graph, 142, "auto")
    plan = solve_graph(graph, 142, "moccasin", max_computations=3)  # the hint given is a real way out
    assert plan.predicted.peak_bytes <= 142


def test_cli_solves_by_the_fallback_and_states_the_class(tmp_path, capsys):
    path = tmp_path / "graph.json"
    save_graph(reorder_graph(), path)
    assert cli.main(["solve", str(path), "--budget", "70", "-o", str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr().out
    assert "moccasin (chosen by auto)" in out and "recomputed 0 computations" in out, out
    assert cli.main(["solve", str(path), "--budget", "70", "--solver", "checkmate"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("memsched: error: checkmate: no frontier-advancing schedule"), err
    assert "--solver moccasin" in err[0]
