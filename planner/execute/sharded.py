"""The chain executor on FSDP2: each stage a ``fully_shard`` unit, a chain plan run on every rank's batch.

:func:`shard_stages` shards each stage module over the data-parallel ranks with PyTorch's own ``fully_shard``,
each stage its own root (its collectives run at its own operations, none prefetched), parameters shared by
stages left whole (``ignored_params``; :func:`average_gradients` averages their gradients across ranks).
planner/sharding.py models their bytes from the chain's parameter layout. :class:`ShardedStepRun`
runs a chain schedule on the sharded stages: ZeRO 3 all-gathers a stage at each of its operations and frees it after
(``reshard_after_forward=True``); ZeRO 2 all-gathers every stage when the step starts and frees them when it
ends. A stage's backward lets autograd accumulate its parameters' gradients so that FSDP2's post-backward finds
them and reduce-scatters them into the sharded parameters' ``.grad``; those of the parameters kept whole are
averaged once the backward is done. :func:`check_sharded_run` refuses a sharded plan outside its ranks.
"""

import warnings
import weakref

import torch

from planner.errors import MemschedError
from planner.execute.autograd import differentiate
from planner.execute.records import find_shared
from planner.execute.steprun import StepRun
from planner.sharding import check_sharding


def shared_parameters_of(pairs) -> list:
    """The parameters (needing gradients) that several of the stages ``[(name, module), ...]`` read."""
    return [parameter for _, parameter in find_shared(pairs)]


# NOTE [collective buffers]
# gloo runs a collective on a worker thread, which drops its reference to the collective's tensors a moment
# after it has woken the caller: a buffer FSDP2 has finished with (the all-gather output, once copied into the
# parameters; the reduce-scatter input, once reduced) then lives on into the stage's computation or not, by
# chance (measured: a whole stage's parameters, at random backwards). The run frees them itself instead, once
# FSDP2 is done with them: their storages are resized to nothing (what gloo still holds is then empty).
_BUFFERS = weakref.WeakKeyDictionary()  # sharded module -> its _CollectiveBuffers (CPU only)


class _CollectiveBuffers:
    """FSDP2 comms for one stage (``set_custom_all_gather`` / ``set_custom_reduce_scatter``: PyTorch's collectives,
    as FSDP2's defaults call them) that keep the all-gather outputs and reduce-scatter inputs since last freed."""

    def __init__(self):
        self.gathered, self.reduced = [], []
        self.gather, self.reduce = _Gather(self.gathered), _ReduceScatter(self.reduced)

    @staticmethod
    def free(buffers) -> None:
        while buffers:
            buffers.pop().untyped_storage().resize_(0)


class _Gather:
    """FSDP2's all-gather comm: ``allocate`` its output, then all-gather into it."""

    def __init__(self, outputs):
        self.outputs = outputs

    def allocate(self, size, *, dtype, device):
        output = torch.empty(size, dtype=dtype, device=device)
        self.outputs.append(output)
        return output

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        return torch.distributed.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


class _ReduceScatter:
    """FSDP2's reduce-scatter comm: ``allocate`` its buffers, then reduce-scatter an input into an output."""

    def __init__(self, inputs):
        self.inputs = inputs

    def allocate(self, size, *, dtype, device):
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.inputs.append(input_tensor)
        return torch.distributed.reduce_scatter_single(output_tensor, input_tensor, op=op, group=group,
                                                       async_op=async_op)


def shard_stages(pairs, zero: int, dp: int, mesh=None) -> None:
    """``fully_shard`` each stage ``(name, module)`` with parameters (in place) for ZeRO ``zero`` (2 or 3) over
    ``mesh`` (default: the world of ``dp`` ranks); shared parameters stay whole."""
    from torch.distributed.fsdp import fully_shard

    check_sharding(zero, dp)
    # ShardedStepRun all-gathers each stage before its backward itself: FSDP2's pre-backward hook, which a view
    # returned by a stage can lose (FSDP2 warns), is not relied on.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    if zero == 1:
        raise MemschedError("ZeRO 1 shards no stage: it runs with ZeroRedundancyOptimizer "
                            "(planner/execute/data_parallel.py)")
    shared = set(shared_parameters_of(pairs))
    for _, module in pairs:
        if isinstance(module, torch.nn.Module) and any(p not in shared for p in module.parameters()):
            fully_shard(module, mesh=mesh, reshard_after_forward=zero == 3,
                        ignored_params={p for p in module.parameters() if p in shared})
            if zero == 2:  # whole for the step: resharded by ShardedStepRun.finish
                module.set_reshard_after_backward(False)
            if next(module.parameters()).device.type == "cpu":  # NOTE [collective buffers]
                buffers = _BUFFERS[module] = _CollectiveBuffers()
                module.set_custom_all_gather(buffers.gather)
                module.set_custom_reduce_scatter(buffers.reduce)


