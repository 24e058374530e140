"""The chain executor: runs a plan's schedule in a real training step, exactly, and nothing else.

``apply_plan(stages, plan)`` returns a drop-in module. Calling it runs the
plan's forward part (every operation before ``Loss``) and returns the last
stage's output with a ``grad_fn``; the caller computes the loss and calls
``backward()``, which runs the rest of the schedule (recomputations and
backwards) inside one custom ``autograd.Function``, in the plan's order.

What is held follows the simulator's model (planner/simulator.py):

* ``F_all i`` runs stage i under autograd on a fresh leaf sharing ``a_i``'s
  storage and keeps its graph (``ā_{i+1}``), whose output is ``a_{i+1}``;
* ``F_ck i`` / ``F_none i`` run it under ``torch.no_grad()``; ``F_none`` then
  drops ``a_i`` (never the input);
* ``B i`` differentiates stage i's graph with the incoming gradient
  ``δ_{i+1}``, accumulates the parameter gradients into ``.grad`` as autograd
  does, keeps ``δ_i``, and drops the graph, ``δ_{i+1}`` and a standalone ``a_i``.

Recomputed forwards replay the random numbers of the stage's first forward
(CPU and CUDA generators, as ``torch.utils.checkpoint`` does) and its autocast
state, and leave buffers such as BatchNorm's running statistics as the first
forward left them. Stage ``k`` is called ``module(a_k, *extra)`` as in the
profiler; outputs may be tensors or tuples/dicts of tensors. Hold no
reference to the returned output across ``backward()`` (write
``loss_fn(model(x)).backward()``): the plan releases it when the schedule says.
"""

import contextlib

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from planner.errors import MemschedError
from planner.plan import FORWARD_OPS, Plan, check_plan_matches


def apply_plan(stages, plan: Plan, chain=None) -> "PlannedChain":
    """A module running ``stages`` by ``plan``; with ``chain`` the plan's fingerprint and stage names are checked."""
    from profiles.chain_profiler import named_stages

    pairs = named_stages(stages)
    planned = 1 + max(op.stage for op in plan.schedule if op.stage is not None)
    if planned != len(pairs):
        raise MemschedError(f"the plan schedules {planned} stages but {len(pairs)} were given; "
                            f"solve again for this model")
    if chain is not None:
        check_plan_matches(plan, chain)
        names = [name for name, _ in pairs]
        if names != [stage.name for stage in chain.stages]:
            raise MemschedError(f"the stages are named {names[:3]}… but the plan's chain has "
                                f"{[s.name for s in chain.stages][:3]}…; apply the plan to the model it was solved for")
    return PlannedChain(pairs, plan)


class PlannedChain(torch.nn.Module):
    """The stages, run by a plan. ``forward(a_0, *extra)`` returns the last stage's output."""

    def __init__(self, pairs, plan: Plan):
        super().__init__()
        self.stage_names = [name for name, _ in pairs]
        self.stages = torch.nn.ModuleList([module for _, module in pairs])
        self.plan = plan
        split = plan.schedule.index(next(op for op in plan.schedule if op.kind == "Loss"))
        self.forward_ops, self.backward_ops = plan.schedule[:split], plan.schedule[split + 1:]
        counts = {}
        for op in plan.schedule:
            if op.kind in FORWARD_OPS:
                counts[op.stage] = counts.get(op.stage, 0) + 1
        self.recomputed = {stage for stage, count in counts.items() if count > 1}

    def forward(self, first, *extra):
        if not torch.is_grad_enabled():  # inference: no schedule needed
            activation = first
            for module in self.stages:
                activation = module(activation, *extra)
            return activation
        run = _Run(self, first, extra)
        anchor = torch.empty(0, requires_grad=True)  # makes the output differentiable even when the input is data
        flat_inputs = [t for t in tree_flatten((first, extra))[0] if isinstance(t, torch.Tensor)]
        outputs = _Capture.apply(run, *_Schedule.apply(run, anchor, *flat_inputs))
        return tree_unflatten(list(outputs), run.output_spec)


