"""The pipeline executor: runs a plan of kind ``pipeline`` on ``torch.distributed.pipelining``.

:func:`run_pipeline` checks the plan and the model, launches one process per device of the plan
(``torch.multiprocessing``, spawn; gloo on CPU, NCCL on CUDA with one GPU per rank; each runs
planner/execute/pipeline_rank.py), watches their progress and returns a
:class:`planner.execute.pipeline_rank.RankResult` per rank: the measured activation peak of each step beside
the plan's device peak less what existed before the window. Failures are one line
(:class:`planner.errors.MemschedError`): a batch that does not split into the micro-batches, a plan that cannot
run, a parameter shared across devices that the plan does not count, a rank that dies (the first to fail is
named), and a run that makes no progress for ``progress_timeout`` seconds; the other ranks are then terminated
and every child is joined. Ranks die with the parent. Under torchrun nothing is spawned: this process runs its
own rank (planner/execute/torchrun.py). How: docs/execution.md ("Pipeline executor").
"""

import functools
import os
import socket
import tempfile
import time
from multiprocessing.connection import wait
from pathlib import Path

import torch
import torch.multiprocessing as mp

import planner.validate as validate
from planner.errors import MemschedError
from planner.execute.pipeline_rank import STARTUP_TIMEOUT, check_model, rank_worker, run_rank
from planner.execute.records import input_specs, stage_specs
from planner.execute.stages import named_stages
from planner.execute.torchrun import torchrun_world
from planner.measured_on import record_of
from planner.plan import Plan, check_plan_matches

DEFAULT_PROGRESS_TIMEOUT = 300.0  # seconds without a finished step (or a rank's setup milestone)
_EXIT_GRACE = 30.0  # seconds a rank that is done (results saved, process group left) gets to exit
_FAILURE_GRACE = 2.0  # seconds the other ranks get to report their own errors once one has failed
_RANKS_PER_CORE = 4  # a CPU run's processes (one per device) per core, at most


def check_pipeline_plan(plan: Plan) -> None:
    """Refuse a plan this executor cannot run, in one line."""
    if plan.kind != "pipeline" or plan.pipeline is None:
        raise MemschedError(f"run_pipeline needs a plan of kind 'pipeline', got kind {plan.kind!r}")
    pipe = plan.pipeline
    devices = len(pipe.devices)
    if pipe.schedule == "1f1b" and pipe.micro_batches < devices:
        raise MemschedError(f"1F1B needs at least as many micro-batches as devices: {pipe.micro_batches} < {devices}")
    for s, (a, b) in enumerate(zip(pipe.devices, pipe.devices[1:])):
        if a.last != b.first:
            raise MemschedError(f"pipeline plan: device {s} ends at stage {a.last} "
                                f"but device {s + 1} starts at {b.first}")


def run_pipeline(model, plan: Plan, steps: int = 1, *, meter, device: str = "cpu", lr: float = None,
                 progress_timeout: float = DEFAULT_PROGRESS_TIMEOUT, chain=None, return_grads: bool = False,
                 seed: int = 0, here=None) -> list:
    """Train ``steps`` steps by a pipeline ``plan`` on one process per device; return a
    :class:`planner.execute.pipeline_rank.RankResult` per rank (under torchrun: on rank 0, None on the others).

    ``model``: a picklable function returning the model (a :class:`planner.execute.stages.StagedModel`: stages, example
    inputs of the whole batch, which the plan's micro-batches split, and loss), e.g. ``functools.partial(
    profiles.spec.built_model, spec, batch=N)``; ``meter(device)``: the memory meter each rank measures with
    (``profiles.memory.memory_meter``), passed in so that the executor imports nothing from profiles. ``lr``: Adam steps
    after each step (none when None: every step then runs on the same parameters). ``chain``: when given, the
    plan must have been solved for it. ``return_grads``: each rank's parameter gradients of the first step.
    ``progress_timeout``: seconds without a finished step (nor a rank's setup milestone) after which the run is
    stopped, in one line naming the rank that made no progress. ``here``: this process's rank of a launch by
    torchrun (planner/execute/torchrun.py's :class:`TorchrunRank`), which runs its device of the plan; None: the
    ranks are spawned here, and ``device`` must have a GPU per device (CUDA) or the cores for them (CPU).
    """
    check_progress_timeout(progress_timeout)
    check_pipeline_plan(plan)
    if chain is not None:
        check_plan_matches(plan, chain, kind="pipeline")
    if device not in ("cpu", "cuda"):
        raise MemschedError(f"--device must be cpu or cuda, got {device!r}")
    world = len(plan.pipeline.devices)
    if here is None:
        _check_spawnable(world, device)
    if not torch.distributed.is_available():
        raise MemschedError("torch.distributed is not available in this PyTorch build: a pipeline cannot run")
    # Refuse a bad batch here, before any process starts (the workers check again on the built model).
    built = model()
    _check_measured_on(built, plan, chain, check_model(built, plan))
    del built
    job = functools.partial(run_rank, model=model, plan=plan, steps=steps, meter=meter, lr=lr,
                            return_grads=return_grads, seed=seed)
    return launch_ranks(job, world, device, progress_timeout) if here is None else here.run(job, world)


