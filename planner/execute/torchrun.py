"""Running as one rank of a launch by torchrun (one node or several): ``memsched train --dp N`` and pipeline runs.

torchrun starts every rank itself and sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in its
environment (:func:`torchrun_world` reads them), with ``TORCHELASTIC_USE_AGENT_STORE``: a process a rank spawned
would inherit them and wait for a store that only torchrun's own workers reach. So under torchrun a run spawns
nothing (planner/execute/pipeline.py's :func:`launch_ranks` refuses to): :func:`torchrun_rank` joins this process
to the ranks' process group (``init_method="env://"``: gloo on CPU, NCCL on LOCAL_RANK's GPU), and
:meth:`TorchrunRank.run` runs the rank's job as a spawned rank runs it (pipeline_rank.py's :func:`run_rank`,
data_parallel.py's ``_rank_job``), every rank's result gathered to rank 0. A launch of other than the run's
ranks is refused in one line on every rank before any collective (:func:`check_torchrun_world`). No parent
watches the ranks' progress: a collective waits for the other ranks at most the run's progress timeout (the
group's timeout), and torchrun stops every rank when one fails. How: docs/execution.md ("Pipeline executor"),
docs/cli.md ("Under torchrun").
"""

import contextlib
import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from planner.errors import MemschedError
from planner.execute.pipeline_rank import STARTUP_TIMEOUT, Reporter, error_line

_SET_BY_TORCHRUN = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_COUNTS = ("RANK", "LOCAL_RANK", "WORLD_SIZE")  # any of them set: a rank some launcher started


def torchrun_world():
    """The number of ranks (WORLD_SIZE) when torchrun, or a launcher setting the same environment, started this
    process; None when none did. An environment with only some of the variables, or a count that is not one,
    is refused in one line."""
    given = [name for name in _COUNTS if name in os.environ]
    if not given:
        return None
    missing = [name for name in _SET_BY_TORCHRUN if not os.environ.get(name)]
    if missing:
        raise MemschedError(f"the environment sets {', '.join(given)} but not {', '.join(missing)}: start memsched "
                            f"with torchrun, which sets them all, or unset {', '.join(given)}")
    rank, _, world = (_count(name) for name in _COUNTS)
    if rank >= world:
        raise MemschedError(f"RANK={rank} is no rank of WORLD_SIZE={world} (ranks 0 to {world - 1}): start memsched "
                            "with torchrun, which sets them")
    return world


def _count(name: str) -> int:
    """The whole number >= 0 the environment variable ``name`` holds (WORLD_SIZE: >= 1), else one line."""
    text = os.environ[name]
    least = 1 if name == "WORLD_SIZE" else 0
    if not text.isdigit() or int(text) < least:
        raise MemschedError(f"{name} must be a whole number of at least {least}, got {text[:40]!r}: start memsched "
                            "with torchrun, which sets it")
    return int(text)


def check_torchrun_world(needed: int, what: str, fix: str) -> None:
    """Under torchrun, a launch of other than ``needed`` ranks refused in one line (before any collective: on every
    rank alike). ``what``: what runs on ``needed`` ranks; ``fix``: the change that makes the command run on
    torchrun's count, ``{world}`` standing for that count."""
    world = torchrun_world()
    if world is not None and world != needed:
        raise MemschedError(f"torchrun started {world} ranks (WORLD_SIZE={world}) but {what} runs on {needed}: "
                            f"{fix.format(world=world)}, or have torchrun start {needed} (--nnodes times "
                            "--nproc_per_node)")


def torchrun_rank(world: int, what: str, fix: str, device: str, timeout: float, label: str):
    """A context: under torchrun, this process as its rank (:class:`TorchrunRank`) of the ``world`` ranks' process
    group, joined on entry and left when the block ends (a launch of another count refused first:
    :func:`check_torchrun_world` with ``what`` and ``fix``); None when torchrun did not start it (the run spawns
    its ranks). ``device``: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL, LOCAL_RANK's GPU); ``timeout``: seconds a
    collective waits for the other ranks (at least ``STARTUP_TIMEOUT``: they start at their own pace);
    ``label`` names the run in errors."""
    check_torchrun_world(world, what, fix)
    if torchrun_world() is None:
        return contextlib.nullcontext()
    return _joined(device, max(timeout, STARTUP_TIMEOUT), label)


