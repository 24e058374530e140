"""The pipeline executor: runs a plan of kind ``pipeline`` on ``torch.distributed.pipelining``.

:func:`run_pipeline` launches one process per device of the plan (``torch.multiprocessing``, spawn; gloo on
CPU, NCCL on CUDA with one GPU per rank), rendezvous on a free TCP port of localhost chosen at launch. Each
rank builds the model (same seed, so the same parameters), takes its stages ``[first, last)`` as one module
(the plain stages for a store-all schedule; :func:`planner.executor.apply_plan` with the device's own
schedule, in local stage indices, when it recomputes), wraps it in a static-shape ``PipelineStage`` (example
input and output of one micro-batch; later stages' inputs ``requires_grad``) and runs ``Schedule1F1B`` or
``ScheduleGPipe`` with the plan's micro-batches over the batch. The last rank computes the loss of each
micro-batch: the model's ``loss_fn`` with its batch-sized target tensor (the one tensor its closure holds
whose first dimension is a multiple of the batch) replaced by the micro-batch's slice. The schedule scales
the gradients by ``1 / m`` (``scale_grads``), so with a mean-reduced loss they equal single-process
gradients of the whole batch.

Measured per rank and step: the activation peak, the live-memory tracker
(:class:`profiles.memory.LiveMemoryTracker`) on CPU or ``max_memory_allocated`` minus the level at entry on
CUDA, around ``schedule.step`` with the parameter gradients ``None`` and the stage's runtime state cleared
before (what it kept of the previous step, which ``step`` itself frees first), so the gradients are allocated
inside it and nothing is freed below the starting level. It is compared with the plan's device peak less what existed before the window: the
resident parameters and optimizer state, and the step's buffers (planner/pipeline_simulator.py): the batch
(rank 0) or ``PipelineStage``'s receive buffers (``m`` activations on every rank but the first, ``m``
gradients on every rank but the last), allocated at the first step and kept. The measurement is of the last
step (the first also allocates the receive buffers). :class:`RankResult` reports these byte counts beside
the measured peak.

Failures are one line (:class:`planner.errors.MemschedError`): a batch that does not split into the
micro-batches, a plan that cannot run (1F1B with fewer micro-batches than devices), and a rank that dies
(which rank, and its error); the other ranks are then terminated, and every child is joined.
"""

import os
import socket
import tempfile
import time
import traceback
import types
from dataclasses import dataclass
from pathlib import Path

import torch

from planner.errors import MemschedError
from planner.plan import FORWARD_OPS, Plan, Predicted

DEFAULT_TIMEOUT = 300.0  # seconds for the whole run


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
    """A chain plan for one device's sub-chain: its schedule in local stage indices (planner.executor.apply_plan)."""
    from planner.pipeline_simulator import to_local

    return Plan(problem_name=f"{plan.problem_name}[{device.first}:{device.last}]", fingerprint="", solver="partition",
                budget_bytes=device.peak_bytes, predicted=Predicted(peak_bytes=device.peak_bytes, time=device.time,
                                                                     baseline_time=device.time),
                schedule=to_local(device.schedule, device.first))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_pipeline(model, plan: Plan, steps: int = 1, *, meter, device: str = "cpu", lr: float = None,
                 timeout: float = DEFAULT_TIMEOUT, chain=None, return_grads: bool = False, seed: int = 0) -> list:
    """Train ``steps`` steps by a pipeline ``plan`` on one process per device; return a :class:`RankResult` per rank.

    ``model``: a picklable function returning the model (a :class:`profiles.zoo.ChainModel`: stages, example
    inputs of the whole batch, which the plan's micro-batches split, and loss), e.g. ``functools.partial(
    profiles.spec.built_model, spec, batch=N)``; ``meter(device)``: the memory meter each rank measures with
    (``profiles.memory.memory_meter``), passed in so that the executor imports nothing from profiles. ``lr``: Adam steps
    after each step (none when None: every step then runs on the same parameters). ``chain``: when given, the
    plan must have been solved for it. ``return_grads``: each rank's parameter gradients of the first step.
    """
    check_pipeline_plan(plan)
    if chain is not None:
        from planner.plan import check_pipeline_plan_matches

        check_pipeline_plan_matches(plan, chain)
    if device not in ("cpu", "cuda"):
        raise MemschedError(f"--device must be cpu or cuda, got {device!r}")
    world = len(plan.pipeline.devices)
    if device == "cuda" and (not torch.cuda.is_available() or torch.cuda.device_count() < world):
        raise MemschedError(f"the plan needs {world} CUDA devices, "
                            f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} are available")
    if not torch.distributed.is_available():
        raise MemschedError("torch.distributed is not available in this PyTorch build: a pipeline cannot run")
    # Refuse a bad batch here, before any process starts (the workers check again on the built model).
    built = model()
    _check_model(built, plan)
    del built
    return _launch(model, plan, steps, meter, device, lr, timeout, return_grads, seed, world)


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
    return micro


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


