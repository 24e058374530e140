"""The pipeline ranks' lifecycle (planner/execute/pipeline.py): they die with their parent (even a ``kill -9`` of it),
a run is stopped when it makes no progress (``--progress-timeout``: no step finished for that long), not after
a fixed time, and the rank that failed first is named, not the one that lost its connection to it.

Each run spawns 2 gloo processes (5-15 s here); the models and plans are tests/execute/test_execute_pipeline.py's.
"""

import functools
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from test_execute_pipeline import MICRO, SPEC, M, chain, mlp_ending_with, plan_for, pytestmark  # noqa: F401 (fixture, mark)

import cli
from checks import one_error_line
from paths import ROOT, TESTS
from planner import MemschedError, save_plan
from planner.execute.pipeline import _first_failure, _Rank, run_pipeline
from profiles.memory import memory_meter

HERE = Path(__file__).resolve()


def _on_rank1_training() -> bool:
    """Rank 1 in a training forward (not the ranks' no-grad pass over example shapes, nor the parent)."""
    return torch.is_grad_enabled() and torch.distributed.is_initialized() and torch.distributed.get_rank() == 1


class _SlowOnRank1(torch.nn.Module):
    """Sleeps ``seconds`` in each training forward on rank 1, touching ``mark`` first when given."""

    def __init__(self, seconds, mark=None):
        super().__init__()
        self.seconds, self.mark = seconds, mark

    def forward(self, x):
        if _on_rank1_training():
            if self.mark:
                Path(self.mark).touch()
            time.sleep(self.seconds)
        return x * 1.0


class _ExitsOnRank1(torch.nn.Module):
    def forward(self, x):
        if _on_rank1_training():
            os._exit(3)  # no exception, no report: rank 0 only sees its connection close
        return x * 1.0


def slow_model(seconds, mark=None):
    """The test mlp whose last stage sleeps ``seconds`` per micro-batch on rank 1."""
    return mlp_ending_with(_SlowOnRank1(seconds, mark))


def hanging(batch):
    """SPEC ``tests/execute/test_pipeline_lifecycle.py:hanging``: rank 1 hangs in its first training forward."""
    assert batch == M * MICRO
    return slow_model(600)


def exiting(batch):
    """SPEC ``tests/execute/test_pipeline_lifecycle.py:exiting``: rank 1 exits (status 3) in its first training
    forward."""
    assert batch == M * MICRO
    return mlp_ending_with(_ExitsOnRank1())


def train_cli(spec, plan_path, *extra):
    return cli.main(["train", spec, "--plan", str(plan_path), "--batch", str(M * MICRO), *extra])


@pytest.fixture
def plan_path(chain, tmp_path):
    path = tmp_path / "plan.json"
    save_plan(plan_for(chain, "1f1b", tight=False), path)
    return path


