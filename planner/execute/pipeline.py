"""The pipeline executor: runs a plan of kind ``pipeline`` on ``torch.distributed.pipelining``.

:func:`run_pipeline` launches one process per device of the plan (``torch.multiprocessing``, spawn; gloo on
CPU, NCCL on CUDA with one GPU per rank), rendezvous on a free TCP port of localhost chosen at launch. Each
rank builds the model (same seed, so the same parameters), takes its stages ``[first, last)`` as one module
(the plain stages for a store-all schedule; :func:`planner.execute.chain.apply_plan` with the device's own
schedule, in local stage indices, when it recomputes), wraps it in a static-shape ``PipelineStage`` (example
input and output of one micro-batch; later stages' inputs ``requires_grad``) and runs ``Schedule1F1B`` or
``ScheduleGPipe`` with the plan's micro-batches over the batch. The last rank computes the loss of each
micro-batch: the model's ``loss_fn`` with its batch-sized target tensor (the one tensor its closure holds
whose first dimension is a multiple of the batch) replaced by the micro-batch's slice. The schedule scales
the gradients by ``1 / m`` (``scale_grads``), so with a mean-reduced loss they equal single-process
gradients of the whole batch.

Measured per rank and step: the activation peak, the live-memory tracker
(:class:`profiles.memory.LiveMemoryTracker`) on CPU or ``max_memory_allocated`` minus the level at entry on
CUDA, around ``schedule.step`` (and the sums of shared parameters' gradients) with the parameter gradients
``None`` and the stage's runtime state cleared before (what it kept of the previous step, which ``step``
itself frees first), so the gradients are allocated inside it and nothing is freed below the starting level.
It is compared with the plan's device peak less what existed before the window: the resident parameters and
optimizer state, and the step's buffers (planner/simulate/pipeline.py): the batch (rank 0) or
``PipelineStage``'s receive buffers (``m`` activations on every rank but the first, ``m`` gradients on every
rank but the last), allocated at the first step and kept. The measurement is of the last step (the first also
allocates the receive buffers). :class:`RankResult` reports these byte counts beside the measured peak.

**Shared parameters** (tied weights, planner/shared.py). A parameter read by stages on several devices has a
copy on each (every rank builds the whole model with the same seed, so the copies start equal); after
``schedule.step``, inside the measured window, each copy's gradient is summed over the ranks holding one
(``all_reduce`` on a group of those ranks), so every copy has the whole batch's gradient and takes the
update of single-process training. The plan must count those copies (``pipeline.shared``, from the chain's
``shared``; planner/simulate/pipeline.py): a parameter shared across devices that it does not count, or
one it counts that the model does not share, is refused in one line naming the parameter, its stages and
devices, and the fixes.

Failures are one line (:class:`planner.errors.MemschedError`): a batch that does not split into the
micro-batches, a plan that cannot run (1F1B with fewer micro-batches than devices; on the CPU more devices
than ``4 * cpu_count`` processes), a parameter shared across devices that the plan does not count, a rank
that dies, and a run that makes no progress; the other ranks are then terminated, and every child is
joined.

The ranks' lifecycle:

* **They die with the parent.** Each rank arms ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` first thing (Linux), then
  checks that its parent is still the process that launched it (it may have died while the rank imported);
  elsewhere a daemon thread polls the parent's pid. A ``kill -9`` of the parent ends every rank at once.
  (The signal follows the launching *thread*: :func:`run_pipeline` waits for its ranks in that thread.)
* **A progress timeout, not a whole-run one.** Each rank reports what it is doing through a pipe: its setup
  milestones (started, joining the process group, building its stage, ready), each forward, backward and loss
  of its stage (busy) and the waits between them (on its peers), and each finished step. The run is stopped
  when no step has finished, and no rank has passed a setup milestone, for ``progress_timeout`` seconds
  (``--progress-timeout``, default 300); a run of any length goes on while its steps finish. Until every rank
  has started (a fresh interpreter importing torch: seconds, more on a loaded machine) the limit is at least
  ``_STARTUP_TIMEOUT``; a rank that is done (results saved, process group left) is not held to it (and
  exits at once, skipping the interpreter's teardown of torch). The message names the rank stuck in its own
  work (the one busy longest), for how long and in what, or, when every rank waits on another, each rank's
  wait. (On CUDA "its own work" is the launching of its kernels: a kernel that never ends shows as a wait.)
* **The first rank to fail is named.** A rank reports its error (with the time) before it exits; the parent
  sees a rank that dies without one (a signal, ``os._exit``) the moment it exits. The cause is the earliest
  failure that is not a lost connection to a peer (what the other ranks see when one dies: gloo's
  "Connection closed by peer"), else the earliest.
"""

