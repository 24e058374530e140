"""The memsched command line, run in-process through cli.main (and once as the installed console script)."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import cli
import solvers
from checks import one_error_line
from paths import EXAMPLE, ROOT
from planner import load_chain, load_plan, save_chain, simulate
from planner.ops import Op
from planner.render import compact_schedule
from planner.units import parse_budget
from profiles.synthetic import random_chain
from solvers.budgets import CURVES

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A small chain, a different chain, and a rotor plan for the first (paths as strings)."""
    folder = tmp_path_factory.mktemp("cli")
    chain = random_chain(8, seed=1, tmp=True, params=True)
    save_chain(chain, folder / "chain.json")
    save_chain(random_chain(8, seed=2, tmp=True, params=True), folder / "other.json")
    assert cli.main(["solve", str(folder / "chain.json"), "--budget", "60%", "--solver", "rotor",
                     "-o", str(folder / "plan.json")]) == 0
    return {name: str(folder / f"{name}.json") for name in ("chain", "other", "plan")}


def _peak(path) -> int:
    return solvers.store_all_peak(load_chain(path))


@pytest.mark.parametrize("form", ["bytes", "MiB", "MB", "GiB", "percent"])
def test_solve_budget_forms_write_a_plan_the_simulator_reproduces(files, tmp_path, capsys, form):
    peak = _peak(files["chain"])
    text = {"bytes": str(int(0.7 * peak)), "MiB": f"{int(0.8 * peak / 2**20)}MiB", "MB": f"{int(0.55 * peak / 1e6)}MB",
            "GiB": "1GiB", "percent": "50%"}[form]
    budget = parse_budget(text, peak)
    out = tmp_path / "plan.json"
    assert cli.main(["solve", files["chain"], "--budget", text, "-o", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert f"plan written to {out}" in stdout
    assert f"{budget} bytes" in stdout
    plan = load_plan(out)
    assert plan.budget_bytes == budget
    assert plan.predicted.peak_bytes <= budget
    result = simulate(load_chain(files["chain"]), plan)
    assert (result.peak_bytes, result.time) == (plan.predicted.peak_bytes, plan.predicted.time)


def test_solve_summary_names_solver_peak_time_overhead_and_recomputations(files, capsys):
    assert cli.main(["solve", files["chain"], "--budget", "50%"]) == 0
    stdout = capsys.readouterr().out
    for label in ("solver     rotor (chosen by auto), slots=500", "of the budget", "step time", "overhead",
                  "recomputed", "solved in", "optimal: yes"):
        assert label in stdout
    assert "plan written" not in stdout


@pytest.mark.parametrize("options, shown", [
    (["--solver", "rotor", "--slots", "200"], "rotor, slots=200"),
    (["--solver", "sqrt", "--segments", "3"], "sqrt, segments=3"),
    (["--solver", "revolve", "--snapshots", "8"], "revolve, snapshots=8"),
    (["--solver", "recompute_all"], "recompute_all"),
    (["--solver", "store_all", "--budget", "100%"], "store_all"),
])
def test_solve_each_solver_with_its_parameter(files, capsys, options, shown):
    budget = [] if "--budget" in options else ["--budget", "90%"]
    assert cli.main(["solve", files["chain"], *budget, *options]) == 0
    assert f"solver     {shown}" in capsys.readouterr().out


def test_compact_schedule_groups_runs_of_stages():
    schedule = ([Op("F_ck", 0)] + [Op("F_none", k) for k in range(1, 5)] + [Op("F_all", k) for k in range(5, 20)]
                + [Op("Loss")] + [Op("B", k) for k in range(19, 4, -1)] + [Op("F_all", k) for k in range(5)]
                + [Op("B", k) for k in range(4, -1, -1)])
    assert compact_schedule(schedule) == "F_ck 0, F_none 1-4, F_all 5-19, Loss, B 19-5, F_all 0-4, B 4-0"
    assert compact_schedule([Op("F_all", 0), Op("F_all", 1), Op("F_all", 0), Op("B", 2), Op("B", 4)]) == \
        "F_all 0-1, F_all 0, B 2, B 4"
    assert compact_schedule(schedule, width=30).splitlines() == [
        "F_ck 0, F_none 1-4,", "F_all 5-19, Loss, B 19-5,", "F_all 0-4, B 4-0"]


def test_show_prints_header_and_compact_schedule(files, capsys):
    assert cli.main(["show", files["plan"]]) == 0
    stdout = capsys.readouterr().out
    plan = load_plan(files["plan"])
    assert f"plan for   {plan.problem_name}" in stdout
    assert "solver     rotor" in stdout
    assert f"{plan.budget_bytes} bytes" in stdout
    assert " ".join(stdout.split()).count(compact_schedule(plan.schedule)) == 1  # the wrapped lines rejoined
    assert "memory over" not in stdout


def test_show_with_chain_prints_the_ascii_timeline(files, capsys):
    assert cli.main(["show", files["plan"], "--chain", files["chain"]]) == 0
    stdout = capsys.readouterr().out
    plan = load_plan(files["plan"])
    assert f"simulated  peak {plan.predicted.peak_bytes} bytes" in stdout
    assert "note" not in stdout
    assert f"memory over {len(plan.schedule)} operations" in stdout
    assert "v peak" in stdout
    rows = [line for line in stdout.splitlines() if re.match(r"^\s*[0-9.]+ [KMG]?i?B \|", line)]
    assert len(rows) == 10
    assert sum(row.endswith(" budget") for row in rows) == 1
    assert max(len(row.split("|", 1)[1].removesuffix(" budget")) for row in rows) == 60


def test_show_plot_writes_a_png(files, tmp_path, capsys):
    out = tmp_path / "timeline.png"
    assert cli.main(["show", files["plan"], "--chain", files["chain"], "--plot", str(out)]) == 0
    assert f"timeline plot written to {out}" in capsys.readouterr().out
    assert out.read_bytes().startswith(PNG_SIGNATURE) and out.stat().st_size > 1000


def _pareto_rows(stdout: str) -> list:
    """``(budget bytes, {solver: overhead % or None})`` per table row."""
    rows = []
    for line in stdout.splitlines():
        match = re.match(r"^\s*[0-9.]+ [KMG]?i?B\s+(\d+)\s+[0-9.]+%\s+(\S+)\s+(\S+)\s+(\S+)$", line)
        if match:
            values = [None if cell == "—" else float(cell.rstrip("%")) for cell in match.groups()[1:]]
            rows.append((int(match.group(1)), dict(zip(CURVES, values))))
    return rows


def test_pareto_table_spans_minimum_to_store_all_peak(files, capsys):
    assert cli.main(["pareto", files["chain"], "--points", "6"]) == 0
    rows = _pareto_rows(capsys.readouterr().out)
    peak = _peak(files["chain"])
    assert len(rows) == 6
    assert rows[0][0] == solvers.minimum.minimum_budget(load_chain(files["chain"]))
    assert rows[-1][0] == peak
    assert [row["store_all"] for _, row in rows] == [None] * 5 + [0.0]
    assert rows[-1][1]["sqrt"] == 0.0
    below_peak = [row for budget, row in rows if budget < peak and None not in (row["rotor"], row["sqrt"])]
    assert below_peak and all(row["rotor"] <= row["sqrt"] for row in below_peak)


def test_pareto_rotor_is_never_above_sqrt_and_free_at_store_all_peak(files, capsys):
    assert cli.main(["pareto", files["chain"], "--points", "6"]) == 0
    rows = _pareto_rows(capsys.readouterr().out)
    assert rows[-1][1]["rotor"] == 0.0
    assert all(row["rotor"] <= row["sqrt"] for _, row in rows if None not in (row["rotor"], row["sqrt"]))


def test_pareto_plot_writes_a_png(files, tmp_path, capsys):
    out = tmp_path / "pareto.png"
    assert cli.main(["pareto", files["chain"], "--points", "3", "--slots", "100", "--plot", str(out)]) == 0
    assert f"pareto plot written to {out}" in capsys.readouterr().out
    assert out.read_bytes().startswith(PNG_SIGNATURE) and out.stat().st_size > 1000


def _write(folder: Path, name: str, text: str) -> str:
    path = folder / name
    path.write_text(text)
    return str(path)


def _bad_field(folder: Path) -> str:
    data = load_chain(EXAMPLE).to_dict()
    data["stages"][3]["fwd_time"] = -1.0
    return _write(folder, "bad_field.json", json.dumps(data))


ERROR_CASES = {
    "missing chain": lambda f, t: ["solve", str(t / "missing.json"), "--budget", "50%"],
    "bad JSON": lambda f, t: ["solve", _write(t, "broken.json", '{"format": '), "--budget", "50%"],
    "bad field": lambda f, t: ["solve", _bad_field(t), "--budget", "50%"],
    "not a chain": lambda f, t: ["solve", f["plan"], "--budget", "50%"],
    "unknown solver": lambda f, t: ["solve", f["chain"], "--budget", "50%", "--solver", "chen"],
    "infeasible budget": lambda f, t: ["solve", f["chain"], "--budget", "1000"],
    "infeasible for solver": lambda f, t: ["solve", f["chain"], "--budget", "90%", "--solver", "store_all"],
    "bad unit": lambda f, t: ["solve", f["chain"], "--budget", "4XB"],
    "bad budget": lambda f, t: ["solve", f["chain"], "--budget", "lots"],
    "parameter not taken": lambda f, t: ["solve", f["chain"], "--budget", "50%", "--solver", "sqrt", "--slots", "9"],
    "output folder missing": lambda f, t: ["solve", f["chain"], "--budget", "50%", "-o", str(t / "no" / "plan.json")],
    "missing plan": lambda f, t: ["show", str(t / "missing.json")],
    "not a plan": lambda f, t: ["show", f["chain"]],
    "plan/chain mismatch": lambda f, t: ["show", f["plan"], "--chain", f["other"]],
    "plot without chain": lambda f, t: ["show", f["plan"], "--plot", str(t / "timeline.png")],
    "plot folder missing": lambda f, t: ["show", f["plan"], "--chain", f["chain"], "--plot", str(t / "no" / "t.png")],
    "pareto bad JSON": lambda f, t: ["pareto", _write(t, "broken.json", "[1, 2")],
}


@pytest.mark.parametrize("case", ERROR_CASES)
def test_expected_errors_print_one_line_and_exit_2(files, tmp_path, capsys, case):
    status = cli.main(ERROR_CASES[case](files, tmp_path))
    out, err = capsys.readouterr()
    one_error_line(status, out, err)
    assert out == ""


@pytest.mark.parametrize("argv", [
    [],
    ["optimise"],
    ["solve", "chain.json"],
    ["solve", "chain.json", "--budget", "50%", "--slots", "many"],
    ["solve", "chain.json", "--budget", "50%", "--segments", "0"],
    ["pareto", "chain.json", "--points", "1"],
    ["show"],
])
def test_usage_errors_exit_2(argv, capsys):
    one_error_line(cli.main(argv), *capsys.readouterr(), "--help)")


def test_installed_console_script(tmp_path):
    search = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    script = shutil.which("memsched", path=search)
    if script is None:
        pytest.skip("the memsched console script is not installed (pip install -e .)")
    done = subprocess.run([script, "solve", "examples/example-L24.chain.json", "--budget", "60%"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "solver     rotor (chosen by auto)" in done.stdout
    assert done.stderr == ""


def test_show_flags_an_edited_plan_and_draws_the_budget(files, tmp_path, capsys):
    """An edit taken as its author's (its check dropped) is shown, what it records against this simulation; with
    its check kept, or with a budget below its own predicted peak, it is refused in one line (issue 38)."""
    data = json.loads(Path(files["plan"]).read_text())
    data["predicted"]["time"] += 1.0
    one_error_line(cli.main(["show", _write(tmp_path, "edited.json", json.dumps(data)), "--chain", files["chain"]]),
                   *capsys.readouterr(), "not those its check was written for", "drop 'check'")
    del data["check"]
    data["budget_bytes"] = data["predicted"]["peak_bytes"] * 2
    assert cli.main(["show", _write(tmp_path, "edited.json", json.dumps(data)), "--chain", files["chain"]]) == 0
    stdout = capsys.readouterr().out
    assert "prediction differs from this simulation" in stdout
    rows = [line for line in stdout.splitlines() if re.match(r"^\s*[0-9.]+ [KMG]?i?B \|", line)]
    assert rows[0].endswith(" budget") and sum(row.endswith(" budget") for row in rows) == 1
    data["budget_bytes"] = data["predicted"]["peak_bytes"] // 2
    one_error_line(cli.main(["show", _write(tmp_path, "edited.json", json.dumps(data))]), *capsys.readouterr(),
                   "is above budget_bytes")
