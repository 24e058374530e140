"""Rotor's recurrence in plain Python loops: the benchmark's baseline and the tests' second opinion.

Exactly the recurrence of :mod:`solvers.rotor` (same choices, same tie rule:
a leaf wins ties, the first j among leaves), written for readability, with
no numpy and no compilation. Cubic in the chain length times the slot count.
"""

import math

from solvers.rotor_model import RotorArrays


def compute_table_plain(arrays: RotorArrays, top: int):
    """``opt[i][e][m]`` as nested lists (``math.inf`` where infeasible)."""
    x = [int(v) for v in arrays.x]
    xbar = [int(v) for v in arrays.xbar]
    xown = [int(v) for v in arrays.xown]
    fwd_tmp = [int(v) for v in arrays.fwd_tmp]
    nograd_tmp = [int(v) for v in arrays.nograd_tmp]
    bwd_tmp = [int(v) for v in arrays.bwd_tmp]
    prefix = [int(v) for v in arrays.param_prefix]
    fwd_time = [float(v) for v in arrays.fwd_time]
    bwd_time = [float(v) for v in arrays.bwd_time]
    length = len(fwd_time) - 1
    opt = [[[math.inf] * (top + 1) for _ in range(length + 1)] for _ in range(length + 1)]
    for i in range(length + 1):
        need = max(x[i + 1] + xbar[i + 1] + fwd_tmp[i], x[i] + x[i + 1] + xown[i + 1] + bwd_tmp[i])
        for m in range(need, top + 1):
            opt[i][i][m] = fwd_time[i] + bwd_time[i]
    for span in range(1, length + 1):
        for i in range(length + 1 - span):
            end = i + span
            held = x[end + 1]
            for m in range(top + 1):
                best = math.inf
                advance = 0.0
                forwards = held + x[i + 1] + nograd_tmp[i]  # F_ck i, then F_none k for i < k < j
                for j in range(i + 1, end + 1):
                    advance += fwd_time[j - 1]
                    if j > i + 1:
                        forwards = max(forwards, held + x[j - 1] + x[j] + nograd_tmp[j - 1])
                    later_params = prefix[end + 1] - prefix[j]
                    if m >= forwards and m >= x[j] and m >= later_params:
                        cost = advance + opt[j][end][m - x[j]] + opt[i][j - 1][m - later_params]
                        best = min(best, cost)
                chain_ok = (m >= xbar[i + 1] and m >= held + xbar[i + 1] + fwd_tmp[i]
                            and m - (prefix[end + 1] - prefix[i + 1]) >= x[i] + x[i + 1] + xown[i + 1] + bwd_tmp[i])
                if chain_ok:
                    best = min(best, fwd_time[i] + bwd_time[i] + opt[i + 1][end][m - xbar[i + 1]])
                opt[i][end][m] = best
    return opt