import ctypes
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import types
from dataclasses import dataclass
from pathlib import Path

import torch

import planner.validate as validate
from planner.errors import MemschedError
from planner.ops import FORWARD_OPS
from planner.plan import Plan, Predicted
from planner.shared import find_shared

DEFAULT_PROGRESS_TIMEOUT = 300.0  # seconds without a finished step (or a rank's setup milestone)
_STARTUP_TIMEOUT = 120.0  # seconds a rank may take to start (a fresh interpreter importing torch) if longer
_EXIT_GRACE = 30.0  # seconds a rank that is done (results saved, process group left) gets to exit
_FAILURE_GRACE = 2.0  # seconds the other ranks get to report their own errors once one has failed
_RANKS_PER_CORE = 4  # a CPU run's processes (one per device) per core, at most
# What a rank sees when a peer dies under it: a consequence, not the cause (lower case).
_PEER_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe", "remote worker crash",
              "nccl communicator was aborted")


@dataclass
class RankResult:
    """What one rank measured (bytes, seconds) and, for the tests, its parameter gradients of the first step."""

    rank: int
    first: int
    last: int  # exclusive
    recomputes: bool
    losses: list  # per step, mean of the micro-batch losses (last rank), else []
    peaks: list  # per step, measured activation peak (bytes)
    seconds: list  # per step, wall clock of schedule.step
    predicted_peak: int  # the plan's device peak (resident state and buffers included)
    predicted_resident: int  # parameters, master copy, optimizer state: before the step, outside the window
    batch_bytes: int  # rank 0: the m micro-batch inputs (views of the batch), outside the window; else 0
    recv_buffer_bytes: int  # PipelineStage's receive buffers (activations and gradients), kept across steps
    grads: dict  # parameter name -> gradient after the first step (None unless asked for)

    @property
    def buffer_bytes(self) -> int:
        """The step's inputs and received gradients: the batch on rank 0, the receive buffers elsewhere."""
        return self.batch_bytes + self.recv_buffer_bytes

    @property
    def predicted_window(self) -> int:
        """What the measured window should see: the plan's peak less the resident state and the buffers."""
        return self.predicted_peak - self.predicted_resident - self.buffer_bytes

    @property
    def measured(self) -> int:
        """The last step's measured peak (from the second step on the receive buffers exist already)."""
        return self.peaks[-1]

    @property
    def loss(self):
        return self.losses[-1] if self.losses else None


def check_batch(batch: int, micro_batches: int) -> int:
    """The micro-batch size; a batch that does not split evenly is refused in one line."""
    if batch % micro_batches:
        raise MemschedError(f"the batch of {batch} does not split into {micro_batches} equal micro-batches; "
                            f"give a batch that is a multiple of {micro_batches} (--batch)")
    return batch // micro_batches


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
            raise MemschedError(f"pipeline plan: device {s} ends at stage {a.last} but device {s + 1} starts at {b.first}")


def device_recomputes(device) -> bool:
    """True when a device's schedule is not store-all (some stage forwarded more than once, or not with F_all)."""
    forwards = [op for op in device.schedule if op.kind in FORWARD_OPS]
    return len(forwards) != device.last - device.first or any(op.kind != "F_all" for op in forwards)


