"""The chain as integer arrays for the Rotor recurrences (shared by every implementation).

Index ``i`` runs over stages 0..L, stage ``L`` being the loss (no forward, no
output). Sizes are in *units*: bytes divided by ``unit`` and rounded up, so a
schedule that fits in units fits in bytes.
"""

from dataclasses import dataclass

import numpy as np

import planner.validate as validate
from planner.chain import Chain
from planner.ops import Op

CHAIN = 0  # choice code: F_all i then the rest; -k: the same with the i's choice k; a positive j: a leaf
NONE = -(2**62)  # no choice fits


@dataclass(frozen=True)
class RotorArrays:
    """Per-index arrays (length L+2 for sizes of activations, L+1 for stages)."""

    x: np.ndarray  # x[i]: size of a_i and δ_i; x[L+1] = 0
    xbar: np.ndarray  # xbar[i+1]: ā_{i+1} kept by F_all i; xbar[0] = xbar[L+1] = 0
    xown: np.ndarray  # xown[i+1]: ā_{i+1} once δ_{i+1} exists (own_saved_bytes), as xbar
    fwd_tmp: np.ndarray  # per stage (forward with autograd), loss 0
    nograd_tmp: np.ndarray  # per stage (forward without autograd), loss 0
    bwd_tmp: np.ndarray  # per stage, loss tmp last
    params: np.ndarray  # parameter gradients per stage, loss 0 (np.diff of param_prefix)
    param_prefix: np.ndarray  # param_prefix[k] = sum of params[:k]; param_prefix[-1] - param_prefix[k] is the
    # suffix k.. rounded up as a whole
    fwd_time: np.ndarray  # seconds, loss 0
    bwd_time: np.ndarray  # seconds, loss backward last
    # The ways to run F_all i and the B after it, row k (K rows; row 0 the stage itself, the arrays above; row
    # k > 0 the stage's option k-1, a stage with fewer options repeating row 0): as xbar, xown, fwd_tmp,
    # bwd_tmp, fwd_time and bwd_time.
    ways_xbar: np.ndarray
    ways_xown: np.ndarray
    ways_fwd_tmp: np.ndarray
    ways_bwd_tmp: np.ndarray
    ways_fwd_time: np.ndarray
    ways_bwd_time: np.ndarray

    @property
    def ways(self) -> tuple:
        """The six per-way arrays, in the kernels' argument order."""
        return (self.ways_xbar, self.ways_xown, self.ways_fwd_tmp, self.ways_bwd_tmp, self.ways_fwd_time,
                self.ways_bwd_time)

    @property
    def length(self) -> int:
        return len(self.fwd_time) - 1