def _check_spawnable(world: int, device: str) -> None:
    """The ranks of a plan of ``world`` devices spawned on this machine: refused in one line beyond its cores (CPU)
    or its GPUs (CUDA)."""
    if device == "cpu" and world > _cpu_ranks():
        raise MemschedError(f"the plan has {world} devices: a CPU run starts one process per device (a Python "
                            f"interpreter with torch), at most {_cpu_ranks()} here ({_RANKS_PER_CORE} per core); "
                            "partition the chain for fewer devices")
    if device == "cuda" and (not torch.cuda.is_available() or torch.cuda.device_count() < world):
        raise MemschedError(f"the plan needs {world} CUDA devices, "
                            f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} are available")


def _cpu_ranks() -> int:
    """The most ranks a CPU run starts on this machine."""
    return _RANKS_PER_CORE * (os.cpu_count() or 1)


def check_progress_timeout(seconds) -> float:
    """A progress timeout is a number of seconds above 0 and at most a year; anything else is refused in one line."""
    return validate.positive_seconds(seconds, "--progress-timeout")


def _check_measured_on(built, plan: Plan, chain, micro: int) -> None:
    """What the chain (else the plan) records it was measured on must be the model's stages and one micro-batch
    of its input (the chain is profiled at the micro-batch); not checked when neither records it."""
    measured, source = record_of(chain, plan)
    if measured is None:
        return
    measured.check_stages(stage_specs(named_stages(built.stages)), source)
    inputs = input_specs((built.example_inputs[0][:micro],))
    batch = measured.recorded_batch(inputs)
    measured.check_inputs(inputs, source, None if batch is None else (
        f"the batch splits into micro-batches of {micro}: pass --batch {batch * plan.pipeline.micro_batches}, or "
        f"profile at a batch of {micro}"))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_ranks(job, world: int, device: str, progress_timeout: float, label: str = "pipeline",
                 threads: int = 1) -> list:
    """Run ``job(rank, world, where, report)`` (picklable) on ``world`` processes joined in one process group
    (planner/execute/pipeline_rank.py's :func:`rank_worker`), each with ``threads`` torch threads, watching
    their progress; return each rank's result. Failures and stalls are one line naming the rank, ``label``
    naming the run. Refused in one line in a rank torchrun started: what it spawns would wait for torchrun's store
    (planner/execute/torchrun.py runs this process as its rank instead)."""
    if torchrun_world() is not None:
        raise MemschedError(f"this process is a rank torchrun started: the {label} run cannot spawn ranks of its own "
                            "(they would wait for torchrun's store); run it as this rank (planner/execute/torchrun.py)"
                            ", or start memsched without torchrun")
    context = mp.get_context("spawn")
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix=f"memsched-{label}-") as folder:
        ranks = []
        try:
            for rank in range(world):
                reader, writer = context.Pipe(duplex=False)
                process = context.Process(target=rank_worker, daemon=True,
                                          args=(rank, world, port, folder, writer, os.getpid(), device,
                                                progress_timeout, job, threads))
                process.start()
                writer.close()  # the rank holds the only writer: the pipe ends when the rank does
                ranks.append(_Rank(rank, process, reader))
            _wait(ranks, progress_timeout, label)
        finally:
            for r in ranks:
                if r.done:  # let it exit on its own first
                    r.process.join(_EXIT_GRACE)
                if r.process.is_alive():
                    r.process.terminate()
            for r in ranks:
                r.process.join(5)
                if r.process.is_alive():
                    r.process.kill()
                    r.process.join()
                r.reader.close()
        return [torch.load(Path(folder) / f"rank{rank}.pt", weights_only=False) for rank in range(world)]


class _Rank:
    """The parent's view of one rank: its process, its pipe, what it last said it was doing and since when
    (``time.monotonic()`` at receipt), its finished steps, and how it failed."""

    def __init__(self, rank, process, reader):
        self.rank, self.process, self.reader = rank, process, reader
        self.doing, self.busy, self.since = "starting: its interpreter and imports", True, time.monotonic()
        self.started = False  # it has sent its first message
        self.done = False  # its results are saved and it has left the process group: it only has to exit
        self.steps = 0
        self.error = None  # (time.time(), message, lost_peer): what it reported before exiting
        self.died = None  # time.time() when the parent saw it exit with a non-zero status

    def receive(self, message, now) -> bool:
        """Record one message of the rank; True when it is progress (a setup milestone or a finished step)."""
        kind = message[0]
        self.started = True
        if kind == "doing":
            _, self.doing, self.busy, milestone = message
            self.since = now
            return milestone
        if kind == "step":
            self.steps = message[1]
            self.doing, self.busy, self.since = f"after step {self.steps}", True, now
            return True
        if kind == "done":
            self.done, self.doing, self.busy, self.since = True, "done, exiting", False, now
        if kind == "error":
            self.error = message[1:]
        return False


