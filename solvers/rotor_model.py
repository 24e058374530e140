"""The chain as integer arrays for the Rotor recurrences (shared by every implementation).

Index ``i`` runs over stages 0..L, stage ``L`` being the loss (no forward, no
output). Sizes are in *units*: bytes divided by ``unit`` and rounded up, so a
schedule that fits in units fits in bytes.
"""

from dataclasses import dataclass

import numpy as np

from planner.chain import Chain


@dataclass(frozen=True)
class RotorArrays:
    """Per-index arrays (length L+2 for sizes of activations, L+1 for stages)."""

    x: np.ndarray  # x[i]: size of a_i and δ_i; x[L+1] = 0
    xbar: np.ndarray  # xbar[i+1]: ā_{i+1} kept by F_all i; xbar[0] = xbar[L+1] = 0
    fwd_tmp: np.ndarray  # per stage, loss 0
    bwd_tmp: np.ndarray  # per stage, loss tmp last
    params: np.ndarray  # parameter gradients per stage, loss 0
    param_prefix: np.ndarray  # param_prefix[k] = sum of params[:k]
    fwd_time: np.ndarray  # seconds, loss 0
    bwd_time: np.ndarray  # seconds, loss backward last

    @property
    def length(self) -> int:
        return len(self.fwd_time) - 1


def rotor_arrays(chain: Chain, unit: int = 1) -> RotorArrays:
    """Arrays for ``chain`` with every size rounded up to whole ``unit`` bytes."""

    def units(values):
        return -(-np.asarray(values, dtype=np.int64) // unit)

    stages = chain.stages
    params = units([s.param_bytes for s in stages] + [0])
    return RotorArrays(
        x=units([chain.input_bytes] + [s.out_bytes for s in stages] + [0]),
        xbar=units([0] + [s.saved_bytes for s in stages] + [0]),
        fwd_tmp=units([s.fwd_tmp_bytes for s in stages] + [0]),
        bwd_tmp=units([s.bwd_tmp_bytes for s in stages] + [chain.loss.tmp_bytes]),
        params=params,
        param_prefix=np.concatenate([[0], np.cumsum(params)]).astype(np.int64),
        fwd_time=np.array([s.fwd_time for s in stages] + [0.0]),
        bwd_time=np.array([s.bwd_time for s in stages] + [chain.loss.bwd_time]),
    )