def local_plan(plan: Plan, device) -> Plan:
    """A chain plan for one device's sub-chain: its schedule in local stage indices (planner.execute.chain.apply_plan)."""
    from planner.simulate.pipeline import to_local

    return Plan(problem_name=f"{plan.problem_name}[{device.first}:{device.last}]", fingerprint="", solver="partition",
                budget_bytes=device.peak_bytes, predicted=Predicted(peak_bytes=device.peak_bytes, time=device.time,
                                                                     baseline_time=device.time),
                schedule=to_local(device.schedule, device.first))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_pipeline(model, plan: Plan, steps: int = 1, *, meter, device: str = "cpu", lr: float = None,
                 progress_timeout: float = DEFAULT_PROGRESS_TIMEOUT, chain=None, return_grads: bool = False,
                 seed: int = 0) -> list:
    """Train ``steps`` steps by a pipeline ``plan`` on one process per device; return a :class:`RankResult` per rank.

    ``model``: a picklable function returning the model (a :class:`profiles.zoo.ChainModel`: stages, example
    inputs of the whole batch, which the plan's micro-batches split, and loss), e.g. ``functools.partial(
    profiles.spec.built_model, spec, batch=N)``; ``meter(device)``: the memory meter each rank measures with
    (``profiles.memory.memory_meter``), passed in so that the executor imports nothing from profiles. ``lr``: Adam steps
    after each step (none when None: every step then runs on the same parameters). ``chain``: when given, the
    plan must have been solved for it. ``return_grads``: each rank's parameter gradients of the first step.
    ``progress_timeout``: seconds without a finished step (nor a rank's setup milestone) after which the run is
    stopped, in one line naming the rank that made no progress.
    """
    check_progress_timeout(progress_timeout)
    check_pipeline_plan(plan)
    if chain is not None:
        from planner.plan import check_pipeline_plan_matches

        check_pipeline_plan_matches(plan, chain)
    if device not in ("cpu", "cuda"):
        raise MemschedError(f"--device must be cpu or cuda, got {device!r}")
    world = len(plan.pipeline.devices)
    if device == "cpu" and world > _cpu_ranks():
        raise MemschedError(f"the plan has {world} devices: a CPU run starts one process per device (a Python "
                            f"interpreter with torch), at most {_cpu_ranks()} here ({_RANKS_PER_CORE} per core); "
                            "partition the chain for fewer devices")
    if device == "cuda" and (not torch.cuda.is_available() or torch.cuda.device_count() < world):
        raise MemschedError(f"the plan needs {world} CUDA devices, "
                            f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} are available")
    if not torch.distributed.is_available():
        raise MemschedError("torch.distributed is not available in this PyTorch build: a pipeline cannot run")
    # Refuse a bad batch here, before any process starts (the workers check again on the built model).
    built = model()
    _check_measured_on(built, plan, chain, _check_model(built, plan))
    del built
    return _launch(model, plan, steps, meter, device, lr, progress_timeout, return_grads, seed, world)


def _cpu_ranks() -> int:
    """The most ranks a CPU run starts on this machine."""
    return _RANKS_PER_CORE * (os.cpu_count() or 1)


def check_progress_timeout(seconds) -> float:
    """A progress timeout is a number of seconds above 0 and at most a year; anything else is refused in one line."""
    return validate.positive_seconds(seconds, "--progress-timeout")


def _batch_of(built) -> int:
    first = built.example_inputs[0]
    if not isinstance(first, torch.Tensor) or first.dim() == 0:
        raise MemschedError("a pipeline splits the model's first input along its first dimension: it must be a tensor")
    return first.shape[0]


def _check_model(built, plan: Plan) -> int:
    if len(built.example_inputs) != 1:
        raise MemschedError("pipeline: models with extra inputs beside the first are not supported")
    pipe = plan.pipeline
    if pipe.devices[-1].last != len(built.stages):
        raise MemschedError(f"the pipeline plan covers {pipe.devices[-1].last} stages but the model has "
                            f"{len(built.stages)}; partition a chain of this model")
    micro = check_batch(_batch_of(built), pipe.micro_batches)
    _target_cell(built.loss_fn, _batch_of(built), pipe.micro_batches)
    synced_parameters(built, plan)
    return micro


def _devices_of(plan: Plan, stages) -> list:
    """The devices (ranks) of ``plan`` holding any of ``stages``, ascending."""
    return sorted({s for s, device in enumerate(plan.pipeline.devices) for stage in stages
                   if device.first <= stage < device.last})


