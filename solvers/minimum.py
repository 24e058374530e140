"""The least memory any schedule needs: the smallest feasible budget, exactly, in bytes.

Same structure as Rotor's recurrence (solvers/rotor.py) with the time
replaced by the peak: ``need[i, e]`` is the least memory, besides ``a_i`` and
the parameter gradients of stages after ``e``, that processing stages
``i..e`` requires with ``δ_{e+1}`` held. No discretisation, so the result is
exact; budgets below it have no schedule at all.
"""

import numpy as np

from planner.chain import Chain
from solvers.rotor_model import rotor_arrays


def minimum_budget(chain: Chain) -> int:
    """Bytes: the peak of the least-memory schedule for ``chain`` (the input included)."""
    a = rotor_arrays(chain)
    length = chain.length
    x, xbar, fwd_tmp, prefix = a.x, a.xbar, a.fwd_tmp, a.param_prefix
    backward_need = x[:-1] + x[1:] + xbar[1:] + a.params + a.bwd_tmp  # B i (or the loss): δ_i, δ_{i+1}, ā_{i+1}
    forward_step = np.concatenate([x[:-2] + x[1:-1] + fwd_tmp[:-1], [0]])  # a_k, a_{k+1} and F k's temporaries
    need = np.zeros((length + 1, length + 1), dtype=np.int64)
    for i in range(length + 1):
        need[i, i] = max(x[i + 1] + xbar[i + 1] + fwd_tmp[i], backward_need[i])
    for span in range(1, length + 1):
        for i in range(length + 1 - span):
            end = i + span
            held = x[end + 1]
            chain_option = max(held + xbar[i + 1] + fwd_tmp[i], xbar[i + 1] + need[i + 1, end],
                               backward_need[i] + prefix[end + 1] - prefix[i + 1])
            js = np.arange(i + 1, end + 1)
            # Forwards from a_i up to a_j: F_ck i, then F_none k for i < k < j.
            first = x[i + 1] + fwd_tmp[i]
            forwards = held + np.maximum.accumulate(np.concatenate([[first], forward_step[i + 1:end]]))
            leaf_options = np.maximum.reduce([forwards, x[js] + need[js, end],
                                              prefix[end + 1] - prefix[js] + need[i, js - 1]])
            need[i, end] = min(chain_option, int(leaf_options.min()))
    return int(x[0] + need[0, length])
