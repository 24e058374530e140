"""Synthetic chain problems: random chains for tests and benchmarks, shaped like real networks.

Sizes in bytes, times in seconds. A heterogeneous chain draws each stage's
forward time, backward/forward ratio, output size and saved/output ratio
independently; a homogeneous chain repeats one stage (Revolve's setting).
"""

import dataclasses

import numpy as np

from planner.chain import Chain, Loss, Stage, StageOption
from planner.graph import Graph, GraphNode


def random_chain(length: int, seed: int = 0, *, homogeneous: bool = False, tmp: bool = False, params: bool = False,
                 own_saved: bool = False, options: int = 0, scale_bytes: int = 10**7, name: str = None) -> Chain:
    """A chain of ``length`` stages drawn from ``seed``.

    ``tmp`` adds forward/backward temporaries and a loss temporary; ``params``
    adds parameter gradients; ``own_saved`` makes about half the stages not
    save (part of) their output for their own backward (``own_saved_bytes``
    below ``saved_bytes``), drawn last so that the other fields do not change;
    ``options`` gives each stage up to that many options (planner.chain.StageOption: less kept, a slower
    backward), drawn after everything else. ``scale_bytes`` is the typical activation size.
    """
    rng = np.random.default_rng(seed)
    count = 1 if homogeneous else length
    fwd = rng.uniform(0.002, 0.008, count)
    bwd = fwd * rng.uniform(1.5, 2.5, count)
    out = rng.integers(scale_bytes // 5, 3 * scale_bytes, count)
    saved = out * rng.uniform(1.0, 4.0, count)
    fwd_tmp = rng.integers(0, scale_bytes, count) if tmp else np.zeros(count, dtype=np.int64)
    nograd_tmp = rng.integers(0, scale_bytes, count) if tmp else np.zeros(count, dtype=np.int64)
    bwd_tmp = rng.integers(0, 2 * scale_bytes, count) if tmp else np.zeros(count, dtype=np.int64)
    param = rng.integers(0, scale_bytes // 2, count) if params else np.zeros(count, dtype=np.int64)
    pick = (lambda i: 0) if homogeneous else (lambda i: i)
    stages = tuple(
        Stage(name=f"stage{i}", fwd_time=float(round(fwd[pick(i)], 6)), bwd_time=float(round(bwd[pick(i)], 6)),
              out_bytes=int(out[pick(i)]), saved_bytes=int(saved[pick(i)]), fwd_tmp_bytes=int(fwd_tmp[pick(i)]),
              nograd_tmp_bytes=int(nograd_tmp[pick(i)]),
              bwd_tmp_bytes=int(bwd_tmp[pick(i)]), param_bytes=int(param[pick(i)]))
        for i in range(length)
    )
    loss = Loss(bwd_time=float(round(rng.uniform(0.0, 0.002), 6)),
                tmp_bytes=int(rng.integers(0, scale_bytes)) if tmp else 0)
    input_bytes = int(rng.integers(scale_bytes // 5, 2 * scale_bytes))
    if own_saved:
        unread = [int(rng.integers(0, s.out_bytes + 1)) if rng.random() < 0.5 else 0 for s in stages]
        stages = tuple(dataclasses.replace(s, own_saved_bytes=s.saved_bytes - unread[pick(i)])
                       for i, s in enumerate(stages))
    if options:
        stages = tuple(dataclasses.replace(s, options=_random_options(rng, s, options)) for s in stages)
    return Chain(name=name or f"synthetic_L{length}_s{seed}", device="synthetic",
                 input_bytes=input_bytes, stages=stages, loss=loss)


def _random_options(rng, stage: Stage, most: int) -> tuple:
    """Up to ``most`` options of ``stage``: each keeps a fraction of what the stage keeps beyond its output,
    recomputes part of its forward in its backward and may need more temporary bytes there."""
    chosen = []
    for k in range(int(rng.integers(0, most + 1))):
        fraction = float(rng.uniform(0.0, 1.0))
        inner = stage.saved_bytes - stage.out_bytes
        saved = stage.out_bytes + int(inner * fraction)
        unread = stage.saved_bytes - stage.own_saved_bytes  # the output, or part of it, read by nothing later
        chosen.append(StageOption(
            recompute=(k,), fwd_time=stage.fwd_time,
            bwd_time=float(round(stage.bwd_time + stage.fwd_time * (1 - fraction) * rng.uniform(0.5, 1.0), 6)),
            saved_bytes=saved, own_saved_bytes=saved - min(unread, stage.out_bytes),
            fwd_tmp_bytes=int(stage.fwd_tmp_bytes * rng.uniform(0.5, 1.0)),
            bwd_tmp_bytes=stage.bwd_tmp_bytes + int(inner * (1 - fraction) * rng.uniform(0.0, 1.0))))
    return tuple(chosen)


_SHAPES = ("random", "resnet", "transformer")


def _forward_structure(rng, shape: str, count: int, skip: float, dropout: float):
    """Per forward node: (name, deps, has parameters, random), ``count`` nodes in a topological order."""
    nodes = []
    if shape == "random":
        for i in range(count):
            deps = [i - 1] if i else []
            if i >= 2 and rng.random() < skip:
                deps.append(int(rng.integers(max(0, i - 8), i - 1)))
            nodes.append((f"fw{i}", deps, bool(rng.random() < 0.5), bool(i and rng.random() < dropout)))
        return nodes[:count]
    block = 0
    while len(nodes) < count:
        x = len(nodes) - 1  # the block's input (-1: the data, held in fixed_bytes)
        inp = [x] if x >= 0 else []
        base = len(nodes)
        if shape == "resnet":
            nodes += [(f"b{block}.conv1", inp, True, False),
                      (f"b{block}.relu1", [base], False, False),
                      (f"b{block}.conv2", [base + 1], True, False),
                      (f"b{block}.add", [base + 2] + inp, False, False)]
        else:
            nodes += [(f"b{block}.ln1", inp, True, False),
                      (f"b{block}.q", [base], True, False),
                      (f"b{block}.k", [base], True, False),
                      (f"b{block}.v", [base], True, False),
                      (f"b{block}.attn", [base + 1, base + 2, base + 3], False, bool(rng.random() < dropout)),
                      (f"b{block}.proj", [base + 4], True, False),
                      (f"b{block}.add1", [base + 5] + inp, False, False),
                      (f"b{block}.ff1", [base + 6], True, False),
                      (f"b{block}.gelu", [base + 7], False, False),
                      (f"b{block}.ff2", [base + 8], True, bool(rng.random() < dropout)),
                      (f"b{block}.add2", [base + 9, base + 6], False, False)]
        block += 1
    return nodes[:count]


def _backward_time(rng, forward_time: float) -> float:
    """1.5 to 2.5 times the forward, rounded to the microsecond (at least one)."""
    return float(round(forward_time * rng.uniform(1.5, 2.5), 6)) or 1e-6


def random_graph(rng, nodes: int, *, shape: str = "random", skip: float = 0.3, dropout: float = 0.2,
                 tmp: bool = True, scale_bytes: int = 10**7, name: str = None):
    """A random training graph (:class:`planner.graph.Graph`) of ``nodes`` nodes, drawn from ``rng`` (a seed or a
    ``numpy.random.Generator``).

    A forward part (``shape``: ``random``, a chain with skip connections to one of the 8 previous nodes with
    probability ``skip``; ``resnet``, residual blocks conv-relu-conv-add; ``transformer``, blocks of attention
    with three projections and a feed-forward part, each with its residual) is followed by the loss (a
    ``keep`` node), the gradient of the last output, and a mirrored backward part: per forward node ``i``
    (except the first, whose input is data) the gradient of its inputs, reading the gradients of ``i``'s
    consumers and ``i``'s own inputs; per forward node with parameters, a ``keep`` parameter-gradient node.
    A forward node is ``random`` (dropout) with probability ``dropout`` (``random`` and ``transformer``).
    Sizes are whole bytes around ``scale_bytes``; times are seconds rounded to the microsecond, backward
    times about twice the forward ones; ``tmp`` adds transient bytes. The node count is exactly ``nodes``
    when the parameter gradients allow it (graphs of at least 5 nodes in practice), else one more.
    """
    if shape not in _SHAPES:
        raise ValueError(f"shape must be one of {', '.join(_SHAPES)}, got {shape!r}")
    if nodes < 3:
        raise ValueError(f"a training graph needs at least 3 nodes, got {nodes}")
    rng = np.random.default_rng(rng)
    # the smallest forward length whose graph (2F+1 nodes and one per parameterised forward node) reaches `nodes`
    count = 1
    while True:
        forward = _forward_structure(np.random.default_rng(rng.integers(2**63)), shape, count, skip, dropout)
        if 2 * count + 1 + sum(f[2] for f in forward) >= nodes:
            break
        count += 1
    gradients = max(0, nodes - 2 * count - 1)  # parameter-gradient nodes that fit; the last ones are frozen
    out = rng.integers(scale_bytes // 5, 3 * scale_bytes, count)
    fwd_time = np.round(rng.uniform(0.0005, 0.004, count), 6)

    def tmp_bytes():
        return int(rng.integers(0, scale_bytes)) if tmp and rng.random() < 0.3 else 0

    graph_nodes = [GraphNode(name=fname, time=float(fwd_time[i]) or 1e-6, out_bytes=int(out[i]), deps=tuple(deps),
                             tmp_bytes=tmp_bytes(), params=(f"{fname}.weight",) if has_params else (), random=is_random)
                   for i, (fname, deps, has_params, is_random) in enumerate(forward)]
    last = count - 1
    graph_nodes.append(GraphNode(name="loss", time=float(round(rng.uniform(0.0001, 0.0005), 6)), out_bytes=4,
                                 deps=(last,), keep=True))
    grad_of = {}  # forward node -> the backward node carrying the gradient of its output
    graph_nodes.append(GraphNode(name="loss.grad", time=float(round(rng.uniform(0.0001, 0.0005), 6)),
                                 out_bytes=int(out[last]), deps=(last,), backward=True))
    grad_of[last] = [len(graph_nodes) - 1]
    consumers = [[] for _ in range(count)]
    for i, (_, deps, _, _) in enumerate(forward):
        for d in deps:
            consumers[d].append(i)
    param_nodes = [i for i, f in enumerate(forward) if f[2]][:gradients]
    for i in reversed(range(count)):
        fname, deps, _, _ = forward[i]
        upstream = sorted(grad_of.get(i, []))
        if i in param_nodes:
            graph_nodes.append(GraphNode(name=f"{fname}.wgrad", time=_backward_time(rng, fwd_time[i]),
                                         out_bytes=int(out[i] // 4) + 1,
                                         deps=tuple(upstream + deps), tmp_bytes=tmp_bytes(), backward=True,
                                         params=(f"{fname}.weight",), keep=True))
        if i == 0:
            continue
        saved = sorted(set(deps) | ({i} if rng.random() < 0.3 else set()))
        graph_nodes.append(GraphNode(name=f"{fname}.grad", time=_backward_time(rng, fwd_time[i]),
                                     out_bytes=int(sum(out[d] for d in deps)) or 4, deps=tuple(upstream + saved),
                                     tmp_bytes=tmp_bytes(), backward=True))
        for d in deps:
            grad_of.setdefault(d, []).append(len(graph_nodes) - 1)
    return Graph(name=name or f"synthetic_{shape}_n{nodes}", nodes=tuple(graph_nodes),
                 fixed_bytes=int(rng.integers(scale_bytes // 5, 2 * scale_bytes)), device="synthetic",
                 source="synthetic").check()
