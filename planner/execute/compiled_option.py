"""A stage option under ``torch.compile``: one compiled forward and backward, the option's values recomputed inside.

The stage's graph runs inside ``torch.utils.checkpoint`` (non-reentrant) with a selective-checkpoint policy,
and the whole is compiled: AOT autograd's partitioner recomputes in the compiled backward the values the policy
marks ``MUST_RECOMPUTE`` and saves those marked ``MUST_SAVE`` (the tags survive compilation), so the stage
runs as one forward graph and one backward graph, not as pieces between Python notes (measured on a gpt-tiny
block, one thread: 19 ms a step against 52 ms for the pieces and 17 ms for the compiled plain block).

The policy is called once per ATen operation the traced forward dispatches (one graph operation such as
``linear`` dispatches several: ``t``, ``addmm``, ``view``), in order, without naming the graph node it belongs
to; which node each call belongs to is learnt from one run, on fake tensors, of the same checkpointed graph node
by node (:func:`_dispatches`), each traced operation placed in the node whose eager dispatches include it, from the
last one placed on (:class:`_Policy`: traced code spells a few operations otherwise, ``_unsafe_view`` as
``view``, a Hugging Face dropout as one ``native_dropout``). A dropped operation's dispatches are recomputed,
except random ones (inductor draws its own numbers for a recomputed one; they are saved); everything else is
saved. Where many traced operations find no node, a warning says so. A graph that writes in place (an exported
BatchNorm's statistics) is not run here (planner/execute/selective.py runs its option eagerly).
"""

import functools
import types
import warnings

import torch
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from planner.execute.autograd import rng_devices


class SelectiveRegion:
    """``graph_module`` (a stage's graph) under a selective checkpoint recomputing the operations ``dropped``
    (graph nodes): a callable to run inside compiled code; ``args``: an example call, run once eagerly to learn
    the policy's order. ``eager(*inputs)``: the same option run eagerly (the eager plan's way), which runs in its
    place where torch.compile compiles nothing (see :meth:`__call__`)."""

    def __init__(self, graph_module, dropped, args, name: str = "a stage", eager=None):
        dropped, nodes = set(dropped), []  # [(node, its dispatches' spellings)] in dispatch order
        for spelling, node in _dispatches(graph_module, args):
            if not nodes or nodes[-1][0] is not node:
                nodes.append((node, []))
            nodes[-1][1].append(spelling)
        self.decisions = [_decision(node, dropped) for node, _ in nodes]
        self.spellings = [tuple(spellings) for _, spellings in nodes]
        self.graph_module, self.name, self.eager = graph_module, name, eager
        self.warned = False

        def context():  # a plain function: dynamo keeps context_fn as one (a bound method loses its object)
            return create_selective_checkpoint_contexts(_Policy(self))

        self.context = context

    def __call__(self, *inputs):
        if not torch.compiler.is_compiling() and self.eager is not None:
            # The compiled function's Python runs eagerly: under a TorchDispatchMode (a memory tracker, a FLOP
            # counter) dynamo compiles nothing, nor with torch.compile disabled or past its recompile limit. The
            # selective checkpoint would then run eagerly, its policy made for the traced operations: it would
            # keep what the plan drops and, on an eager dropout (``empty_like``, ``bernoulli_``, ``div_``),
            # raise "Tensor cached during selective activation checkpoint has been mutated". The eager plan's
            # option runs instead: the operations and bytes the plan counts (dynamo kept from the frames it calls,
            # which would otherwise compile its preparation, run outside the caller's modes).
            return _uncompiled()(self.eager, *inputs)
        return checkpoint(self.graph_module, *inputs, use_reentrant=False, context_fn=self.context)

    def misaligned(self, unplaced: int, seen: int) -> None:
        if not self.warned:
            self.warned = True
            warnings.warn(f"{self.name}'s option under torch.compile: {unplaced} of the first {seen} traced "
                          "operations are not among the eager graph's; they take the decision of the operation "
                          "before them (the stage's peak may differ from the plan's)", stacklevel=2)


class CompiledOption:
    """One stage with an option, compiled: its :class:`SelectiveRegion` through ``torch.compile``."""

    def __init__(self, region: SelectiveRegion):
        def forward(*inputs):
            return region(*inputs)

        self.compiled = torch.compile(own_code(forward), dynamic=False)

    def run(self, module, args):
        return self.compiled(*args)