def synced_parameters(built, plan: Plan) -> list:
    """``[(SharedParameter, parameter, ranks), ...]``: the model's parameters read by stages on several devices
    (planner/shared.py), whose copies' gradients the ranks sum after the backward. The plan must count exactly
    these (``pipeline.shared``, from its chain), else one line naming the first difference."""
    counted = {entry.stages for entry in plan.pipeline.shared if len(_devices_of(plan, entry.stages)) > 1}
    found = []
    for entry, parameter in find_shared(built.stages):
        ranks = _devices_of(plan, entry.stages)
        if len(ranks) > 1:
            if entry.stages not in counted:
                raise MemschedError(_uncounted(entry, plan, built.stages))
            found.append((entry, parameter, ranks))
    for stages in sorted(counted - {entry.stages for entry, _, _ in found}):
        names = ", ".join(f"{k} ({built.stages[k][0]})" for k in stages)
        raise MemschedError(f"pipeline: the plan counts a parameter shared by stages {names} on devices "
                            f"{_devices_of(plan, stages)}, which this model's stages do not share; run the plan with "
                            "the model it was solved for, or partition a chain of this model")
    return found


def _uncounted(entry, plan: Plan, pairs) -> str:
    """The one line for a parameter shared across devices that the plan does not count."""
    owner = entry.owner
    owner_device = _devices_of(plan, (owner,))[0]
    reader = next(k for k in entry.stages if _devices_of(plan, (k,))[0] != owner_device)
    device = _devices_of(plan, (reader,))[0]
    return (f"pipeline: parameter {entry.name} is read by stage {reader} ({pairs[reader][0]}) on device {device} "
            f"and stage {owner} ({pairs[owner][0]}) on device {owner_device}, but the plan does not count a copy of "
            f"it on device {device} (its chain lists no such shared parameter); partition a chain that records it "
            f"(\"shared\", docs/formats.md), untie it, or keep stages {reader} to {owner} on one device")


def _sync_groups(synced, rank: int) -> list:
    """``[(parameter, process group), ...]`` of this rank's copies to sum; every rank creates every group, in the
    same order (``new_group`` is collective)."""
    import torch.distributed as dist

    groups, mine = {}, []
    for _, parameter, ranks in synced:
        if tuple(ranks) not in groups:
            groups[tuple(ranks)] = dist.new_group(ranks)
        if rank in ranks:
            mine.append((parameter, groups[tuple(ranks)]))
    return mine


def _sum_gradients(synced) -> None:
    """Sum each copy's gradient over the ranks holding one, in place: every copy then has the whole batch's
    gradient, as in single-process training (the schedule scaled each by 1/m already)."""
    for parameter, group in synced:
        if parameter.grad is None:  # no reader on this rank used it
            parameter.grad = torch.zeros_like(parameter)
        torch.distributed.all_reduce(parameter.grad, group=group)


def _check_measured_on(built, plan: Plan, chain, micro: int) -> None:
    """What the chain (else the plan) records it was measured on must be the model's stages and one micro-batch
    of its input (the chain is profiled at the micro-batch); not checked when neither records it."""
    from planner.measured_on import record_of
    from planner.execute.stages import named_stages

    measured, source = record_of(chain, plan)
    if measured is None:
        return
    measured.check_stages(named_stages(built.stages), source)
    inputs = (built.example_inputs[0][:micro],)
    batch = measured.recorded_batch(inputs)
    measured.check_inputs(inputs, source, None if batch is None else (
        f"the batch splits into micro-batches of {micro}: pass --batch {batch * plan.pipeline.micro_batches}, or "
        f"profile at a batch of {micro}"))


def _target_cell(loss_fn, batch: int, micro_batches: int) -> int:
    """Index of the closure cell of ``loss_fn`` holding its batch-sized target (the one tensor whose first
    dimension is a non-zero multiple of ``batch``)."""
    cells = getattr(loss_fn, "__closure__", None) or ()
    found = []
    for k, cell in enumerate(cells):
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] and value.shape[0] % batch == 0:
            found.append(k)
    if len(found) != 1:
        raise MemschedError(f"pipeline: the loss must close over exactly one target tensor whose first dimension is a "
                            f"multiple of the batch ({batch}) to be split into micro-batches; found {len(found)}")
    return found[0]


def micro_loss(loss_fn, batch: int, micro_batches: int):
    """``(loss(output, target), target)``: ``loss_fn`` taking its target as an argument, and the whole target."""
    index = _target_cell(loss_fn, batch, micro_batches)
    target = loss_fn.__closure__[index].cell_contents

    def loss(output, target_chunk):
        cells = tuple(types.CellType(target_chunk) if k == index else cell
                      for k, cell in enumerate(loss_fn.__closure__))
        function = types.FunctionType(loss_fn.__code__, loss_fn.__globals__, loss_fn.__name__, loss_fn.__defaults__,
                                      cells)
        return function(output)

    return loss, target


