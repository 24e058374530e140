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

CHAIN = 0  # choice code: F_all i then the rest; a positive code j is a leaf (advance to a_j); -1 none


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

    @property
    def length(self) -> int:
        return len(self.fwd_time) - 1


def rotor_arrays(chain: Chain, unit: int = 1) -> RotorArrays:
    """Arrays for ``chain`` with every size rounded up to whole ``unit`` bytes.

    A chain whose sizes add up beyond :data:`planner.validate.MAX_BYTES` (one built in Python: a loaded one is
    refused before) is refused in one line: numpy's 64-bit sums would overflow, silently or not."""
    validate.total_bytes([chain.input_bytes, chain.loss.tmp_bytes] + [
        size for s in chain.stages for size in (s.out_bytes, s.saved_bytes, s.fwd_tmp_bytes, s.nograd_tmp_bytes,
                                                s.bwd_tmp_bytes, s.param_bytes)], f"chain '{chain.name}'")

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
    )


def build_schedule(arrays: RotorArrays, choose, top: int) -> tuple:
    """The schedule that ``choose(i, end, m) -> CHAIN | j`` describes for the whole chain from ``top`` units.

    Sub-chain ``i..end`` with ``m`` units: *chain* is ``F_all i``, then
    ``i+1..end`` in ``m − x̄_{i+1}``, then ``B i``; *leaf j* is ``F_ck i``,
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
            ops.extend([Op("Loss")] if i == length else [Op("F_all", i), Op("B", i)])
            continue
        choice = int(choose(i, end, m))
        if choice == CHAIN:
            ops.append(Op("F_all", i))
            tasks.append(Op("B", i))
            tasks.append((i + 1, end, m - int(arrays.xbar[i + 1])))
        else:
            ops.append(Op("F_ck", i))
            ops.extend(Op("F_none", k) for k in range(i + 1, choice))
            later_params = int(arrays.param_prefix[end + 1] - arrays.param_prefix[choice])
            tasks.append((i, choice - 1, m - later_params))
            tasks.append((choice, end, m - int(arrays.x[choice])))
    return tuple(ops)
