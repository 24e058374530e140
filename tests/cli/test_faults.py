"""Faults: Ctrl-C during `profile`, `train` and the write of `-o`, and a writer killed outright.

Ctrl-C (SIGINT) while torch code runs, or while the output is being written,
ends memsched with `memsched: interrupted` on a line of its own (after any
status line already printed), exit status 130, no traceback; the `-o` file is
the old complete one. The tests start memsched in a child process, wait for a
marker line printed by a wrapper around the phase (tests/solvers/test_time_limits.py
does the same for the solvers) and send SIGINT.

A writer killed with SIGKILL at random moments, over and over, while it
rewrites large chain and plan files with `planner.jsonio.write_atomic`, leaves
the file with the old or the new complete content every time; its temporary
file (at most one, named with its process id) stays until the next write of
the same file removes it.
"""

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import cli
from checks import sigint_as_a_terminal_sends_it
from paths import ROOT
from planner import save_chain
from planner.jsonio import write_atomic, write_json_atomic
from profiles.synthetic import random_chain

WRAPPER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {root!r})
    import cli

    def marked(owner, name, hold):  # a marker line when the phase starts, then (hold seconds later) the phase
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            print("MARK " + name, flush=True)
            time.sleep(hold)
            return original(*args, **kwargs)

        setattr(owner, name, wrapper)

    for owner, name, hold in {marks}:
        marked(__import__(owner, fromlist=["_"]), name, hold)
    sys.argv = ["memsched"] + sys.argv[1:]
    sys.exit(cli.main())  # as the console script
""")


def interrupted(args, marks, after):
    """Run ``memsched ARGS`` with markers on ``marks`` (``(module, attribute, seconds held)``), send SIGINT
    ``after`` seconds after the first marker; (exit status, stderr)."""
    script = WRAPPER.format(root=str(ROOT), marks=repr(list(marks)))
    child = subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, cwd=ROOT, preexec_fn=sigint_as_a_terminal_sends_it)
    try:
        deadline = time.monotonic() + 120
        line = ""
        while not line.startswith("MARK ") and time.monotonic() < deadline:
            line = child.stdout.readline()
            if not line:
                break
        assert line.startswith("MARK "), f"the phase never started: {child.stderr.read()[-2000:]}"
        time.sleep(after)
        assert child.poll() is None, "it ended before the signal"
        child.send_signal(signal.SIGINT)
        _, err = child.communicate(timeout=60)
        return child.returncode, err
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def assert_interrupted(returncode, err, status_lines=()):
    assert returncode == 130, (returncode, err[-2000:])
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip()]
    assert lines[-1] == "memsched: interrupted", err[-2000:]
    assert all(line.startswith(status_lines) for line in lines[:-1]), err[-2000:]  # no traceback, no warning


@pytest.fixture
def old_output(tmp_path):
    """A folder holding a complete chain file where the interrupted command writes: (path, its bytes)."""
    path = tmp_path / "out.json"
    save_chain(random_chain(4, seed=7), path)
    return path, path.read_bytes()


def assert_untouched(path, old):
    assert path.read_bytes() == old
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temporary file left


@pytest.mark.slow
def test_interrupt_while_profiling(old_output):
    path, old = old_output
    # 25 stages: a progress bar on stderr, which the message must not run on from
    returncode, err = interrupted(["profile", "mlp:layers=24,width=16,batch=4", "--warmup", "0", "--repeats", "300",
                                   "-o", str(path)], [("profiles.chain_profiler", "profile_chain", 0)],
                                  after=random.uniform(0.5, 1.5))
    assert_interrupted(returncode, err, status_lines=("[",))
    assert "\nmemsched: interrupted" in err.replace("\r", "\n")  # on a line of its own
    assert_untouched(path, old)


@pytest.mark.slow
def test_interrupt_while_training(tmp_path):
    model, chain = "mlp:layers=16,width=8,batch=64", tmp_path / "chain.json"
    assert cli.main(["profile", model, "-o", str(chain), "--warmup", "0", "--repeats", "1"]) == 0
    returncode, err = interrupted(["train", model, "--chain", str(chain), "--budget", "60%", "--steps", "1000"],
                                  [("profiles.training", "measure_steps", 0)], after=random.uniform(0.2, 1.0))
    assert_interrupted(returncode, err)
    assert err == "memsched: interrupted\n"


@pytest.mark.slow
def test_interrupt_while_writing_the_output(old_output):
    """The whole new chain is in the temporary file, held before its fsync and rename: Ctrl-C there."""
    path, old = old_output
    returncode, err = interrupted(["profile", "mlp:layers=2,width=16,batch=4", "--warmup", "0", "--repeats", "1",
                                   "-o", str(path)], [("os", "fsync", 30)], after=0.3)
    assert_interrupted(returncode, err)
    assert err == "memsched: interrupted\n"
    assert_untouched(path, old)


def test_ctrl_c_inside_the_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "plan.json"
    write_json_atomic(path, {"old": True})
    old = path.read_bytes()

    def write(handle):
        handle.write('{"new": ')
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_atomic(path, write)
    assert_untouched(path, old)


def test_the_file_then_the_folder_are_synced(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append((os.readlink(f"/proc/self/fd/{fd}"), (tmp_path / "a.json").exists()))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    write_json_atomic(tmp_path / "a.json", {"a": 1})
    (temporary, renamed_yet), (folder, renamed) = synced
    assert Path(temporary).name.startswith(f".a.json.{os.getpid()}-") and not renamed_yet
    assert Path(folder) == tmp_path.resolve() and renamed


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_orphans_of_dead_writers_are_removed_on_the_next_write(tmp_path):
    dead = dead_pid()
    orphan = tmp_path / f".a.json.{dead}-x1y2z3.tmp"
    live = tmp_path / f".a.json.{os.getpid()}-x1y2z3.tmp"  # a writer still running: its rename must not break
    other = tmp_path / f".b.json.{dead}-x1y2z3.tmp"  # another file's: not this write's business
    older = tmp_path / ".a.json.k2j3h4_x.tmp"  # no process id (an older memsched): not known dead
    for leftover in (orphan, live, other, older):
        leftover.write_text("{")
    write_json_atomic(tmp_path / "a.json", {"a": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["a.json", live.name, other.name, older.name])


WRITER = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {root!r})
    from planner.jsonio import write_json_atomic
    contents = json.load(open(sys.argv[2]))
    print("ready", flush=True)
    while True:
        for content in contents:
            write_json_atomic(sys.argv[1], content)
""")


