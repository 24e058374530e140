"""Under torchrun (planner/execute/torchrun.py): ``memsched train --dp N`` and a pipeline run are the ranks torchrun
started, each running its own part in its own process (before: they spawned ranks of their own, which waited for
torchrun's store until the progress timeout), rank 0 printing what a spawned run prints; a launch of another
count of ranks, and whatever else cannot run so, is refused in one line on every rank before any collective.

Two runs start torchrun (``--standalone``, 2 gloo ranks: 10-15 s each here); the refusals run in this process with
torchrun's environment set, their collectives replaced by a failure (none may be reached).
"""

import os
import signal
import subprocess
import sys

import pytest
import torch
from test_execute_pipeline import MICRO, SPEC, M, chain, plan_for, pytestmark, single_process  # noqa: F401 (fixture, mark)

import cli
from checks import one_error_line, raises_one_line
from paths import ROOT
from planner import save_plan
from planner.execute.pipeline import launch_ranks
from planner.execute.torchrun import torchrun_rank

GPT = "gpt-tiny:layers=3,d=32,heads=2,seq=16,vocab=64,batch=4"
RUN_LIMIT = 150  # seconds a torchrun launch may take: the run it replaces hung for its progress timeout (300 s)
TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE")


def torchrun(*argv) -> tuple:
    """``memsched ARGV`` (this checkout's cli.py) as the 2 ranks ``torchrun --standalone --nproc_per_node 2``
    starts: ``(status, stdout, stderr)``; a launch still running after :data:`RUN_LIMIT` seconds is killed (torchrun
    and its ranks, one process group) and fails the test."""
    env = {name: value for name, value in os.environ.items() if name not in TORCHRUN_VARIABLES}
    child = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                              "--no-python", sys.executable, "-c", "import sys, cli; sys.exit(cli.main())", *argv],
                             cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        out, err = child.communicate(timeout=RUN_LIMIT)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        out, err = child.communicate()
        pytest.fail(f"torchrun did not end within {RUN_LIMIT} s: {err[-3000:]}")
    return child.returncode, out, err


def rank_rows(out: str) -> list:
    """The per-rank rows of a run's table, split into fields."""
    return [line.split() for line in out.splitlines() if line.split()[:1] in (["0"], ["1"])]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_train_dp_runs_as_the_ranks_torchrun_started():
    status, out, err = torchrun("train", GPT, "--dp", "2", "--zero", "3", "--budget", "80%", "--steps", "2")
    assert status == 0, err[-3000:]
    assert out.count("data parallel: 2 ranks, ZeRO 3 on FSDP2's fully_shard") == 1, out  # rank 0 alone prints
    rows = rank_rows(out)
    assert [row[0] for row in rows] == ["0", "1"], out
    for row in rows:
        measured, predicted = (int(value.replace(",", "")) for value in row[1:3])
        assert abs(measured / predicted - 1) < 0.02, row
    assert rows[0][-1] == rows[1][-1]  # the whole batch's loss, on both
    assert err.count("profiling gpt-tiny") == 1 and "memsched: error" not in err, err  # rank 0 profiled and solved


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_pipeline_runs_as_the_ranks_torchrun_started(chain, tmp_path):
    plan = plan_for(chain, "1f1b", tight=True)  # a device that recomputes
    save_plan(plan, tmp_path / "plan.json")
    status, out, err = torchrun("train", SPEC, "--plan", str(tmp_path / "plan.json"), "--batch", str(M * MICRO),
                                "--steps", "1")
    assert status == 0, err[-3000:]
    assert out.count("pipeline: 2 devices, 1f1b, 4 micro-batches, 1 steps on cpu") == 1, out
    rows = rank_rows(out)
    assert [row[0] for row in rows] == ["0", "1"] and "recompute" in {row[2] for row in rows}, out
    assert float(rows[1][-1]) == pytest.approx(single_process(SPEC, M * MICRO)[0], abs=2e-6)  # the last rank's loss


@pytest.fixture
def as_rank(monkeypatch):
    """This process as rank 0 of ``world`` ranks torchrun started (its environment), no collective reachable."""
    def set_world(world):
        for name, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                                MASTER_PORT="1", TORCHELASTIC_USE_AGENT_STORE="True").items():
            monkeypatch.setenv(name, value)

    def joined(*args, **kwargs):
        raise AssertionError("a refusal must come before the process group is joined")

    monkeypatch.setattr(torch.distributed, "init_process_group", joined)
    return set_world


def test_a_launch_of_other_than_the_runs_ranks_is_refused_at_start_up(as_rank, chain, tmp_path, capsys):
    as_rank(3)
    one_error_line(cli.main(["train", GPT, "--dp", "2", "--budget", "50%"]), *capsys.readouterr(),
                   "torchrun started 3 ranks (WORLD_SIZE=3) but --dp 2 runs on 2: give --dp 3, or have torchrun "
                   "start 2 (--nnodes times --nproc_per_node)")
    save_plan(plan_for(chain, "1f1b", tight=False), tmp_path / "plan.json")
    one_error_line(cli.main(["train", SPEC, "--plan", str(tmp_path / "plan.json"), "--batch", str(M * MICRO)]),
                   *capsys.readouterr(), "but the pipeline plan (2 devices) runs on 2: partition the chain for "
                                         "--devices 3")
    one_error_line(cli.main(["train", GPT, "--budget", "50%"]), *capsys.readouterr(),
                   "but train without --dp or a pipeline plan runs on 1: give --dp 3 or a pipeline --plan")


def test_what_cannot_run_under_torchrun_is_refused(as_rank, monkeypatch, capsys):
    as_rank(2)
    assert raises_one_line(launch_ranks, print, 2, "cpu", 60).startswith(  # its ranks would wait for torchrun's store
        "this process is a rank torchrun started: the pipeline run cannot spawn ranks of its own")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", "1")
    joined = torchrun_rank(2, "--dp 2", "give --dp {world}", "cuda", 60, "data-parallel")
    assert "rank 0 has LOCAL_RANK=1 but this node has 1 CUDA devices: start at most 1 ranks per node" in (
        raises_one_line(joined.__enter__))
    monkeypatch.delenv("LOCAL_RANK")
    one_error_line(cli.main(["train", GPT, "--dp", "2", "--budget", "50%"]), *capsys.readouterr(),
                   "the environment sets RANK, WORLD_SIZE but not LOCAL_RANK: start memsched with torchrun")
    monkeypatch.setenv("LOCAL_RANK", "zero")
    one_error_line(cli.main(["train", GPT, "--dp", "2", "--budget", "50%"]), *capsys.readouterr(),
                   "LOCAL_RANK must be a whole number of at least 0, got 'zero'")
