"""What one rank of a pipeline run does (planner/execute/pipeline.py launches it): a process of its own.

:func:`rank_worker` joins the process group, builds the model and its stages ``[first, last)`` as one
``PipelineStage``, runs the plan's schedule for the steps, measures each step's peak and reports its progress to
the parent through a pipe (:class:`Reporter`); it dies with the parent (:func:`die_with_parent`). The model
checks both sides run (:func:`check_model`, :func:`synced_parameters`) and :class:`RankResult`, what a rank
returns, are here too. How a rank measures and sums shared gradients: docs/execution.md ("Pipeline executor").
"""

import ctypes
import datetime
import os
import signal
import sys
import threading
import time
import traceback
import types
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from planner.errors import MemschedError
from planner.execute.chain import apply_schedule
from planner.execute.records import find_shared
from planner.execute.stages import preserved_state, run_stages, trainable_parameters
from planner.ops import FORWARD_OPS
from planner.plan import Plan
from planner.setup.training import TrainingSetup
from planner.simulate.pipeline import to_local

STARTUP_TIMEOUT = 120.0  # seconds a rank may take to start (a fresh interpreter importing torch) if longer
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


def device_recomputes(device) -> bool:
    """True when a device's schedule is not store-all (some stage forwarded more than once, or not with F_all)."""
    forwards = [op for op in device.schedule if op.kind in FORWARD_OPS]
    return len(forwards) != device.last - device.first or any(op.kind != "F_all" for op in forwards)


def batch_of(built) -> int:
    """The batch: the first dimension of the model's first input (a tensor)."""
    first = built.example_inputs[0]
    if not isinstance(first, torch.Tensor) or first.dim() == 0:
        raise MemschedError("a pipeline splits the model's first input along its first dimension: it must be a tensor")
    return first.shape[0]


def check_model(built, plan: Plan) -> int:
    """The micro-batch size, once ``built`` is checked against ``plan`` (one input, the stages, the batch, the
    loss's target, the shared parameters); else one line."""
    if len(built.example_inputs) != 1:
        raise MemschedError("pipeline: models with extra inputs beside the first are not supported")
    pipe = plan.pipeline
    if pipe.devices[-1].last != len(built.stages):
        raise MemschedError(f"the pipeline plan covers {pipe.devices[-1].last} stages but the model has "
                            f"{len(built.stages)}; partition a chain of this model")
    micro = check_batch(batch_of(built), pipe.micro_batches)
    _target_cell(built.loss_fn, batch_of(built), pipe.micro_batches)
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


# --------------------------------------------------------------------------------------------------
# The rank's process


def die_with_parent(parent: int) -> None:
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


class Reporter:
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


# NOTE [pipelining import]
# ``torch.distributed.pipelining`` is imported in the rank only, and before its first report: the parent, which
# imports this module, then refuses a torch build without ``torch.distributed`` in one line (run_pipeline)
# instead of failing on the import, and the rank's import time counts as its start (held to the startup
# timeout, not to the progress timeout).
def rank_worker(rank, world, port, folder, connection, parent, device, progress_timeout, job, threads=1) -> None:
    """The rank's process: join the process group, ``job(rank, world, where, report)`` (:func:`run_rank` for a
    pipeline) on ``threads`` torch threads, save its result in ``folder``; any failure reported in one line."""
    die_with_parent(parent)
    report = Reporter(connection)
    try:
        import torch.distributed.pipelining  # noqa: F401 - NOTE [pipelining import]

        report.doing("joining the process group", False, milestone=True)
        torch.set_num_threads(threads)
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
        if device == "cuda":
            torch.cuda.set_device(rank)
            where = torch.device("cuda", rank)
        else:
            where = torch.device("cpu")
        # The backend's own timeout is beyond the parent's (the rendezvous waits for the slowest start): the
        # parent's message comes first.
        dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=max(progress_timeout, STARTUP_TIMEOUT) + 60))
        result = job(rank, world, where, report)
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
        message = error_line(exc)
        lost_peer = isinstance(exc, torch.distributed.DistNetworkError) or any(text in message.lower()
                                                                                for text in _PEER_LOST)
        report.send("error", time.time(), message, lost_peer)
        os._exit(1)


