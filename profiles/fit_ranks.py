"""``fit`` on several ranks: one plan for all, models wrapped or sharded before it refused, a DDP rank's bytes.

Inside a ``torchrun`` job (a ``torch.distributed`` process group of several ranks) every rank calls ``fit`` on its
own part of the batch. :func:`one_plan` makes them run the same plan: each rank finds its own stages (its modules),
rank 0 alone profiles and solves, and its chain and plan reach every rank (so each rank's plan is rank 0's to the
byte, and a refusal on rank 0 is every rank's). :func:`refuse_wrapped` refuses a
model already wrapped in DDP or sharded by FSDP2, naming the order that works; :func:`refuse_resharded` a fitted
model sharded after ``fit``. :func:`ddp_memory` is a rank's bytes under the DDP that wraps the fitted model
(planner/simulate/ddp.py). docs/guide.md, "Several devices".
"""

import torch

from planner.errors import MemschedError
from planner.execute.torchrun import from_rank0
from planner.simulate import micro_batch_peaks
from planner.simulate.ddp import bucket_view_peak, ddp_rank
from planner.units import format_bytes

_WORKING_ORDER = ("fit the model itself, then wrap the fitted model: DDP(fit(model, batch, budget)); for sharded "
                  "parameters fit(model, batch, budget, setup=TrainingSetup(zero=3, dp=WORLD_SIZE))")


def ranks() -> tuple:
    """``(this rank, ranks)`` of the default process group; ``(0, 1)`` outside one."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return 0, 1
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def one_plan(solve):
    """``solve()``'s ``(chain, plan)`` on rank 0, the same on every rank (outside a process group of several
    ranks: ``solve()``). A refusal on rank 0 is raised on every rank (planner/execute/torchrun.py's
    :func:`from_rank0`)."""
    return solve() if ranks()[1] == 1 else from_rank0(solve, "fit")


def refuse_wrapped(model) -> None:
    """Refuse in one line a model ``fit`` cannot plan for: wrapped in DDP, or with parameters sharded by FSDP2."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        raise MemschedError(f"fit got a DistributedDataParallel: its reducer must see the plan's gradients; "
                            f"{_WORKING_ORDER}")
    if _sharded(model):
        raise MemschedError(f"fit got a model sharded by fully_shard (FSDP2): its stages are found on whole "
                            f"parameters; {_WORKING_ORDER}")


def refuse_resharded(model, plan) -> None:
    """Refuse in one line a fitted model whose modules were sharded by ``fully_shard`` after ``fit`` (a ``plan``
    for an unsharded step): the plan's stages hold the parameters as they were and would train nothing."""
    if not plan.setup.sharded and _sharded(model):
        raise MemschedError("the fitted model's modules were sharded by fully_shard after fit: the plan's stages "
                            "hold the whole parameters and would train nothing; fit shards them itself: "
                            "fit(model, batch, budget, setup=TrainingSetup(zero=3, dp=WORLD_SIZE))")


def _sharded(model) -> bool:
    """Whether ``fully_shard`` (FSDP2) sharded any of ``model``'s modules: it makes each one an ``FSDPModule``."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a build without FSDP2
        return False
    return any(isinstance(module, FSDPModule) for module in model.modules())


def parameter_homes(model, stages) -> list:
    """``[(stage, its name for a parameter, [(module of model, attribute)])]``: where ``model`` holds each parameter of
    the ``stages`` (``[(name, module)]``), found by identity, for :func:`adopt_sharded`."""
    homes = {}
    for module in model.modules():
        for attribute, parameter in module._parameters.items():
            if parameter is not None:
                homes.setdefault(id(parameter), []).append((module, attribute))
    return [(stage, name, homes.get(id(parameter), [])) for _, stage in stages
            for name, parameter in stage.named_parameters(remove_duplicate=False)]


def adopt_sharded(homes) -> None:
    """Make the model's modules hold the parameters ``fully_shard`` swapped into its stages (``homes``, taken by
    :func:`parameter_homes` before): the optimizer, the state dict and ``parameters()`` then see the sharded ones
    (DTensors), as on a model sharded by ``fully_shard``."""
    for stage, name, places in homes:
        parameter = stage.get_parameter(name)
        for module, attribute in places:
            module._parameters[attribute] = parameter


def refuse_sharded_eval(plan) -> None:
    """Refuse in one line to run a model fitted for a sharded step without gradients or in eval mode: between steps
    its modules hold only this rank's shards."""
    if plan.setup.sharded:
        raise MemschedError(f"a model fitted for {plan.setup.describe()} holds only this rank's shards between "
                            "steps and runs the plan's training step only: evaluate an unsharded copy (load its "
                            "full state dict: torch.distributed.checkpoint.state_dict.get_model_state_dict)")


def ddp_memory(chain, plan, settings, held: int):
    """A rank's :class:`planner.simulate.ddp.DDPRank` for ``plan`` on ``chain`` under a DDP of ``settings``
    (:class:`planner.execute.ddp.DDPSettings`), ``held`` bytes of the chain's last ``param_bytes`` held by the
    caller; a DDP hook memsched does not size is refused in one line."""
    if settings.hook is None:
        raise MemschedError(f"the DDP's communication hook {settings.hook_name} is not one memsched sizes (allreduce, "
                            "fp16 or bf16 compression, PowerSGD): its state and buffers are not in the prediction")
    peak = max(micro_batch_peaks(chain, plan))
    if settings.bucket_view and plan.accumulate == 1:
        peak = bucket_view_peak(chain, plan.schedule, held)
    return ddp_rank(peak, list(settings.gradients), settings.hook)


def ddp_line(settings, rank_bytes) -> str:
    """What a DDP adds to a rank and sends each step, in words; ``rank_bytes()``: the
    :class:`planner.simulate.ddp.DDPRank` (refused for a hook memsched does not size: said instead)."""
    try:
        rank = rank_bytes()
    except MemschedError as error:
        return f"DDP: {error}"
    kept = f"buckets {format_bytes(rank.buckets)}" + (
        f" and {settings.hook_name}'s state {format_bytes(rank.hook_state)}" if rank.hook_state else "")
    return (f"DDP: {kept} beside the parameters, the step's peak {format_bytes(rank.step_peak)}; all-reduces "
            f"{format_bytes(rank.sent)} a step ({format_bytes(rank.uncompressed)} uncompressed)")