@contextlib.contextmanager
def _joined(device: str, timeout: float, label: str):
    """This process in torchrun's process group (its device set first) while the block runs: a TorchrunRank."""
    rank, local, world = (int(os.environ[name]) for name in _COUNTS)
    if device == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if local >= count:
            raise MemschedError(f"torchrun's rank {rank} has LOCAL_RANK={local} but this node has {count} CUDA "
                                f"devices: start at most {count} ranks per node (--nproc_per_node), one GPU each")
        torch.cuda.set_device(local)
    where = torch.device("cuda", local) if device == "cuda" else torch.device("cpu")
    with _failing_as(label, rank):
        dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method="env://",
                                timeout=datetime.timedelta(seconds=timeout))
    try:
        yield TorchrunRank(rank, world, where, label)
    finally:  # also after a failure: a group still joined aborts the interpreter's exit (its threads left running)
        dist.destroy_process_group()


@contextlib.contextmanager
def _failing_as(label: str, rank: int):
    """An error inside, one line naming the rank (a MemschedError's message kept, else its type and message)."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - a rank's failure, as one line
        raise MemschedError(f"{label} rank {rank} failed: {error_line(exc)}") from None


def from_rank0(compute, label: str):
    """``compute()`` on rank 0 of the default process group, its value (picklable) on every rank. An error of rank
    0's is raised on every rank, so that none waits for what rank 0 will not send: as it is on rank 0, as one line
    naming rank 0 elsewhere (``label`` names the run)."""
    rank = dist.get_rank()
    if rank == 0:
        try:
            value = compute()
        except Exception as exc:  # noqa: BLE001 - told to the other ranks, then raised here
            _broadcast([(None, error_line(exc))], label, rank)
            raise
        _broadcast([(value, None)], label, rank)
        return value
    sent = [None]
    _broadcast(sent, label, rank)
    value, error = sent[0]
    if error is not None:
        raise MemschedError(f"{label} rank 0 failed: {error}")
    return value


def _broadcast(objects: list, label: str, rank: int) -> None:
    with _failing_as(label, rank):
        dist.broadcast_object_list(objects, src=0)


class _Unwatched(Reporter):
    """A rank's progress reports when no parent reads them (torchrun watches its workers itself): dropped."""

    def __init__(self):
        super().__init__(connection=None)

    def send(self, *message) -> None:
        pass


@dataclass(frozen=True)
class TorchrunRank:
    """This process as rank ``rank`` of the ``world`` ranks torchrun started, in their process group, on ``where``
    (the CPU, or the GPU LOCAL_RANK numbers); ``label`` names the run in errors."""

    rank: int
    world: int
    where: torch.device
    label: str

    def from_rank0(self, compute):
        """``compute()`` on rank 0, its value on every rank (:func:`from_rank0`)."""
        return from_rank0(compute, self.label)

    def run(self, job, world: int):
        """``job(rank, world, where, report)`` (a spawned rank's job) in this process, its progress reports dropped:
        on rank 0 every rank's result in rank order, None on the others. ``world``: the ranks the run needs (the
        launch's, else one line); a failure is one line naming this rank."""
        if world != self.world:
            raise MemschedError(f"the {self.label} run needs {world} ranks but torchrun started {self.world} "
                                f"(WORLD_SIZE): start {world}")
        with _failing_as(self.label, self.rank):
            result = job(self.rank, self.world, self.where, _Unwatched())
            gathered = [None] * self.world if self.rank == 0 else None
            dist.gather_object(result, gathered, dst=0)
        return gathered