def _launch(model, plan, steps, meter, device, lr, progress_timeout, return_grads, seed, world) -> list:
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="memsched-pipeline-") as folder:
        ranks = []
        try:
            for rank in range(world):
                reader, writer = context.Pipe(duplex=False)
                process = context.Process(target=_worker, daemon=True,
                                          args=(rank, world, port, folder, writer, os.getpid(), model, plan, steps,
                                                meter, device, lr, progress_timeout, return_grads, seed))
                process.start()
                writer.close()  # the rank holds the only writer: the pipe ends when the rank does
                ranks.append(_Rank(rank, process, reader))
            _wait(ranks, progress_timeout)
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


def _wait(ranks, progress_timeout) -> None:
    """Until every rank has exited cleanly. The first failure, or no progress for ``progress_timeout`` seconds
    (no step finished, no setup milestone passed), as one line."""
    from multiprocessing.connection import wait

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
                raise MemschedError(_first_failure(ranks))
            until = failed + _FAILURE_GRACE
        else:
            # Starting a rank (a fresh interpreter importing torch) is no step: it may take longer.
            limit = progress_timeout if all(r.started for r in ranks) else max(progress_timeout, _STARTUP_TIMEOUT)
            if now - progress > limit:
                raise MemschedError(_stalled(ranks, limit, now))
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


def _stalled(ranks, progress_timeout, now) -> str:
    alive = [r for r in ranks if r.process.exitcode is None]
    busy = [r for r in alive if r.busy and not r.done]
    if busy:  # stuck in its own work (the others wait on it)
        r = min(busy, key=lambda r: r.since)
        who = f"rank {r.rank} made no progress for {now - r.since:.1f} s ({r.doing})"
    else:
        who = "every rank waits on another: " + "; ".join(f"rank {r.rank} made no progress for {now - r.since:.1f} s "
                                                          f"({r.doing})" for r in alive)
    return (f"pipeline run timed out after {progress_timeout:g} s (ranks {[r.rank for r in alive]} still running) "
            f"without a finished step: {who}; give --progress-timeout more seconds if a step can take that long")


def _first_failure(ranks) -> str:
    """The cause: the earliest failure that is not a lost connection to a peer, else the earliest."""
    failures = []
    for r in ranks:
        if r.error is not None:
            stamp, message, lost_peer = r.error
            failures.append((lost_peer, stamp, r.rank, f"pipeline rank {r.rank} failed: {message}"))
        elif r.died is not None:
            code = r.process.exitcode
            why = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
            failures.append((False, r.died, r.rank, f"pipeline rank {r.rank} died ({why}) without reporting an error"))
    _, _, rank, message = min(failures)
    after = sorted(f[2] for f in failures if f[2] != rank)
    if after:
        message += f"; then rank{'s' if len(after) > 1 else ''} {', '.join(map(str, after))} failed too"
    return message


def _die_with_parent(parent: int) -> None:
    """End this process when ``parent`` (the process that launched it) dies, even by SIGKILL: the kernel's
    parent-death signal on Linux, else a thread polling the parent's pid. Exits at once when the parent has
    died already (while this process started)."""
    armed = False
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            armed = libc.prctl(ctypes.c_int(1), ctypes.c_ulong(signal.SIGKILL), ctypes.c_ulong(0), ctypes.c_ulong(0),
                               ctypes.c_ulong(0)) == 0  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            armed = False
    if os.getppid() != parent:
        os._exit(1)
    if not armed:
        threading.Thread(target=_watch_parent, args=(parent,), name="memsched-parent-watch", daemon=True).start()


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


