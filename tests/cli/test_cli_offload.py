"""The command line for offload plans: the copy channel, pofo and offload solves, show, pareto and train."""

import dataclasses
import json

import pytest

from checks import one_error_line, run
from planner import load_chain, load_plan, save_chain, simulate
from planner.transfer import Transfer
from profiles.synthetic import random_chain

SMALL = "gpt-tiny:layers=3,d=32,heads=2,seq=16,vocab=64,batch=4"



@pytest.fixture(scope="module")
def chain_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("offload") / "chain.json"
    save_chain(random_chain(10, 4, tmp=True, params=True), path)
    return path


def test_pofo_solve_records_the_channel_and_show_replays_it(capsys, chain_path, tmp_path):
    plan_path = tmp_path / "plan.json"
    status, out, err = run(capsys, "solve", chain_path, "--budget", "40%", "--solver", "pofo",
                           "--bandwidth", "4GB/s", "--h2d-bandwidth", "3GB/s", "--latency", "1e-5", "-o", plan_path)
    assert status == 0, err
    assert "channel    3.7 GiB/s to host, 2.8 GiB/s back" in out and "stalls" in out
    plan = load_plan(plan_path)
    assert plan.transfer == Transfer(4e9, 3e9, 1e-5) and plan.moves_data
    assert json.loads(plan_path.read_text())["transfer"]["h2d_bandwidth"] == 3e9
    result = simulate(load_chain(chain_path), plan)
    assert (result.peak_bytes, result.time) == (plan.predicted.peak_bytes, plan.predicted.time)
    status, out, _ = run(capsys, "show", plan_path, "--chain", chain_path, "--plot", tmp_path / "t.png")
    assert status == 0
    assert "Offload" in out and "copies" in out and "T transfer" in out
    assert (tmp_path / "t.png").read_bytes().startswith(b"\x89PNG")


def test_offload_solvers_from_the_command_line(capsys, chain_path):
    status, out, err = run(capsys, "solve", chain_path, "--budget", "60%", "--solver", "offload",
                           "--bandwidth", "8GB/s", "--time-limit", "5")
    assert status == 0, err
    assert "offload" in out and "stalls" in out
    status, out, err = run(capsys, "solve", chain_path, "--budget", "40%", "--solver", "offload",
                           "--schedule", "rotor", "--bandwidth", "8GB/s", "--time-limit", "5")
    assert status == 0, err
    assert "schedule=rotor" in out or "rotor" in out


def test_the_chains_own_channel_is_used(capsys, chain_path, tmp_path):
    measured = tmp_path / "measured.json"
    save_chain(dataclasses.replace(load_chain(chain_path), transfer=Transfer(5e9, 5e9, 0.0)), measured)
    status, out, err = run(capsys, "solve", measured, "--budget", "40%", "--solver", "pofo")
    assert status == 0, err
    assert "4.7 GiB/s to host" in out


@pytest.mark.parametrize("argv, message", [
    (["--solver", "pofo"], "needs the copy channel: give --bandwidth"),
    (["--solver", "rotor", "--bandwidth", "8GB/s"], "--bandwidth is for pofo and the offload solvers"),
    (["--solver", "rotor", "--schedule", "rotor"], "--schedule is for pofo and the offload solvers"),
    (["--solver", "pofo", "--bandwidth", "fast"], "--bandwidth: cannot read 'fast'"),
    (["--solver", "pofo", "--h2d-bandwidth", "8GB/s"], "give its --bandwidth too"),
    (["--solver", "pofo", "--bandwidth", "8GB/s", "--latency", "-1"], "--latency must be"),
    (["--solver", "pofo", "--bandwidth", "8GB/s", "--schedule", "rotor"], "takes no parameter 'schedule'"),
    (["--solver", "offload", "--bandwidth", "8GB/s", "--time-limit", "0"], "--time-limit must be a positive"),
    (["--solver", "pofo", "--bandwidth", "1TB/s", "--budget", "1%", "--time-limit", "1"], "pofo: no schedule"),
])
def test_bad_channel_arguments_are_one_line(capsys, chain_path, argv, message):
    budget = [] if "--budget" in argv else ["--budget", "40%"]
    line = one_error_line(*run(capsys, "solve", chain_path, *budget, *argv))
    assert message in line


def test_pareto_adds_pofo_with_a_channel(capsys, chain_path):
    status, out, _ = run(capsys, "pareto", chain_path, "--points", "3", "--bandwidth", "16GB/s")
    assert status == 0
    header = next(line for line in out.splitlines() if "% peak" in line)
    assert header.split()[-2:] == ["pofo", "offload_greedy"] and "channel" in out
    status, out, _ = run(capsys, "pareto", chain_path, "--points", "3")
    assert "pofo" not in out


def test_profile_records_a_given_channel_and_refuses_it_for_graphs(capsys, tmp_path):
    path = tmp_path / "c.json"
    status, _, err = run(capsys, "profile", "mlp:layers=3,width=16,batch=4", "-o", path, "--warmup", "0",
                         "--repeats", "1", "--bandwidth", "12GB/s")
    assert status == 0, err
    assert load_chain(path).transfer == Transfer(12e9, 12e9, 0.0)
    line = one_error_line(*run(capsys, "profile", SMALL, "--graph", "-o", tmp_path / "g.json", "--bandwidth", "1GB/s"))
    assert "graph profile has no copy channel" in line


def test_train_by_an_offload_plan(capsys):
    status, out, err = run(capsys, "train", SMALL, "--budget", "80%", "--solver", "offload", "--bandwidth", "50GB/s",
                           "--steps", "2")
    assert status == 0, err
    assert "channel" in out
    ratios = [float(row.split()[-4]) for row in out.splitlines() if row.strip()[:1].isdigit() and "iB" in row
              and len(row.split()) >= 8]
    assert len(ratios) == 2 and all(abs(ratio - 1) <= 0.05 for ratio in ratios)