@pytest.mark.slow
def test_a_writer_killed_at_random_leaves_a_whole_file(tmp_path):
    chain = random_chain(3000, seed=1, tmp=True, params=True).to_dict()  # about 1.5 MB each as written
    plan = {"format": "memsched.plan/1", "schedule": [{"op": "F_all", "stage": i} for i in range(40000)]}
    contents = [chain, plan, dict(chain, name="second")]
    (tmp_path / "contents.json").write_text(json.dumps(contents))
    folder = tmp_path / "out"
    folder.mkdir()
    path = folder / "target.json"
    write_json_atomic(path, contents[0])
    started = time.monotonic()
    write_json_atomic(path, contents[1])
    one_write = time.monotonic() - started
    rng = random.Random(13)
    orphans = 0
    for _ in range(20):
        writer = subprocess.Popen([sys.executable, "-c", WRITER.format(root=str(ROOT)), str(path),
                                   str(tmp_path / "contents.json")], stdout=subprocess.PIPE, text=True)
        assert writer.stdout.readline() == "ready\n"
        time.sleep(rng.uniform(0, 2 * one_write))
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        assert json.loads(path.read_text()) in contents
        leftovers = [p.name for p in folder.iterdir() if p != path]
        assert len(leftovers) <= 1 and all(name.startswith(f".target.json.{writer.pid}-") for name in leftovers)
        orphans += len(leftovers)
    assert orphans >= 1  # some kills did land inside a write (each is mostly writing)
    write_json_atomic(path, contents[2])
    assert [p.name for p in folder.iterdir()] == [path.name] and json.loads(path.read_text()) == contents[2]
