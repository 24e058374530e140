"""Stage options: ways to run a stage's forward that drop some of the values autograd saves and recompute them.

:func:`candidate_recomputes` proposes which operations to recompute from the stage's graph as
:func:`planner.execute.selective.forward_nodes` measures it: for every value autograd saves that may be
recomputed, its *closure*, the operations back to values held anyway (saved ones, the stage's inputs and
parameters), each closure scored by the saved bytes it frees less the bytes it must hold instead, per unit of
recomputation :func:`work`; then ``count`` prefixes of the best-first order, spread evenly over the bytes they
free. The work is counted, not timed, so two profiles of one model propose the same candidates (ranked by
measured seconds, they moved with the clock's noise, and the least budget with them: 7.4–9.2 MiB).
The chain profiler measures each candidate as it measures a stage (run by
:func:`planner.execute.selective.run_with_option`: memory from one run under the meter, seconds from separate
runs) and :func:`pareto_front` keeps those that no other way of running the stage, the stage itself included,
matches or beats on every count. Identical blocks (same :func:`structure`) are measured once.
docs/execution.md, "Stage options".
"""

import dataclasses
import hashlib
import time

from planner.chain import Stage, StageOption

DEFAULT_OPTIONS = 4  # candidates measured per distinct stage by `memsched profile` (0: none), policies beside them
# The operations selective-checkpoint policies keep (torch.utils.checkpoint's "save the matmuls", torchtitan's save
# list): the matrix products (every second one recomputed by torchtitan's policy), attention and convolutions
MATMULS = ("aten.linear.", "aten.mm.", "aten.addmm.", "aten.bmm.", "aten.baddbmm.")
MATRIX_PRODUCTS = MATMULS + ("aten._scaled_dot_product", "aten.convolution.")
# A nominal machine balance, FLOPs per byte of memory traffic (fp32 on a recent GPU: 67 TFLOP/s over
# 3.35 TB/s is 20): it weighs a matrix product's arithmetic against an element-wise operation's traffic.
# A machine's own measured figure would again move with its noise. Least budget (options) of a model whose
# blocks keep a list of residuals: 4.93 MB at 1, 4.47 MB at 32, 4.34 MB counting bytes alone (timed: 4.21-4.27).
FLOPS_PER_BYTE = 32


def structure(nodes, module) -> str:
    """A fingerprint of the stage's forward: its operations, their bytes and inputs, its parameters' shapes; two
    stages with the same one get the same options."""
    parts = [f"{n.name}:{n.bytes}:{n.saved}:{n.inputs}" for n in nodes]
    if hasattr(module, "named_parameters"):
        parts += [f"{name}:{tuple(p.shape)}:{p.dtype}" for name, p in module.named_parameters()]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()


def candidate_recomputes(nodes, count: int) -> list:
    """Up to ``count`` distinct ``recompute`` tuples (sorted positions), as the module docstring says."""
    if count < 1:
        return []
    by_position = {node.position: node for node in nodes}
    items = {}  # a tuple-valued operation -> the getitem nodes reading it
    for node in nodes:
        for d in node.inputs:
            if by_position[d].several:
                items.setdefault(d, []).append(node.position)

    def holding(position) -> int:
        """Bytes that keeping this value for a recomputation costs beyond what the plain forward keeps."""
        node = by_position[position]
        if node.saved:
            return 0
        if node.bytes:
            return node.bytes
        if node.several:  # a tuple holds every item
            return sum(holding(item) for item in items.get(position, ()))
        return max((holding(d) for d in node.inputs), default=0)  # a view: its base's

    units = []
    for node in nodes:
        if not (node.saved and node.recomputable and node.bytes):
            continue
        closure = _closure(node, by_position, holding)
        frontier = {d for p in closure for d in by_position[p].inputs if d not in closure}
        freed = sum(by_position[p].bytes for p in closure if by_position[p].saved)
        gain = freed - sum(holding(d) for d in frontier)
        if gain > 0:
            units.append((gain / sum(work(by_position[p]) for p in closure), freed, closure))
    units.sort(key=lambda unit: (-unit[0], min(unit[2])))
    prefixes, total, union = [], 0, set()
    for _, freed, closure in units:
        if closure - union:
            union |= closure
            total += freed
            prefixes.append((total, tuple(sorted(union))))
    chosen = []
    for step in range(1, count + 1) if prefixes else ():
        target = total * step / count
        best = min(prefixes, key=lambda prefix: (abs(prefix[0] - target), len(prefix[1])))[1]
        if best not in chosen:
            chosen.append(best)
    for policy in policy_recomputes(nodes, holding):  # what users of selective checkpointing write by hand
        if policy and policy not in chosen:
            chosen.append(policy)
    return chosen