class _Reporter:
    """A rank's messages to the parent: ``doing`` (what it does, whether busy in its own work, whether it is a
    setup milestone), ``step`` (a step finished), ``error``. The step being run is ``step``."""

    def __init__(self, connection):
        self.connection = connection
        self.step = 0

    def send(self, *message) -> None:
        try:
            self.connection.send(message)
        except OSError:  # the parent is gone
            os._exit(1)

    def doing(self, what: str, busy: bool, milestone: bool = False) -> None:
        self.send("doing", what, busy, milestone)

    def waiting(self) -> None:
        self.doing(f"step {self.step}: waiting for its peers", False)

    def around(self, function, what: str, chunk=True):
        """``function`` reported busy while it runs (``what`` of the micro-batch its first argument numbers)."""
        def reported(*args, **kwargs):
            self.doing(f"step {self.step}: {what}" + (f" of micro-batch {args[0]}" if chunk and args else ""), True)
            try:
                return function(*args, **kwargs)
            finally:
                self.waiting()

        return reported


def _worker(rank, world, port, folder, connection, parent, model, plan, steps, meter, device, lr, progress_timeout,
            return_grads, seed) -> None:
    _die_with_parent(parent)
    report = _Reporter(connection)
    try:
        import datetime

        import torch.distributed as dist
        import torch.distributed.pipelining  # noqa: F401 - imported before the first report: the rank's start

        import planner.execute.chain  # noqa: F401

        report.doing("joining the process group", False, milestone=True)
        torch.set_num_threads(1)
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
        if device == "cuda":
            torch.cuda.set_device(rank)
            where = torch.device("cuda", rank)
        else:
            where = torch.device("cpu")
        # The backend's own timeout is beyond the parent's (the rendezvous waits for the slowest start): the
        # parent's message comes first.
        dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=max(progress_timeout, _STARTUP_TIMEOUT) + 60))
        result = _run_rank(rank, world, model, plan, steps, meter, where, lr, return_grads, seed, report)
        report.doing("saving its results", True)
        torch.save(result, Path(folder) / f"rank{rank}.pt")
        report.doing("waiting for its peers to finish", False)
        dist.barrier()
        report.doing("leaving the process group", True, milestone=True)
        dist.destroy_process_group()
        report.send("done")  # what is left, the exit, is no step: not held to the progress timeout
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # skips the interpreter's teardown of torch (seconds on a loaded machine): nothing is left to do
    except BaseException as exc:  # noqa: BLE001 - reported to the parent as one line, before anything closes
        message = " ".join(f"{type(exc).__name__}: {exc}".split()) if not isinstance(exc, MemschedError) \
            else " ".join(str(exc).split())
        lost_peer = isinstance(exc, torch.distributed.DistNetworkError) or any(text in message.lower()
                                                                                for text in _PEER_LOST)
        report.send("error", time.time(), message[:500], lost_peer)
        if os.environ.get("MEMSCHED_PIPELINE_TRACEBACK"):
            traceback.print_exc()
        os._exit(1)


class _Range(torch.nn.Module):
    """Stages ``[first, last)`` run one after another (store-all: autograd keeps what each stage saves)."""

    def __init__(self, modules):
        super().__init__()
        self.stages = torch.nn.ModuleList(modules)

    def forward(self, x):
        for module in self.stages:
            x = module(x)
        return x


