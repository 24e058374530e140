"""Chen et al. 2016, "Training deep nets with sublinear memory cost": √n segments.

The chain is cut into ``k`` contiguous segments of near-equal length. The
forward keeps only each segment's input (``F_ck`` then ``F_none``); the last
segment runs with autograd straight away. Backward goes segment by segment from
the end, recomputing each earlier segment with ``F_all`` before its backwards.
With ``k = round(√L)`` this is the classic O(√L) memory schedule; the
budget-aware form tries every ``k`` and keeps the fastest that fits.
"""

import math

from planner.chain import Chain
from planner.plan import Op
from planner.simulator import ChainSimulator
from planner.errors import MemschedError
from solvers.result import Solution


def segment_bounds(length: int, segments: int) -> list:
    """Start indices of ``segments`` near-equal segments, plus ``length`` at the end."""
    base, extra = divmod(length, segments)
    bounds = [0]
    for c in range(segments):
        bounds.append(bounds[-1] + base + (1 if c < extra else 0))
    return bounds


def checkpoint_sequential_bounds(length: int, segments: int) -> list:
    """The cut of ``torch.utils.checkpoint.checkpoint_sequential``: ``length // segments`` stages per segment
    from the start, the remainder in the last one."""
    size = length // segments
    return [size * c for c in range(segments)] + [length]


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

    Both cuts count, near-equal (Chen's) and ``checkpoint_sequential``'s, for every segment count.
    """
    simulator = ChainSimulator(chain)
    best = None
    for count in range(1, chain.length + 1):
        cuts = {tuple(segment_bounds(chain.length, count)), tuple(checkpoint_sequential_bounds(chain.length, count))}
        for bounds in sorted(cuts):
            schedule = segments_schedule(chain.length, count, list(bounds))
            result = simulator.run(schedule)
            if result.peak_bytes <= budget and (best is None or result.time < best[0]):
                best = (result.time, schedule)
    return best


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