def _launch(model, plan, steps, meter, device, lr, timeout, return_grads, seed, world) -> list:
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="memsched-pipeline-") as folder:
        processes = [context.Process(target=_worker, daemon=True,
                                     args=(rank, world, port, folder, model, plan, steps, meter, device, lr, timeout,
                                           return_grads, seed))
                     for rank in range(world)]
        for process in processes:
            process.start()
        try:
            _wait(processes, folder, timeout)
        finally:
            for process in processes:
                if process.is_alive():
                    process.terminate()
            for process in processes:
                process.join(5)
                if process.is_alive():
                    process.kill()
                    process.join()
        return [torch.load(Path(folder) / f"rank{rank}.pt", weights_only=False) for rank in range(world)]


def _wait(processes, folder, timeout) -> None:
    """Until every rank has exited cleanly; the first failure (by time) as one line."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.exitcode for p in processes]
        if all(code == 0 for code in codes):
            return
        if any(code not in (None, 0) for code in codes):
            # Give the others a moment to record their own errors: the first to fail is the cause.
            grace = time.monotonic() + 2.0
            while time.monotonic() < grace and any(p.exitcode is None for p in processes):
                time.sleep(0.05)
            raise MemschedError(_first_failure(processes, folder))
        if time.monotonic() > deadline:
            alive = [rank for rank, p in enumerate(processes) if p.exitcode is None]
            raise MemschedError(f"pipeline run timed out after {timeout:g} s (ranks {alive} still running)")
        time.sleep(0.05)


def _first_failure(processes, folder) -> str:
    errors = []
    for rank, process in enumerate(processes):
        path = Path(folder) / f"rank{rank}.err"
        if path.exists():
            stamp, _, message = path.read_text().partition("\n")
            errors.append((float(stamp), rank, message))
    if errors:
        _, rank, message = min(errors)
        return f"pipeline rank {rank} failed: {message}"
    rank, code = next((r, p.exitcode) for r, p in enumerate(processes) if p.exitcode not in (None, 0))
    why = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
    return f"pipeline rank {rank} died ({why}) without reporting an error"


def _worker(rank, world, port, folder, model, plan, steps, meter, device, lr, timeout, return_grads, seed) -> None:
    import datetime

    import torch.distributed as dist

    try:
        torch.set_num_threads(1)
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
        if device == "cuda":
            torch.cuda.set_device(rank)
            where = torch.device("cuda", rank)
        else:
            where = torch.device("cpu")
        dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout))
        try:
            result = _run_rank(rank, world, model, plan, steps, meter, where, lr, return_grads, seed)
            torch.save(result, Path(folder) / f"rank{rank}.pt")
            dist.barrier()
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent as one line
        message = " ".join(f"{type(exc).__name__}: {exc}".split()) if not isinstance(exc, MemschedError) \
            else " ".join(str(exc).split())
        if os.environ.get("MEMSCHED_PIPELINE_TRACEBACK"):
            traceback.print_exc()
        (Path(folder) / f"rank{rank}.err").write_text(f"{time.time()}\n{message[:500]}")
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


def _run_rank(rank, world, model, plan, steps, meter, where, lr, return_grads, seed) -> RankResult:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from planner.executor import apply_plan
    from planner.stages import preserved_state

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
        target = target.to(where)
    else:
        loss_fn = _unused_loss
    schedule_type = Schedule1F1B if pipe.schedule == "1f1b" else ScheduleGPipe
    schedule = schedule_type(stage, pipe.micro_batches, loss_fn=loss_fn)

    named = [(f"{pairs[first + k][0]}.{n}", p) for k, module in enumerate(modules)
             for n, p in module.named_parameters() if p.requires_grad]
    parameters = [p for _, p in named]
    optimizer = torch.optim.Adam(parameters, lr=lr) if lr is not None and parameters else None
    if optimizer is not None:  # its state exists before the first window, as in steady state
        for p in parameters:
            p.grad = torch.zeros_like(p)
        optimizer.step()

    losses, peaks, seconds, grads = [], [], [], None
    for _ in range(steps):
        for p in parameters:
            p.grad = None
        stage.clear_runtime_states()  # what the engine kept of the last step: step() frees it first thing
        step_losses = []
        with meter(where) as window:
            start = window.current
            started = time.perf_counter()
            schedule.step(*((x,) if rank == 0 else ()), return_outputs=False,
                          **({"target": target, "losses": step_losses} if rank == world - 1 else {}))
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
    """Device ``rank``'s resident state as planner/pipeline_simulator.py counts it: parameters, master copy and
    optimizer state of its stages (from the parameters' count, fp32 as in the chain)."""
    from planner.step_memory import TrainingSetup

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