def _run_rank(rank, world, model, plan, steps, meter, where, lr, return_grads, seed, report) -> RankResult:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from planner.execute.chain import apply_plan
    from planner.execute.stages import preserved_state

    report.doing("building its stage", True, milestone=True)
    torch.manual_seed(seed)
    built = model()
    micro = _check_model(built, plan)
    pipe = plan.pipeline
    device_plan = pipe.devices[rank]
    first, last = device_plan.first, device_plan.last
    pairs = list(built.stages)
    whole = _batch_of(built)
    x = built.example_inputs[0].to(where)

    # Example shapes of one micro-batch at this rank's boundaries, without gradients or lasting effects.
    for _, module in pairs:
        module.to(where)
    with torch.no_grad(), preserved_state([m for _, m in pairs], where):
        activation = x[:micro]
        for k in range(last):
            if k == first:
                example_in = activation
            activation = pairs[k][1](activation)
        example_out = activation
    for name, value in (("input", example_in), ("output", example_out)):
        if not isinstance(value, torch.Tensor):
            raise MemschedError(f"pipeline: stage boundaries must be tensors; device {rank}'s {name} is a "
                                f"{type(value).__name__}")
    input_args = example_in.detach().clone()
    if rank > 0:
        input_args.requires_grad_(True)  # else PipelineStage sends no gradient back: silently zero gradients
    output_args = example_out.detach().clone().requires_grad_(example_out.is_floating_point())

    modules = [module for _, module in pairs[first:last]]
    recomputes = device_recomputes(device_plan)
    if recomputes:
        stage_module = apply_plan(pairs[first:last], local_plan(plan, device_plan), fuse=False)
    else:
        stage_module = _Range(modules)
    stage = PipelineStage(stage_module, rank, world, where, input_args=input_args, output_args=output_args)
    del example_in, example_out, activation
    loss_fn, target = (None, None)
    if rank == world - 1:
        loss_fn, target = micro_loss(built.loss_fn, whole, pipe.micro_batches)
        loss_fn = report.around(loss_fn, "its loss", chunk=False)
        target = target.to(where)
    else:
        loss_fn = _unused_loss
    # What the rank computes, reported busy; the schedule's communication between them is a wait on its peers.
    stage.forward_one_chunk = report.around(stage.forward_one_chunk, "its stage's forward")
    stage.backward_one_chunk = report.around(stage.backward_one_chunk, "its stage's backward")
    schedule_type = Schedule1F1B if pipe.schedule == "1f1b" else ScheduleGPipe
    schedule = schedule_type(stage, pipe.micro_batches, loss_fn=loss_fn)
    synced = _sync_groups(synced_parameters(built, plan), rank)

    named = [(f"{pairs[first + k][0]}.{n}", p) for k, module in enumerate(modules)
             for n, p in module.named_parameters() if p.requires_grad]
    parameters = [p for _, p in named]
    optimizer = torch.optim.Adam(parameters, lr=lr) if lr is not None and parameters else None
    if optimizer is not None:  # its state exists before the first window, as in steady state
        for p in parameters:
            p.grad = torch.zeros_like(p)
        optimizer.step()

    report.doing("ready, waiting for its peers", False, milestone=True)
    losses, peaks, seconds, grads = [], [], [], None
    for step in range(1, steps + 1):
        report.step = step
        for p in parameters:
            p.grad = None
        stage.clear_runtime_states()  # what the engine kept of the last step: step() frees it first thing
        step_losses = []
        report.waiting()
        with meter(where) as window:
            start = window.current
            started = time.perf_counter()
            schedule.step(*((x,) if rank == 0 else ()), return_outputs=False,
                          **({"target": target, "losses": step_losses} if rank == world - 1 else {}))
            if synced:
                report.doing(f"step {step}: summing the gradients of shared parameters with its peers", False)
                _sum_gradients(synced)
            if where.type == "cuda":
                torch.cuda.synchronize(where)
            seconds.append(time.perf_counter() - started)
            peaks.append(window.peak - start)
        if step_losses:
            losses.append(float(torch.stack([l.detach() for l in step_losses]).mean()))
        del step_losses
        if grads is None and return_grads:
            grads = {name: p.grad.detach().cpu().clone() for name, p in named if p.grad is not None}
        if optimizer is not None:
            optimizer.step()
        report.send("step", step)

    input_bytes = input_args.numel() * input_args.element_size()
    output_bytes = output_args.numel() * output_args.element_size() if rank < world - 1 else 0
    m = pipe.micro_batches
    return RankResult(rank=rank, first=first, last=last, recomputes=recomputes, losses=losses, peaks=peaks,
                      seconds=seconds, predicted_peak=device_plan.peak_bytes,
                      predicted_resident=_resident(plan, rank, built), batch_bytes=m * input_bytes if rank == 0 else 0,
                      recv_buffer_bytes=m * ((input_bytes if rank > 0 else 0) + output_bytes), grads=grads)


def _unused_loss(output, target):  # the schedule wants a loss on every rank to run backwards; only the last uses it
    raise AssertionError("only the last stage computes the loss")


def _resident(plan, rank, built) -> int:
    """Device ``rank``'s resident state as planner/simulate/pipeline.py counts it: parameters, master copy and
    optimizer state of its stages (from the parameters' count, fp32 as in the chain)."""
    from planner.training_setup import TrainingSetup

    device = plan.pipeline.devices[rank]
    params = {id(p): p for _, module in built.stages[device.first:device.last] for p in module.parameters()
              if p.requires_grad}
    return TrainingSetup(**plan.pipeline.setup).resident_bytes(sum(p.numel() for p in params.values()))


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
