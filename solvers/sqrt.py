"""Chen et al. 2016, "Training deep nets with sublinear memory cost": √n segments.

The chain is cut into ``k`` contiguous segments of near-equal length. The
forward keeps only each segment's input (``F_ck`` then ``F_none``); the last
segment runs with autograd straight away. Backward goes segment by segment from
the end, recomputing each earlier segment with ``F_all`` before its backwards.
With ``k = round(√L)`` this is the classic O(√L) memory schedule; the
budget-aware form tries every ``k`` and keeps the fastest that fits.
"""

import math

import numpy as np

from planner.chain import Chain
from planner.errors import MemschedError
from planner.ops import Op
from planner.simulate.chain import ChainSimulator
from solvers.result import Solution


def segment_bounds(length: int, segments: int) -> list:
    """Start indices of ``segments`` near-equal segments, plus ``length`` at the end."""
    return _near_equal_cut(length, segments).tolist()


def checkpoint_sequential_bounds(length: int, segments: int) -> list:
    """The cut of ``torch.utils.checkpoint.checkpoint_sequential``: ``length // segments`` stages per segment
    from the start, the remainder in the last one."""
    return _sequential_cut(length, segments).tolist()


def _near_equal_cut(length: int, segments: int) -> np.ndarray:
    """:func:`segment_bounds` as an array: the first ``length % segments`` segments one stage longer."""
    base, extra = divmod(length, segments)
    steps = np.arange(segments + 1)
    return steps * base + np.minimum(steps, extra)


def _sequential_cut(length: int, segments: int) -> np.ndarray:
    """:func:`checkpoint_sequential_bounds` as an array."""
    bounds = np.arange(segments + 1) * (length // segments)
    bounds[-1] = length
    return bounds


def segments_schedule(length: int, segments: int, bounds=None) -> tuple:
    """The Chen schedule with ``segments`` segments (1 = store all, ``length`` = one checkpoint per stage), cut at
    ``bounds`` (default :func:`segment_bounds`)."""
    bounds = bounds or segment_bounds(length, segments)
    ops = []
    for start, end in zip(bounds[:-2], bounds[1:-1]):
        ops.append(Op("F_ck", start))
        ops.extend(Op("F_none", k) for k in range(start + 1, end))
    last_start = bounds[-2]
    ops.extend(Op("F_all", k) for k in range(last_start, length))
    ops.append(Op("Loss"))
    ops.extend(Op("B", k) for k in reversed(range(last_start, length)))
    for start, end in reversed(list(zip(bounds[:-2], bounds[1:-1]))):
        ops.extend(Op("F_all", k) for k in range(start, end))
        ops.extend(Op("B", k) for k in reversed(range(start, end)))
    return tuple(ops)


def fastest_segments(chain: Chain, budget: int):
    """``(seconds, schedule)``: the fastest segment schedule within ``budget`` bytes, or None.

    Both cuts count, near-equal (Chen's) and ``checkpoint_sequential``'s, for every segment count. A segment
    schedule's time depends only on where its last segment starts (every stage before it runs forward twice),
    so the cuts are replayed fastest first, and one whose memory before a segment's first backward (exact, from
    prefix sums) or at the end (the input, its gradient and every parameter gradient) is above the budget is
    skipped unreplayed: a few replays, not ``2L``, on long chains.
    The answer is the one replaying every cut in order of count would give (ties to the smaller count).
    """
    length = chain.length
    if 2 * chain.input_bytes + sum(s.param_bytes for s in chain.stages) > budget:
        return None
    stages = chain.stages
    act = np.array([chain.act_bytes(i) for i in range(length + 1)], dtype=np.int64)
    saved_prefix = np.concatenate([[0], np.cumsum([s.saved_bytes for s in stages])])
    shrink = np.array([0] + [s.saved_bytes - s.own_saved_bytes for s in stages], dtype=np.int64)  # at index i+1
    param_suffix = np.concatenate([np.cumsum([s.param_bytes for s in reversed(stages)])[::-1], [0]])
    fwd_prefix = np.concatenate([[0.0], np.cumsum([s.fwd_time for s in stages])])
    compute_time = chain.compute_time
    candidates = []
    for count in range(1, length + 1):
        chen, sequential = _near_equal_cut(length, count), _sequential_cut(length, count)
        cuts = [chen] if np.array_equal(chen, sequential) else [chen, sequential]
        for bounds in cuts:
            starts, ends = bounds[:-1], bounds[1:]
            # the memory once each segment's forwards with autograd have run, before its first backward: the
            # checkpoints up to its input, its saved tensors (the last one shrunk: δ of its output exists, or
            # comes with the loss), δ of its output and the parameter gradients of every later stage
            held = (np.cumsum(act[starts]) + saved_prefix[ends] - saved_prefix[starts] - shrink[ends] + act[ends]
                    + param_suffix[ends])
            if int(held.max()) <= budget:
                candidates.append((compute_time + float(fwd_prefix[starts[-1]]), count, tuple(bounds.tolist())))
    candidates.sort()
    simulator = ChainSimulator(chain)
    best = None  # (seconds, count, bounds, schedule)
    for estimate, count, bounds in candidates:
        if best is not None and estimate > best[0] * (1 + 1e-9):
            break  # this cut and every later one are slower than the best (estimates exact but for rounding)
        schedule = segments_schedule(length, count, list(bounds))
        result = simulator.run(schedule)
        if result.peak_bytes <= budget and (best is None or (result.time, count, bounds) < best[:3]):
            best = (result.time, count, bounds, schedule)
    return None if best is None else (best[0], best[3])


def sqrt(chain: Chain, budget: int, segments: int = None) -> Solution:
    """Chen's segments: ``segments`` if given, else the fastest segment count whose peak fits ``budget``."""
    length = chain.length
    if segments is not None:
        if not 1 <= segments <= length:
            raise MemschedError(f"sqrt: segments must be between 1 and {length} for this chain, got {segments}")
        return Solution(segments_schedule(length, segments), params={"segments": segments})
    simulator = ChainSimulator(chain)
    best = None
    for count in range(1, length + 1):
        schedule = segments_schedule(length, count)
        result = simulator.run(schedule)
        if result.peak_bytes <= budget and (best is None or result.time < best[0]):
            best = (result.time, count, schedule)
    if best is None:
        classic = max(1, round(math.sqrt(length)))
        return Solution(segments_schedule(length, classic), params={"segments": classic})
    return Solution(best[2], params={"segments": best[1]})