def error_line(exc: BaseException) -> str:
    """What a rank says of its failure: ``exc`` in one line of at most 500 characters, its type named unless it is a
    :class:`MemschedError`; its traceback is printed to stderr first when MEMSCHED_PIPELINE_TRACEBACK is set."""
    if os.environ.get("MEMSCHED_PIPELINE_TRACEBACK"):
        traceback.print_exception(exc)
    text = str(exc) if isinstance(exc, MemschedError) else f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())[:500]


class _Range(torch.nn.Module):
    """Stages ``[first, last)`` run one after another (store-all: autograd keeps what each stage saves)."""

    def __init__(self, modules):
        super().__init__()
        self.stages = torch.nn.ModuleList(modules)

    def forward(self, x):
        return run_stages(enumerate(self.stages), (x,))


def run_rank(rank, world, where, report, *, model, plan, steps, meter, lr, return_grads, seed) -> RankResult:
    """Build this rank's stage and schedule, then run and measure ``steps`` steps."""
    report.doing("building its stage", True, milestone=True)
    torch.manual_seed(seed)
    built = model()
    micro = check_model(built, plan)
    device_plan = plan.pipeline.devices[rank]
    pairs = list(built.stages)
    x = built.example_inputs[0].to(where)
    input_args, output_args = _boundaries(pairs, x, micro, device_plan, rank, where)
    stage, recomputes = _stage(pairs, device_plan, rank, world, where, input_args, output_args)
    schedule, target = _schedule(stage, built, plan, rank, world, where, report)
    synced = _sync_groups(synced_parameters(built, plan), rank)
    named, optimizer = _optimizer(pairs, device_plan, lr)
    report.doing("ready, waiting for its peers", False, milestone=True)
    losses, peaks, seconds, grads = _measure(schedule, stage, named, optimizer, synced, x, target, steps, meter,
                                             where, rank, world, return_grads, report)
    input_bytes = input_args.numel() * input_args.element_size()
    output_bytes = output_args.numel() * output_args.element_size() if rank < world - 1 else 0
    m = plan.pipeline.micro_batches
    return RankResult(rank=rank, first=device_plan.first, last=device_plan.last, recomputes=recomputes, losses=losses,
                      peaks=peaks, seconds=seconds, predicted_peak=device_plan.peak_bytes,
                      predicted_resident=_resident(plan, rank, built), batch_bytes=m * input_bytes if rank == 0 else 0,
                      recv_buffer_bytes=m * ((input_bytes if rank > 0 else 0) + output_bytes), grads=grads)


def _boundaries(pairs, x, micro: int, device_plan, rank: int, where) -> tuple:
    """``(input_args, output_args)``: example tensors of one micro-batch at this rank's boundaries (the stages
    moved to ``where`` first), computed without gradients or lasting effects."""
    first, last = device_plan.first, device_plan.last
    for _, module in pairs:
        module.to(where)
    with torch.no_grad(), preserved_state([m for _, m in pairs], where):
        example_in = run_stages(pairs[:first], (x[:micro],))
        example_out = run_stages(pairs[first:last], (example_in,))
    for name, value in (("input", example_in), ("output", example_out)):
        if not isinstance(value, torch.Tensor):
            raise MemschedError(f"pipeline: stage boundaries must be tensors; device {rank}'s {name} is a "
                                f"{type(value).__name__}")
    input_args = example_in.detach().clone()
    if rank > 0:
        input_args.requires_grad_(True)  # else PipelineStage sends no gradient back: silently zero gradients
    output_args = example_out.detach().clone().requires_grad_(example_out.is_floating_point())
    return input_args, output_args


