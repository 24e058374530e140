"""Measure a model's whole training step as a graph problem (``memsched.graph/1``; bytes and seconds).

:func:`profile_graph` captures the *joint* forward+backward graph of one step, grouped into at most ``nodes``
graph nodes (:func:`planner.execute.capture.capture`; docs/execution.md, "Graph capture", says what a node,
its value, ``fixed_bytes``, ``keep`` and ``random`` are), then measures each group by running it exactly as
the graph executor runs it (:class:`planner.execute.capture.GroupRun`): ``out_bytes`` is what one computation
leaves allocated, ``tmp_bytes`` its peak above that and everything resident before it (the live-memory tracker
on CPU, the allocator's statistics on CUDA), ``time`` the median of ``repeats`` timed runs after ``warmup``
runs of the whole step. With ``estimate=True`` nothing is allocated: the step runs on fake tensors, sizes come
from them exactly and times are FLOPs over ``throughput``.
"""

import contextlib
import statistics
import time

import torch

from planner.errors import MemschedError
from planner.execute.capture import GroupRun, JointGraph, capture, preserved_joint_state
from planner.execute.live_memory import LiveMemoryTracker
from planner.execute.stages import quiet_fake_tensor_log
from planner.graph import Graph, GraphNode
from planner.simulate.graph import store_all_graph_schedule
from profiles.chain_profiler import DEFAULT_THROUGHPUT
from profiles.memory import memory_meter


def profile_graph(model_or_stages, example_inputs, loss_fn=None, *, nodes=200, estimate=False, throughput=None,
                  device=None, warmup=1, repeats=3, name="model") -> Graph:
    """Profile one training step of ``model_or_stages`` on ``example_inputs`` into a :class:`Graph` of at most
    ``nodes`` nodes.

    ``model_or_stages``: an ``nn.Module`` called as ``model(*example_inputs)``, or stages as for the chain
    profiler (each called ``stage(a_k, *extra)``); ``loss_fn(output) -> scalar`` (default: the output's mean;
    tensors it closes over, such as targets, become constants of the graph). ``device`` moves the model and
    the inputs there first. ``estimate=True`` allocates nothing (see the module docstring).
    """
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise MemschedError(f"nodes must be a whole number >= 1, got {nodes!r}")
    joint = capture(model_or_stages, example_inputs, loss_fn, nodes=nodes, device=device)
    fake_mode = joint.fake_mode if estimate else None
    measured = _measure(joint, fake_mode, warmup, repeats, throughput or DEFAULT_THROUGHPUT)
    graph_nodes = tuple(GraphNode(name=g.name, time=seconds, out_bytes=out, tmp_bytes=tmp, deps=g.deps,
                                  backward=g.backward, params=g.params, random=g.random, keep=g.keep)
                        for g, (seconds, out, tmp) in zip(joint.groups, measured))
    graph = Graph(name=name, nodes=graph_nodes, fixed_bytes=joint.fixed_bytes,
                  device=str(joint.device), source="estimate" if estimate else "measured")
    return graph.check(f"graph of {name}")


# --------------------------------------------------------------------------------------------------
# Measuring groups


def _store_all(joint: JointGraph) -> tuple:
    shape = Graph(name="capture", fixed_bytes=0, nodes=tuple(
        GraphNode(name=g.name, time=0.0, out_bytes=0, deps=g.deps, keep=g.keep) for g in joint.groups))
    return store_all_graph_schedule(shape)


def _measure(joint: JointGraph, fake_mode, warmup: int, repeats: int, throughput: float) -> list:
    """``[(seconds, out_bytes, tmp_bytes)]`` per group, from store-all runs of the step (see the module docstring)."""
    schedule = _store_all(joint)
    sizes = {}
    with preserved_joint_state(joint), (fake_mode or contextlib.nullcontext()), quiet_fake_tensor_log():
        fixed = joint.fixed_values(joint.example_inputs, fake_mode)
        meter = LiveMemoryTracker(fake=True) if fake_mode else memory_meter(joint.device)
        with meter:
            run = GroupRun(joint, fixed)
            for op in schedule:
                if op.kind == "free":
                    run.free(op.node)
                    continue
                before = meter.current
                meter.reset_peak()
                run.compute(op.node)
                after = meter.current
                sizes[op.node] = (after - before, max(0, meter.peak - after))
            del run
        if fake_mode:
            times = [g.flops / throughput for g in joint.groups]
        else:
            times = _times(joint, fixed, schedule, warmup, repeats)
    return [(times[k], *sizes[k]) for k in range(len(joint.groups))]


def _times(joint: JointGraph, fixed: dict, schedule, warmup: int, repeats: int) -> list:
    """Median seconds per group over ``repeats`` store-all runs after ``warmup`` (CUDA events on a GPU)."""
    cuda = joint.device.type == "cuda"
    samples = [[] for _ in joint.groups]
    for repeat in range(warmup + repeats):
        run = GroupRun(joint, fixed)
        marks = {}
        for op in schedule:
            if op.kind == "free":
                run.free(op.node)
                continue
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                run.compute(op.node)
                end.record()
                marks[op.node] = (start, end)
            else:
                started = time.perf_counter()
                run.compute(op.node)
                marks[op.node] = time.perf_counter() - started
        if cuda:
            torch.cuda.synchronize(joint.device)
            marks = {k: start.elapsed_time(end) / 1000.0 for k, (start, end) in marks.items()}
        del run
        if repeat >= warmup:
            for k, seconds in marks.items():
                samples[k].append(seconds)
    return [statistics.median(s) for s in samples]