class _Run:
    """The state of one step: what is held, by activation index (bytes follow planner/simulator.py)."""

    def __init__(self, planned: PlannedChain, first, extra):
        self.planned = planned
        self.extra = extra
        self.acts = {0: first}  # standalone activations a_i
        self.graphs = {}  # i -> (leaf input of stage i, its output): ā_{i+1}
        self.grads = {}  # i -> δ_i
        self.forwarded = set()  # stages whose first forward has run
        self.rng = {}  # stage -> generator states of its first forward (only for recomputed stages)
        self.autocast = _autocast_state()
        self.output_spec = None

    def activation(self, i):
        if i in self.acts:
            return self.acts[i]
        if i - 1 in self.graphs:
            return _detached(self.graphs[i - 1][1])
        raise MemschedError(f"the plan needs a_{i}, which is not in memory: the plan is invalid (check it with "
                            f"memsched show PLAN --chain CHAIN)")

    def forward_op(self, op) -> None:
        i, module = op.stage, self.planned.stages[op.stage]
        source = self.activation(i)
        with self._replay(i, module):
            if op.kind == "F_all":
                leaf = _leaf(source, requires_grad=i > 0 or _any_requires_grad(source))
                with torch.enable_grad():
                    self.graphs[i] = (leaf, module(leaf, *self.extra))
            else:
                with torch.no_grad():
                    self.acts[i + 1] = module(source, *self.extra)
        del source
        if op.kind == "F_none" and i > 0:
            self.acts.pop(i, None)

    def backward_op(self, i) -> None:
        leaf, output = self.graphs.pop(i)
        incoming = self.grads.pop(i + 1)
        module = self.planned.stages[i]
        outputs = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
        with torch.enable_grad():  # a custom Function's backward runs without grad mode
            roots = [_HandOver.apply(t, g).sum() for t, g in zip(outputs, incoming) if t.requires_grad and g is not None]
        del incoming  # from here autograd alone holds δ_{i+1}, and frees it once used, as in a plain backward
        targets = [t for t in tree_flatten(leaf)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        parameters = [p for p in module.parameters() if p.requires_grad]
        results = [None] * (len(targets) + len(parameters))
        if roots and targets + parameters:
            with torch.enable_grad():
                root = sum(roots)
            del roots
            results = list(torch.autograd.grad(root, targets + parameters, allow_unused=True))
            del root
        del output, outputs
        for parameter, grad in zip(parameters, results[len(targets):]):
            if grad is not None:  # as AccumulateGrad: take the first gradient, add later ones in place
                if parameter.grad is None:
                    parameter.grad = grad
                else:
                    parameter.grad += grad
        by_target = iter(results[:len(targets)])
        self.grads[i] = [next(by_target) if isinstance(t, torch.Tensor) and t.requires_grad else None
                         for t in tree_flatten(leaf)[0] if isinstance(t, torch.Tensor)]
        del leaf, results
        if i > 0:
            self.acts.pop(i, None)

    @contextlib.contextmanager
    def _replay(self, i, module):
        """The first forward records the random state; a recomputation replays it and keeps buffers as they were."""
        if i not in self.forwarded:
            self.forwarded.add(i)
            if i in self.planned.recomputed:
                self.rng[i] = _rng_state()
            yield
            return
        buffers = [(b, b.clone()) for b in module.buffers()]
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        with torch.random.fork_rng(devices=devices), _autocast(self.autocast):
            _set_rng_state(self.rng[i])
            yield
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)


class _HandOver(torch.autograd.Function):
    """Identity on a stage output whose backward hands on the gradient it was given, then forgets it."""

    @staticmethod
    def forward(ctx, tensor, grad):
        ctx.grad = grad
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, _):
        grad, ctx.grad = ctx.grad, None
        return grad, None


class _Capture(torch.autograd.Function):
    """Identity on the last output; its backward takes ``δ_L`` into the run and passes on placeholders.

    The gradients a custom Function's backward receives stay alive until it returns; taking ``δ_L`` here
    and running the schedule in the next node lets the schedule free ``δ_L`` after ``B L-1``, as planned.
    """

    @staticmethod
    def forward(ctx, run, *tensors):
        ctx.run = run
        ctx.mark_non_differentiable(*[t for t in tensors if not t.is_floating_point()])
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        ctx.run.grads[len(ctx.run.planned.stages)] = list(grads)
        del ctx.run
        return (None, *[None if g is None else torch.zeros((), dtype=g.dtype, device=g.device).expand(g.shape)
                        for g in grads])


class _Schedule(torch.autograd.Function):
    """Forward: the plan's operations before ``Loss``. Backward: the operations after it."""

    @staticmethod
    def forward(ctx, run, anchor, *flat_inputs):
        for op in run.planned.forward_ops:
            run.forward_op(op)
        last = run.activation(len(run.planned.stages))
        leaves, run.output_spec = tree_flatten(last)
        ctx.run = run
        ctx.input_count = len(flat_inputs)
        outputs = tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in leaves)
        ctx.mark_non_differentiable(*[t for t in outputs if isinstance(t, torch.Tensor) and not t.is_floating_point()])
        return outputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *placeholders):
        run, length = ctx.run, len(ctx.run.planned.stages)
        del ctx.run
        if length in run.acts:
            run.acts.pop(length)  # δ_L takes the place of a standalone a_L
        for op in run.planned.backward_ops:
            if op.kind == "B":
                run.backward_op(op.stage)
            else:
                run.forward_op(op)
        first_grads = run.grads.pop(0, [])
        grads = list(first_grads) + [None] * (ctx.input_count - len(first_grads))
        return (None, None, *grads[:ctx.input_count])


def _detached(tree):
    return tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, tree)


def _leaf(tree, requires_grad):
    return tree_map(lambda t: t.detach().requires_grad_(requires_grad and t.is_floating_point())
                    if isinstance(t, torch.Tensor) else t, tree)


def _any_requires_grad(tree) -> bool:
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_flatten(tree)[0])


def _rng_state():
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)


def _autocast_state():
    return {device: (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
            for device in ("cpu", "cuda") if device == "cpu" or torch.cuda.is_available()}


@contextlib.contextmanager
def _autocast(state):
    with contextlib.ExitStack() as stack:
        for device, (enabled, dtype) in state.items():
            stack.enter_context(torch.autocast(device_type=device, dtype=dtype, enabled=enabled))
        yield