def check_sharded_run(setup) -> None:
    """Refuse in one line to run a plan for one rank's sharded step (``setup``: ZeRO ``zero`` over ``dp`` ranks)
    outside a process group of ``dp`` ranks, and ZeRO 1, which shards no stage."""
    dist = torch.distributed
    ranks = dist.get_world_size() if dist.is_available() and dist.is_initialized() else None
    if ranks != setup.dp:
        where = "outside a process group" if ranks is None else f"in a process group of {ranks} ranks"
        raise MemschedError(f"the plan is for one rank's step of {setup.describe()}, run {where}: start "
                            f"{setup.dp} ranks (torchrun --nproc_per_node {setup.dp}, or memsched train SPEC --dp "
                            f"{setup.dp} --zero {setup.zero} --plan PLAN.json)")
    if setup.zero == 1:
        raise MemschedError("ZeRO 1 shards no stage, only the optimizer's state: train the fitted model in "
                            "DistributedDataParallel with torch.distributed.optim.ZeroRedundancyOptimizer")


def average_gradients(parameters) -> None:
    """Average the gradients of the whole (unsharded) ``parameters`` across the ranks, in place, as FSDP2
    averages the sharded ones: every rank then holds the whole batch's gradient."""
    for parameter in parameters:
        if parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)
        torch.distributed.all_reduce(parameter.grad, op=torch.distributed.ReduceOp.AVG)


class ShardedStepRun(StepRun):
    """One step on stages sharded by :func:`shard_stages` for ZeRO ``planned.zero``."""

    def __init__(self, planned, first, extra):
        super().__init__(planned, first, extra)
        self.sharded = [m for m in planned.modules_in_order if hasattr(m, "unshard")]
        # the parameters several stages read, kept whole on every rank: averaged here once the backward is done
        self.whole = list({id(p): p for m in planned.modules_in_order for p in m.parameters()
                           if id(p) in planned.first_readers}.values())
        if planned.zero == 2:
            for module in self.sharded:
                self._unshard(module)

    def _forward(self, op, position) -> None:
        super()._forward(op, position)
        module = self.planned.modules_in_order[op.stage]
        if module in _BUFFERS:
            _CollectiveBuffers.free(_BUFFERS[module].gathered)
        if self.planned.zero == 3 and hasattr(module, "reshard"):
            module.reshard()  # FSDP2 keeps a forward run inside a backward unsharded: ZeRO 3 frees it here

    def before_backward(self, i) -> None:
        module = self.planned.modules_in_order[i]
        if hasattr(module, "unshard"):
            self._unshard(module)  # its parameters are the whole ones until its post-backward

    def after_backward(self, i) -> None:
        module = self.planned.modules_in_order[i]
        if module in _BUFFERS:
            _CollectiveBuffers.free(_BUFFERS[module].reduced)

    @staticmethod
    def _unshard(module) -> None:
        module.unshard()
        if module in _BUFFERS:
            _CollectiveBuffers.free(_BUFFERS[module].gathered)

    def gradient_inputs(self, graph, parameters) -> list:
        """The parameters as they are now: the whole ones (plain tensors) of the unsharded stages."""
        return [p for k in graph.stages for p in self.planned.modules_in_order[k].parameters() if p.requires_grad]

    def differentiate_stage(self, pairs, targets, inputs, parameters) -> list:
        if pairs and inputs:
            differentiate(pairs, inputs, accumulate=True)
        grads = []
        for target in targets:
            grads.append(target.grad)
            target.grad = None
        return grads

    def finish(self) -> None:
        average_gradients(self.whole)
        if self.planned.zero == 2:
            for module in self.sharded:
                module.reshard()

    def abandon(self) -> None:
        self.finish()