def policy_recomputes(nodes, holding) -> list:
    """The selective-checkpoint policies people write by hand, as ``recompute`` tuples: keep the values of the
    matrix products, attention and convolutions (:data:`MATRIX_PRODUCTS`) and recompute every other saved value
    (PyTorch's "save the matmuls" policy); and the same recomputing every second matrix product as well
    (torchtitan's selective op checkpointing). Each recomputes a saved value with the operations back to values
    held anyway (``holding``: see :func:`candidate_recomputes`), never through a kept operation."""
    by_position = {node.position: node for node in nodes}
    products = [node.position for node in nodes if node.name.startswith(MATRIX_PRODUCTS)]
    matmuls = [p for p in products if by_position[p].name.startswith(MATMULS)]
    policies = []
    for kept in (set(products), set(products) - set(matmuls[1::2])):
        kept |= {node.position for node in nodes  # the items of a kept tuple (attention's output and statistics)
                 if any(d in kept and by_position[d].several for d in node.inputs)}
        recompute = set()
        for node in nodes:
            if node.saved and node.recomputable and node.bytes and node.position not in kept:
                recompute |= _closure(node, by_position, holding, barrier=kept)
        policies.append(tuple(sorted(recompute)))
    return policies


def _closure(node, by_position, holding, barrier=frozenset()) -> set:
    """``node`` and the operations back from it to values held anyway (those ``holding`` says cost nothing more
    to keep, and the ``barrier`` operations, kept by a policy): what recomputing its value runs."""
    closure, stack = set(), [node.position]
    while stack:
        position = stack.pop()
        if position in closure:
            continue
        closure.add(position)
        stack.extend(d for d in by_position[position].inputs
                     if by_position[d].recomputable and holding(d) and d not in closure and d not in barrier)
    return closure


def work(node) -> float:
    """What recomputing ``node`` (a :class:`planner.execute.selective.ForwardNode`) costs, to rank candidates, in
    bytes written: the bytes it writes plus its FLOPs over :data:`FLOPS_PER_BYTE` (an element-wise operation
    costs its memory traffic, where FLOP counters count nothing; a view costs 1). Exact counts: the same on every
    run. Each candidate's own seconds are measured when it is profiled."""
    return node.bytes + node.flops / FLOPS_PER_BYTE + 1


def pareto_front(stage: Stage, options) -> tuple:
    """The ``options`` (:class:`StageOption`) that neither another option nor the stage itself matches or beats
    on saved bytes, forward and backward seconds together, and each peak; by saved bytes, most first."""
    itself = StageOption(recompute=(), fwd_time=stage.fwd_time, bwd_time=stage.bwd_time,
                         saved_bytes=stage.saved_bytes, own_saved_bytes=stage.own_saved_bytes,
                         fwd_tmp_bytes=stage.fwd_tmp_bytes, bwd_tmp_bytes=stage.bwd_tmp_bytes)

    def counts(option):
        return (option.saved_bytes, option.fwd_time + option.bwd_time, option.saved_bytes + option.fwd_tmp_bytes,
                option.own_saved_bytes + option.bwd_tmp_bytes)

    def no_worse(a, b):
        return all(x <= y for x, y in zip(counts(a), counts(b)))

    def dropped(k, option):
        if no_worse(itself, option):
            return True
        return any(no_worse(other, option) and (counts(other) != counts(option) or j < k)
                   for j, other in enumerate(options) if j != k)

    kept = [option for k, option in enumerate(options) if not dropped(k, option)]
    return tuple(sorted(kept, key=lambda option: (-option.saved_bytes, option.recompute)))


def measure_options(chain, same_as: list, measured, check=None, say=None):
    """``chain`` (profiled without options) with its stages' options: ``measured(k)`` is distinct stage ``k``
    with its options, and stage ``j`` gets those of stage ``same_as[j]`` (an identical one, or itself).

    ``check(chain, pending)``, when given, is called first and after each distinct stage's options, with the
    chain so far and ``pending`` (each distinct stage whose options are to come -> the stages that will share
    them, itself included); it may stop here by raising, and may return distinct stages in the order to measure
    them (those it leaves out after them, in chain order; None: as before). ``say(line)`` is told each stage's
    options."""
    pending = {k: tuple(j for j, first in enumerate(same_as) if first == k) for k in sorted(set(same_as))}
    order = []
    while True:
        order = (check(chain, pending) if check else None) or order
        if not pending:
            return chain
        k = next(k for k in [*order, *pending] if k in pending)
        started, stage = time.perf_counter(), measured(k)
        stages = list(chain.stages)
        for j in pending.pop(k):
            stages[j] = dataclasses.replace(stages[j], options=stage.options)
        chain = dataclasses.replace(chain, stages=tuple(stages))
        if say:
            alike = len([j for j in same_as if j == k]) - 1
            say(f"options of stage {k} ({stage.name}): {len(stage.options)} kept, measured in "
                f"{time.perf_counter() - started:.1f} s" + (f"; {alike} identical stages share them" if alike else ""))