def _wait(ranks, progress_timeout, label) -> None:
    """Until every rank has exited cleanly. The first failure, or no progress for ``progress_timeout`` seconds
    (no step finished, no setup milestone passed), as one line."""
    readers = {r.reader: r for r in ranks}
    progress = time.monotonic()  # the last progress of any rank
    failed = None  # time.monotonic() when the first failure was seen
    while True:
        codes = [r.process.exitcode for r in ranks]  # one look per round: a rank may exit meanwhile
        now = time.monotonic()
        for r, code in zip(ranks, codes):
            if r.died is None and code not in (None, 0):
                r.died = time.time()
        if all(code == 0 or (code is None and r.done) for r, code in zip(ranks, codes)):
            return
        if any(r.died is not None for r in ranks):
            # Give the others a moment to report their own errors: the first to fail is the cause.
            failed = now if failed is None else failed
            if now > failed + _FAILURE_GRACE or None not in codes:
                _drain(readers, now)
                raise MemschedError(_first_failure(ranks, label))
            until = failed + _FAILURE_GRACE
        else:
            # Starting a rank (a fresh interpreter importing torch) is no step: it may take longer.
            limit = progress_timeout if all(r.started for r in ranks) else max(progress_timeout, STARTUP_TIMEOUT)
            if now - progress > limit:
                raise MemschedError(_stalled(ranks, limit, now, label))
            until = progress + limit
        # A rank still running in this round's look is waited on, so the list is never empty.
        ready = wait(list(readers) + [r.process.sentinel for r, code in zip(ranks, codes) if code is None],
                     timeout=max(until - now, 0) + 0.01)
        if any(connection in readers for connection in ready) and _drain(readers, time.monotonic()):
            progress = time.monotonic()


def _drain(readers, now) -> bool:
    """Receive every message waiting in the ranks' pipes (a pipe that ended is dropped); True on progress."""
    progressed = False
    for connection, r in list(readers.items()):
        try:
            while connection.poll():
                progressed |= r.receive(connection.recv(), now)
        except (EOFError, OSError):
            del readers[connection]
    return progressed


def _stalled(ranks, progress_timeout, now, label: str = "pipeline") -> str:
    alive = [r for r in ranks if r.process.exitcode is None]
    busy = [r for r in alive if r.busy and not r.done]
    if busy:  # stuck in its own work (the others wait on it)
        r = min(busy, key=lambda r: r.since)
        who = f"rank {r.rank} made no progress for {now - r.since:.1f} s ({r.doing})"
    else:
        who = "every rank waits on another: " + "; ".join(f"rank {r.rank} made no progress for {now - r.since:.1f} s "
                                                          f"({r.doing})" for r in alive)
    return (f"{label} run timed out after {progress_timeout:g} s (ranks {[r.rank for r in alive]} still running) "
            f"without a finished step: {who}; give --progress-timeout more seconds if a step can take that long")


def _first_failure(ranks, label: str = "pipeline") -> str:
    """The cause: the earliest failure that is not a lost connection to a peer, else the earliest."""
    failures = []
    for r in ranks:
        if r.error is not None:
            stamp, message, lost_peer = r.error
            failures.append((lost_peer, stamp, r.rank, f"{label} rank {r.rank} failed: {message}"))
        elif r.died is not None:
            code = r.process.exitcode
            why = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
            failures.append((False, r.died, r.rank, f"{label} rank {r.rank} died ({why}) without reporting an "
                                                    "error"))
    _, _, rank, message = min(failures)
    after = sorted(f[2] for f in failures if f[2] != rank)
    if after:
        message += f"; then rank{'s' if len(after) > 1 else ''} {', '.join(map(str, after))} failed too"
    return message


def summary_lines(results) -> list:
    """Per rank: stages, the last step's measured peak against the plan's peak minus the resident state
    (parameters, optimizer state), i.e. activations plus the parameter gradients allocated in the step."""
    lines = [f"{'rank':>4}  {'stages':>7}  {'schedule':>9}  {'measured':>12}  {'predicted':>12}  {'ratio':>6}  "
             f"{'first step':>12}  {'seconds':>8}  loss"]
    for r in results:
        ratio = r.measured / r.predicted_window if r.predicted_window else float("nan")
        loss = "" if r.loss is None else f"{r.loss:.6f}"
        lines.append(f"{r.rank:>4}  {f'{r.first}-{r.last - 1}':>7}  {'recompute' if r.recomputes else 'store-all':>9}  "
                     f"{r.measured:>12,}  {r.predicted_window:>12,}  {ratio:>6.3f}  {r.peaks[0]:>12,}  "
                     f"{r.seconds[-1]:>8.4f}  {loss}")
    lines.append("measured: bytes allocated in the last step at its peak, parameter gradients included; predicted: the "
                 "plan's device peak less parameters, optimizer state and the step's buffers (the batch on rank 0, "
                 "PipelineStage's receive buffers elsewhere); first step: also the receive buffers, allocated then "
                 "and kept")
    return lines