def rotor_arrays(chain: Chain, unit: int = 1, options: bool = False) -> RotorArrays:
    """Arrays for ``chain`` with every size rounded up to whole ``unit`` bytes; with ``options``, one way per
    stage option besides the stage itself (else the stage alone).

    A chain whose sizes add up beyond :data:`planner.validate.MAX_BYTES` (one built in Python: a loaded one is
    refused before) is refused in one line: numpy's 64-bit sums would overflow, silently or not."""
    validate.total_bytes([chain.input_bytes, chain.loss.tmp_bytes] + [
        size for s in chain.stages for size in (s.out_bytes, s.saved_bytes, s.fwd_tmp_bytes, s.nograd_tmp_bytes,
                                                s.bwd_tmp_bytes, s.param_bytes)]
                        + [size for s in chain.stages for o in s.options if options
                           for size in (o.saved_bytes, o.fwd_tmp_bytes, o.bwd_tmp_bytes)], f"chain '{chain.name}'")

    def units(values):
        return -(-np.asarray(values, dtype=np.int64) // unit)

    stages = chain.stages
    # Parameter gradients are only ever held as a suffix: those of every stage after the last backward run.
    # Rounding the bytes of each suffix up (not each stage's) keeps every held set conservative with at most
    # one unit lost in all, where rounding stage by stage lost up to a unit per stage: at L stages and a unit
    # of budget // L or more, that was the whole budget (issue 19).
    suffix = np.cumsum([0] + [s.param_bytes for s in reversed(stages)])[::-1]  # suffix[k]: stages k..L-1
    suffix_units = units(np.append(suffix, 0))  # index L+1: the loss has none
    param_prefix = (suffix_units[0] - suffix_units).astype(np.int64)
    params = np.diff(param_prefix)
    count = 1 + max((len(s.options) for s in stages), default=0) if options else 1
    ways = [[s.running(k - 1 if 0 < k <= len(s.options) else None) for s in stages] for k in range(count)]
    return RotorArrays(
        x=units([chain.input_bytes] + [s.out_bytes for s in stages] + [0]),
        xbar=units([0] + [s.saved_bytes for s in stages] + [0]),
        xown=units([0] + [s.own_saved_bytes for s in stages] + [0]),
        fwd_tmp=units([s.fwd_tmp_bytes for s in stages] + [0]),
        nograd_tmp=units([s.nograd_tmp_bytes for s in stages] + [0]),
        bwd_tmp=units([s.bwd_tmp_bytes for s in stages] + [chain.loss.tmp_bytes]),
        params=params,
        param_prefix=param_prefix,
        fwd_time=np.array([s.fwd_time for s in stages] + [0.0]),
        bwd_time=np.array([s.bwd_time for s in stages] + [chain.loss.bwd_time]),
        ways_xbar=np.stack([units([0] + [s.saved_bytes for s in way] + [0]) for way in ways]),
        ways_xown=np.stack([units([0] + [s.own_saved_bytes for s in way] + [0]) for way in ways]),
        ways_fwd_tmp=np.stack([units([s.fwd_tmp_bytes for s in way] + [0]) for way in ways]),
        ways_bwd_tmp=np.stack([units([s.bwd_tmp_bytes for s in way] + [chain.loss.tmp_bytes]) for way in ways]),
        ways_fwd_time=np.stack([np.array([s.fwd_time for s in way] + [0.0]) for way in ways]),
        ways_bwd_time=np.stack([np.array([s.bwd_time for s in way] + [chain.loss.bwd_time]) for way in ways]),
    )


def forward_all(arrays: RotorArrays, i: int, code: int):
    """``(Op F_all i, units it keeps)`` for the chain choice ``code`` (0, or -k for way k) of stage ``i``."""
    way = -int(code)
    return Op("F_all", i, option=way - 1 if way else None), int(arrays.ways_xbar[way, i + 1])


def build_schedule(arrays: RotorArrays, choose, top: int) -> tuple:
    """The schedule that ``choose(i, end, m) -> CHAIN | -k | j`` describes for the whole chain from ``top``
    units (``choose(i, i, m)`` gives the way of a single stage: CHAIN or -k).

    Sub-chain ``i..end`` with ``m`` units: *chain* is ``F_all i`` (with way k),
    then ``i+1..end`` in ``m − x̄_{i+1}``, then ``B i``; *leaf j* is ``F_ck i``,
    ``F_none i+1..j−1``, then ``j..end`` in ``m − x_j``, then ``i..j−1`` in
    ``m`` minus the parameter gradients of ``j..end``.
    """
    length = arrays.length
    ops = []
    tasks = [(0, length, top)]  # worked through last in, first out; an Op is emitted as it is popped
    while tasks:
        task = tasks.pop()
        if isinstance(task, Op):
            ops.append(task)
            continue
        i, end, m = task
        if i == end:
            ops.extend([Op("Loss")] if i == length else [forward_all(arrays, i, choose(i, i, m))[0], Op("B", i)])
            continue
        choice = int(choose(i, end, m))
        if choice <= CHAIN:
            forward, kept = forward_all(arrays, i, choice)
            ops.append(forward)
            tasks.append(Op("B", i))
            tasks.append((i + 1, end, m - kept))
        else:
            ops.append(Op("F_ck", i))
            ops.extend(Op("F_none", k) for k in range(i + 1, choice))
            later_params = int(arrays.param_prefix[end + 1] - arrays.param_prefix[choice])
            tasks.append((i, choice - 1, m - later_params))
            tasks.append((choice, end, m - int(arrays.x[choice])))
    return tuple(ops)