def _stage(pairs, device_plan, rank: int, world: int, where, input_args, output_args) -> tuple:
    """``(PipelineStage, recomputes)``: the plain stages for a store-all schedule, else the chain executor running
    the device's schedule in local stage indices."""
    from torch.distributed.pipelining import PipelineStage  # NOTE [pipelining import]

    first, last = device_plan.first, device_plan.last
    recomputes = device_recomputes(device_plan)
    if recomputes:
        stage_module = apply_schedule(pairs[first:last], to_local(device_plan.schedule, first), fuse=False)
    else:
        stage_module = _Range([module for _, module in pairs[first:last]])
    return PipelineStage(stage_module, rank, world, where, input_args=input_args, output_args=output_args), recomputes


def _schedule(stage, built, plan: Plan, rank: int, world: int, where, report) -> tuple:
    """``(schedule, target)``: 1F1B or GPipe over the plan's micro-batches, the loss (and its whole target) on the
    last rank; the stage's forward and backward reported busy, the communication between them a wait."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe  # NOTE [pipelining import]

    pipe = plan.pipeline
    target = None
    if rank == world - 1:
        loss_fn, target = micro_loss(built.loss_fn, batch_of(built), pipe.micro_batches)
        loss_fn = report.around(loss_fn, "its loss", chunk=False)
        target = target.to(where)
    else:
        loss_fn = _unused_loss
    stage.forward_one_chunk = report.around(stage.forward_one_chunk, "its stage's forward")
    stage.backward_one_chunk = report.around(stage.backward_one_chunk, "its stage's backward")
    schedule_type = Schedule1F1B if pipe.schedule == "1f1b" else ScheduleGPipe
    return schedule_type(stage, pipe.micro_batches, loss_fn=loss_fn), target


def _optimizer(pairs, device_plan, lr) -> tuple:
    """``(named parameters, optimizer)`` of this rank's stages; the optimizer (None without ``lr``) has its state
    before the first window, as in steady state."""
    first = device_plan.first
    named = [(f"{pairs[first + k][0]}.{n}", p) for k, (_, module) in enumerate(pairs[first:device_plan.last])
             for n, p in module.named_parameters() if p.requires_grad]
    parameters = [p for _, p in named]
    optimizer = torch.optim.Adam(parameters, lr=lr) if lr is not None and parameters else None
    if optimizer is not None:
        for p in parameters:
            p.grad = torch.zeros_like(p)
        optimizer.step()
    return named, optimizer


def _measure(schedule, stage, named, optimizer, synced, x, target, steps: int, meter, where, rank: int, world: int,
             return_grads: bool, report) -> tuple:
    """``(losses, peaks, seconds, grads)`` over ``steps`` steps, each measured in a window opened with the
    gradients ``None`` and the stage's runtime state cleared (docs/execution.md, "Pipeline executor")."""
    parameters = [p for _, p in named]
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
            losses.append(float(torch.stack([loss.detach() for loss in step_losses]).mean()))
        del step_losses
        if grads is None and return_grads:
            grads = {name: p.grad.detach().cpu().clone() for name, p in named if p.grad is not None}
        if optimizer is not None:
            optimizer.step()
        report.send("step", step)
    return losses, peaks, seconds, grads


def _unused_loss(output, target):  # the schedule wants a loss on every rank to run backwards; only the last uses it
    raise AssertionError("only the last stage computes the loss")


def _resident(plan, rank, built) -> int:
    """Device ``rank``'s resident state as planner/simulate/pipeline.py counts it: parameters, master copy and
    optimizer state of its stages (from the parameters' count, fp32 as in the chain)."""
    device = plan.pipeline.devices[rank]
    parameters = trainable_parameters(built.stages[device.first:device.last])
    return TrainingSetup(**plan.pipeline.setup).resident_bytes(sum(p.numel() for p in parameters))


def _sync_groups(synced, rank: int) -> list:
    """``[(parameter, process group), ...]`` of this rank's copies to sum; every rank creates every group, in the
    same order (``new_group`` is collective)."""
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
