"""What test files in several folders share: the one-line error check, running memsched's command line, a child
process's SIGINT for the Ctrl-C tests, and times sized by bytes (plans that do not follow the clock).

Bad input gets one line naming the field and the fix, never a traceback: :func:`one_line` checks an error raised
by the library (:func:`raises_one_line` calls and catches it), :func:`one_error_line` the command line's
``memsched: error: ...``."""

import dataclasses
import gc
import os
import signal

import pytest

import cli
from planner.errors import MemschedError

CLI_ERROR = "memsched: error: "

DEFAULT_THREADS_VARIABLE = "MEMSCHED_TESTS_DEFAULT_THREADS"  # set by conftest.py in a pytest-xdist worker


def default_threads() -> int:
    """torch's default intra-op thread count on this machine (a pytest-xdist worker otherwise computes with one:
    conftest.py)."""
    import torch  # here, not at the top: conftest.py imports this module for every test file

    return int(os.environ.get(DEFAULT_THREADS_VARIABLE, 0)) or torch.get_num_threads()


def at_thread_count(count):
    """A fixture's body: ``count`` intra-op threads (``"default"``: :func:`default_threads`) while the test runs,
    the count before restored after; yields the count."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(default_threads() if count == "default" else count)
    yield torch.get_num_threads()
    torch.set_num_threads(before)


def one_line(error, *fragments) -> str:
    """The message of ``error`` (a raised exception, or pytest's ``ExceptionInfo`` of one), checked: a
    :class:`MemschedError` whose message is one non-empty line holding every fragment."""
    error = error.value if isinstance(error, pytest.ExceptionInfo) else error
    message = str(error)
    assert isinstance(error, MemschedError), f"{type(error).__name__}: {message}"
    assert message.strip(), "empty error message"
    assert "\n" not in message and "\r" not in message, f"message spans lines: {message!r}"
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


def raises_one_line(call, *args, **kwargs) -> str:
    """``call(*args, **kwargs)`` must raise a :class:`MemschedError`; its message, checked by :func:`one_line`."""
    with pytest.raises(MemschedError) as info:
        call(*args, **kwargs)
    return one_line(info)


def one_error_line(status, out: str, err: str, *fragments) -> str:
    """A refusal on the command line, checked: exit status 2, stderr one line ``memsched: error: MESSAGE`` (the
    message as :func:`one_line` wants it, holding every fragment), no traceback, nothing trained or written.
    ``(status, out, err)``: what :func:`run` returns, or ``cli.main(...), *capsys.readouterr()``. The line."""
    assert status == 2, (status, out, err)
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(CLI_ERROR), err
    assert "Traceback" not in err + out
    assert "measured peak" not in out and "written to" not in out, out  # nothing trained or written
    message = lines[0][len(CLI_ERROR):]
    assert message.strip(), "empty error message"
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return lines[0]


def seeded_losses(first, second, batch: dict, seed: int = 0) -> tuple:
    """Each model's loss on ``batch`` (keyword arguments; ``output.loss``) at the same seed, its backward run:
    ``(first's loss, second's)``, their gradients left in ``.grad``."""
    import torch

    losses = []
    for model in (first, second):
        torch.manual_seed(seed)
        loss = model(**batch).loss
        loss.backward()
        losses.append(loss)
    return tuple(losses)


def sigint_as_a_terminal_sends_it():
    """In a child process before it starts (``Popen(preexec_fn=...)``): SIGINT's default disposition, which
    Python turns into KeyboardInterrupt. A test run launched in the background (``cmd &`` in a script, nohup)
    ignores SIGINT, and its children would inherit that: the Ctrl-C tests would see no interrupt at all."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run(capsys, *argv) -> tuple:
    """``memsched ARGV...`` in-process (``cli.main``): ``(exit status, stdout, stderr)``; arguments as ``str``."""
    status = cli.main([str(arg) for arg in argv])
    out, err = capsys.readouterr()
    return status, out, err


def measured_ratios(out: str) -> list:
    """measured / predicted peak of each training step row of ``memsched train``'s table."""
    rows = [line.split() for line in out.splitlines()]
    return [float(row[-4]) for row in rows if len(row) >= 8 and row[0].isdigit() and row[1].replace(".", "").isdigit()]


def sized_times(chain):
    """Times proportional to bytes: a stage's to what it keeps, an option's extra backward to what it drops."""
    stages = []
    for s in chain.stages:
        options = tuple(dataclasses.replace(o, fwd_time=1e-9 * (s.saved_bytes + s.fwd_tmp_bytes),
                                            bwd_time=2e-9 * (s.saved_bytes + s.bwd_tmp_bytes)
                                            + 0.5e-9 * (s.saved_bytes - o.saved_bytes)) for o in s.options)
        stages.append(dataclasses.replace(s, fwd_time=1e-9 * (s.saved_bytes + s.fwd_tmp_bytes),
                                          bwd_time=2e-9 * (s.saved_bytes + s.bwd_tmp_bytes), options=options))
    return dataclasses.replace(chain, stages=tuple(stages))


def one_after_another(rank, world, where, report, *, jobs):
    """A launched rank's part of each job in turn, in the one process group (one launch for several runs: a launch
    is 5-15 s of process start and imports): each job's result, what was left of the last one collected first, so
    that no release of it falls in the next one's measured window."""
    results = []
    for job in jobs:
        gc.collect()
        results.append(job(rank, world, where, report))
    return results