def _state(pid):
    """The process state letter of ``pid`` (None when there is no such process)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def _alive(pid) -> bool:
    return _state(pid) not in (None, "Z")  # a zombie has died (an init that does not reap leaves them)


def _ranks_of(pid) -> list:
    """The live spawned children of ``pid`` (a /proc scan)."""
    ranks = []
    for entry in Path("/proc").iterdir():
        try:
            if (entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid
                    and b"--multiprocessing-fork" in (entry / "cmdline").read_bytes() and _alive(entry.name)):
                ranks.append(int(entry.name))
        except OSError:
            continue
    return ranks


@pytest.mark.multiprocess
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the ranks in /proc")
def test_ranks_die_with_their_parent_killed_by_sigkill(plan_path, tmp_path):
    mark = tmp_path / "training"
    script = (f"import functools, sys\nsys.path[:0] = {[str(HERE.parent), str(TESTS)]!r}\n"
              "import test_pipeline_lifecycle as t\n"
              "from planner import load_plan\nfrom planner.execute.pipeline import run_pipeline\n"
              "from profiles.memory import memory_meter\n"
              f"run_pipeline(functools.partial(t.slow_model, 0.05, {str(mark)!r}), load_plan({str(plan_path)!r}), "
              "100000, meter=memory_meter)\n")
    # (TMPDIR: the killed parent leaves its folder of results behind.)
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT,
                              env={**os.environ, "TMPDIR": str(tmp_path)})
    ranks = []
    try:
        deadline = time.monotonic() + 120
        while not mark.exists():  # rank 1 trains (so rank 0 does too)
            assert parent.poll() is None and time.monotonic() < deadline, "the run did not start training"
            time.sleep(0.1)
        ranks = _ranks_of(parent.pid)
        assert len(ranks) == 2
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 5
        while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [pid for pid in ranks if _alive(pid)] == []
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        for pid in ranks:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_rank_whose_parent_died_while_it_started_exits():
    """The parent may die before the rank arms its death signal (while it imports): it is then not its parent."""
    done = subprocess.run([sys.executable, "-c", "from planner.execute.pipeline_rank import die_with_parent\n"
                           "die_with_parent(1)  # not this process's parent (pytest is)\nprint('survived')"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "survived" not in done.stdout, done.stderr


@pytest.mark.multiprocess
def test_a_run_longer_than_the_progress_timeout_goes_on_while_steps_finish(chain):
    plan = plan_for(chain, "1f1b", tight=False)
    results = run_pipeline(functools.partial(slow_model, 0.5), plan, 3, meter=memory_meter, progress_timeout=5)
    seconds = results[1].seconds  # 4 micro-batches of 0.5 s each on rank 1
    assert len(results[1].losses) == 3 and max(seconds) < 5 < sum(seconds)


@pytest.mark.multiprocess
def test_a_rank_that_hangs_is_named_after_the_progress_timeout(plan_path, capsys):
    started = time.monotonic()
    code = train_cli(f"{HERE}:hanging", plan_path, "--progress-timeout", "4")
    out, err = capsys.readouterr()
    one_error_line(code, out, err)
    assert err.startswith("memsched: error: pipeline run timed out after 4 s (ranks [0, 1] still running)"), err
    found = re.search(r"rank 1 made no progress for ([\d.]+) s \(step 1: its stage's forward of micro-batch 0\)", err)
    assert found and 2 < float(found.group(1)) <= 5, err
    assert time.monotonic() - started < 120  # not the 600 s it sleeps
    assert multiprocessing.active_children() == []


@pytest.mark.multiprocess
def test_the_rank_that_dies_is_named_not_the_rank_that_lost_it(plan_path, capsys):
    code = train_cli(f"{HERE}:exiting", plan_path, "--progress-timeout", "60")
    out, err = capsys.readouterr()
    one_error_line(code, out, err)
    assert err.startswith("memsched: error: pipeline rank 1 died (exit status 3) without reporting an error"), err


def _rank(rank, code, error=None, died=None):
    r = _Rank(rank, types.SimpleNamespace(exitcode=code), None)
    r.error, r.died = error, died
    return r


def test_the_cause_is_the_first_failure_that_is_not_a_lost_peer():
    lost = "RuntimeError: Connection closed by peer [127.0.0.1]:1234"
    # Rank 0 reported its lost connection before the parent saw rank 1 die: rank 1 is the cause.
    assert _first_failure([_rank(0, 1, (10.0, lost, True)), _rank(1, -9, died=10.1)]).startswith(
        "pipeline rank 1 died (killed by signal 9) without reporting an error; then rank 0 failed too")
    # Rank 0's own error came first; rank 1 died of it (an aborting backend): rank 0 is the cause.
    assert _first_failure([_rank(0, 1, (10.0, "RuntimeError: bad", False)), _rank(1, -6, died=10.1)]).startswith(
        "pipeline rank 0 failed: RuntimeError: bad")
    # Only lost connections (e.g. the network failed): the earliest.
    assert _first_failure([_rank(0, 1, (10.2, lost, True)), _rank(1, 1, (10.1, lost, True))]).startswith(
        "pipeline rank 1 failed: RuntimeError: Connection closed")


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "1e30"])
def test_cli_refuses_a_progress_timeout_that_is_not_positive(plan_path, capsys, value):
    line = one_error_line(train_cli(SPEC, plan_path, "--progress-timeout", value), *capsys.readouterr())
    assert line.startswith("memsched: error: --progress-timeout must be a positive number of seconds, at most a "
                           "year"), line


def test_cli_refuses_a_progress_timeout_without_a_pipeline_plan(capsys):
    line = one_error_line(cli.main(["train", SPEC, "--budget", "50%", "--progress-timeout", "10"]),
                          *capsys.readouterr())
    assert line.startswith("memsched: error: --progress-timeout bounds a pipeline run"), line


@pytest.mark.parametrize("value", [0, 1e30])
def test_run_pipeline_refuses_a_progress_timeout_that_is_not_positive(chain, value):
    with pytest.raises(MemschedError, match="--progress-timeout must be a positive number of seconds, at most a year"):
        run_pipeline(functools.partial(slow_model, 0), plan_for(chain, "1f1b", tight=False), 1, meter=memory_meter,
                     progress_timeout=value)