_LOOKAHEAD = 8  # graph nodes a traced operation may be ahead of the last one placed


class _Policy:
    """The selective-checkpoint policy of one trace. Each dispatched operation is placed in the first graph node,
    from the last one placed on (at most :data:`_LOOKAHEAD` ahead), whose eager dispatches not yet matched
    include its spelling, and takes that node's decision; one placed nowhere was spelled otherwise when traced
    (a Hugging Face dropout is ``native_dropout`` traced, ``empty_like``, ``bernoulli_``, ``div_``, ``mul``
    eagerly) and takes the decision of the node before it. A random operation is always saved (inductor
    would draw other numbers when recomputing it)."""

    def __init__(self, region: SelectiveRegion):
        self.region, self.at = region, 0
        self.left = [list(spellings) for spellings in region.spellings]
        self.seen = self.unplaced = 0

    def __call__(self, ctx, op, *args, **kwargs):
        spelling = _spelling(op)
        self.seen += 1
        for m in range(self.at, min(self.at + _LOOKAHEAD, len(self.left))):
            if spelling in self.left[m]:
                self.left[m].remove(spelling)
                self.at = m
                break
        else:
            self.unplaced += 1
            if self.seen >= 8 and 4 * self.unplaced > self.seen:
                self.region.misaligned(self.unplaced, self.seen)
        if not self.left or torch.Tag.nondeterministic_seeded in op.tags:
            return CheckpointPolicy.MUST_SAVE
        return self.region.decisions[self.at]


def _decision(node, dropped) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_RECOMPUTE if node in dropped else CheckpointPolicy.MUST_SAVE


def _dispatches(graph_module, args) -> list:
    """``(spelling, node)`` of each ATen operation ``graph_module(*args)`` dispatches under a selective
    checkpoint, in order; run on fake copies of ``args`` (the parameters read as fake ones), so that it
    allocates nothing in the step that makes the region; random state and gradients as they were."""
    seen, current = [], [None]

    class Attributed(torch.fx.Interpreter):
        def run_node(self, node):
            current[0] = node
            return super().run_node(node)

    def record(ctx, op, *op_args, **op_kwargs):
        seen.append((_spelling(op), current[0]))
        return CheckpointPolicy.MUST_SAVE

    flat = tree_flatten(list(args))[0]
    mode = detect_fake_mode(flat) or FakeTensorMode(allow_non_fake_inputs=True)
    with torch.random.fork_rng(devices=rng_devices()), torch.enable_grad(), mode:
        flat = [mode.from_tensor(t.detach()).requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t
                for t in flat]
        checkpoint(Attributed(graph_module).run, *flat, use_reentrant=False,
                   context_fn=functools.partial(create_selective_checkpoint_contexts, record))
    return seen


def _spelling(op) -> str:
    return str(op).replace("aten._unsafe_view.", "aten.view.")


@functools.cache
def _uncompiled():
    """``(function, *args) -> function(*args)`` where dynamo does not trace: torch.compiler.disable, applied at the
    first use, since it imports dynamo (2 s that a process compiling nothing, a pipeline's rank or ``memsched
    train``, is spared)."""
    return torch.compiler.disable(_call)


def _call(function, *args):
    return function(*args)


def compiles_here() -> bool:
    """Whether ``torch.compile`` would run compiled code at this point: not while a TorchDispatchMode is active
    (dynamo then runs the compiled function's Python eagerly: "non-infra torch dispatch mode present"), nor
    with dynamo disabled."""
    from torch._dynamo import config
    from torch.utils import _python_dispatch as dispatch

    if config.disable:
        return False
    if config.inline_torch_dispatch_torch_compile:
        return not dispatch.any_torch_dispatch_mode_on_stack()
    return not dispatch.is_in_any_mode_without_ignore_compile_internals()


def own_code(function):
    """``function`` with a code object of its own: torch.compile keeps compiled code per code object, so
    identical blocks sharing one would recompile in turn until its cache limit (8) sends the rest to eager."""
    return types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__,
                              function.__defaults__, function.__closure__)
