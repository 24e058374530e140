"""memsched solve/show on graph problems (memsched.graph/1), run in-process through cli.main."""

import json

import pytest

import cli
from checks import one_error_line
from planner import save_chain
from planner.graph import load_graph, save_graph
from planner.plan import load_plan
from planner.simulate import simulate
from profiles.synthetic import random_chain, random_graph
from solvers import graph_minimum, store_all_graph_peak


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli_graph")
    save_graph(random_graph(5, 14, shape="transformer", scale_bytes=10**6), folder / "graph.json")
    save_graph(random_graph(6, 14, shape="transformer", scale_bytes=10**6), folder / "other.json")
    save_chain(random_chain(6, seed=1), folder / "chain.json")
    graph = load_graph(folder / "graph.json")
    minimum, exact = graph_minimum(graph)
    assert exact
    middle = str((minimum + store_all_graph_peak(graph)) // 2)  # bytes: room for recomputation
    return {name: str(folder / f"{name}.json") for name in ("graph", "other", "chain")} | {
        "folder": folder, "budget": middle, "minimum": minimum}


@pytest.mark.parametrize("solver", ["checkmate", "moccasin", "checkmate-lp"])
def test_solve_and_show_a_graph(files, capsys, solver):
    out = files["folder"] / f"{solver}.plan.json"
    assert cli.main(["solve", files["graph"], "--budget", files["budget"], "--solver", solver, "--time-limit", "30",
                     "-o", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert stdout.startswith("graph      synthetic_transformer_n14\n") and f"plan written to {out}" in stdout
    assert "optimal: " in stdout and "recomputed" in stdout
    plan = load_plan(out)
    graph = load_graph(files["graph"])
    assert plan.kind == "graph" and plan.solver == solver
    assert plan.budget_bytes == int(files["budget"])
    result = simulate(graph, plan)
    assert (result.peak_bytes, result.time) == (plan.predicted.peak_bytes, plan.predicted.time) and \
        result.peak_bytes <= plan.budget_bytes
    assert cli.main(["show", str(out), "--graph", files["graph"]]) == 0
    shown = capsys.readouterr().out
    assert "compute 0" in shown and "simulated  peak" in shown and "memory over" in shown and "v peak" in shown
    assert cli.main(["show", str(out)]) == 0
    assert "schedule" in capsys.readouterr().out
    png = files["folder"] / f"{solver}.png"
    assert cli.main(["show", str(out), "--graph", files["graph"], "--plot", str(png)]) == 0
    assert f"timeline plot written to {png}" in capsys.readouterr().out
    assert png.read_bytes().startswith(b"\x89PNG")
    assert cli.main(["show", str(out), "--plot", str(png)]) == 2  # the timeline needs the graph
    assert "--graph" in capsys.readouterr().err


def test_solve_options_reach_the_solvers(files, capsys):
    out = files["folder"] / "m.plan.json"
    assert cli.main(["solve", files["graph"], "--budget", files["budget"], "--solver", "moccasin",
                     "--max-computations", "3", "--time-limit", "20", "-o", str(out)]) == 0
    assert load_plan(out).params == {"max_computations": 3, "time_limit": 20.0}
    assert cli.main(["solve", files["graph"], "--budget", files["budget"], "--solver", "moccasin", "--first-order",
                     "index", "--time-limit", "20", "-o", str(out)]) == 0
    plan = load_plan(out)
    assert plan.params == {"max_computations": 2, "time_limit": 20.0, "first_order": "index"} and plan.optimal
    firsts = [op.node for i, op in enumerate(plan.schedule) if op.kind == "compute" and
              ("compute", op.node) not in plan.schedule[:i]]
    assert firsts == sorted(firsts)
    assert cli.main(["solve", files["graph"], "--budget", files["budget"], "--solver", "checkmate", "--backend", "cbc",
                     "--time-limit", "20", "-o", str(out)]) == 0
    assert load_plan(out).params == {"backend": "cbc", "time_limit": 20.0}
    assert cli.main(["solve", files["graph"], "--budget", files["budget"], "--solver", "checkmate", "--gap", "0.01",
                     "--time-limit", "20", "-o", str(out)]) == 0
    plan = load_plan(out)
    assert plan.params["gap"] == 0.01 and (plan.optimal or plan.gap <= 0.01)
    capsys.readouterr()
    status = cli.main(["solve", files["chain"], "--budget", "60%", "--gap", "0.01"])
    one_error_line(status, *capsys.readouterr(), "--gap", "graph problems")
    status = cli.main(["solve", files["chain"], "--budget", "60%", "--first-order", "index"])
    one_error_line(status, *capsys.readouterr(), "--first-order", "graph problems")


def test_cyclic_graph_file(files, capsys, tmp_path):
    data = json.loads(open(files["graph"]).read())
    data["nodes"][3]["deps"] = [5]
    path = tmp_path / "cyclic.json"
    path.write_text(json.dumps(data))
    status = cli.main(["solve", str(path), "--budget", "50%"])
    one_error_line(status, *capsys.readouterr(), str(path), "nodes[3].deps[0] = 5", "cycle")


@pytest.mark.parametrize("argv, fragments", [
    (["--solver", "rotor"], ["unknown graph solver 'rotor'", "checkmate", "moccasin"]),
    (["--slots", "10"], ["--slots", "chain solvers"]),
    (["--solver", "checkmate", "--time-limit", "0"], ["--time-limit must be a positive"]),
    (["--solver", "moccasin", "--backend", "cbc"], ["solver 'moccasin' takes no parameter 'backend'"]),
    (["--solver", "moccasin", "--first-order", "stages"], ["first_order must be one of 'free', 'index'", "'stages'"]),
    (["--solver", "checkmate", "--first-order", "index"], ["solver 'checkmate' takes no parameter 'first_order'"]),
    (["--solver", "checkmate", "--gap", "1.5"], ["--gap must be a fraction between 0 and 1"]),
])
def test_bad_graph_solve_options(files, capsys, argv, fragments):
    status = cli.main(["solve", files["graph"], "--budget", "90%"] + argv)
    one_error_line(status, *capsys.readouterr(), *fragments)


def test_infeasible_budget_states_the_minimum(files, capsys):
    status = cli.main(["solve", files["graph"], "--budget", "1000", "--solver", "checkmate"])
    one_error_line(status, *capsys.readouterr(), "below", "least memory any schedule", "raise the budget")
    minimum = files["minimum"]
    status = cli.main(["solve", files["graph"], "--budget", str(minimum - 1), "--solver", "checkmate"])
    one_error_line(status, *capsys.readouterr(), "checkmate: no frontier-advancing schedule", f"({minimum} bytes)",
                   "--solver moccasin")


def test_timeout_without_a_schedule(files, capsys, tmp_path):
    path = tmp_path / "big.json"
    save_graph(random_graph(3, 120, shape="transformer"), path)
    status = cli.main(["solve", str(path), "--budget", "50%", "--solver", "moccasin", "--time-limit", "0.01"])
    one_error_line(status, *capsys.readouterr(), "time limit (0.01 s) ran out before any schedule was found",
                   "--time-limit")


def test_show_refuses_mismatches(files, capsys, tmp_path):
    out = tmp_path / "p.json"
    assert cli.main(["solve", files["graph"], "--budget", files["budget"], "-o", str(out)]) == 0
    capsys.readouterr()
    status = cli.main(["show", str(out), "--graph", files["other"]])
    one_error_line(status, *capsys.readouterr(), "was solved for graph", "solve again")
    status = cli.main(["show", str(out), "--chain", files["chain"]])
    one_error_line(status, *capsys.readouterr(), "graph plan", "--graph")
    chain_plan = tmp_path / "c.json"
    assert cli.main(["solve", files["chain"], "--budget", "90%", "-o", str(chain_plan)]) == 0
    capsys.readouterr()
    status = cli.main(["show", str(chain_plan), "--graph", files["graph"]])
    one_error_line(status, *capsys.readouterr(), "plan of kind 'chain'", "not for a graph")
    status = cli.main(["solve", files["chain"], "--budget", "90%", "--time-limit", "5"])
    one_error_line(status, *capsys.readouterr(), "--time-limit", "for pofo and the offload solvers")
