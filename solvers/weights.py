"""Weight offload: stages whose parameters live on the host, brought in around each of their operations.

The ZeRO-Offload / FSDP CPU-offload pattern in the offload simulator's model: :func:`chosen_weight_stages`
parses the user's choice (``"all"`` or ``"0,3"``), :func:`place_weight_transfers` adds ``Prefetch``/``Release``
of each host-weight stage's weights around its runs of operations and ``Offload``/``Release`` of its gradients
after ``B i`` to any chain schedule, and :func:`weight_reserve` is what their parameters can hold on the device
at once (the two largest), which the caller subtracts from the budget before solving the rest. The placement is
a fixed policy: plans are judged by the simulator and never marked optimal. docs/solvers.md gives the rules.
"""

from planner.chain import Chain
from planner.errors import MemschedError
from planner.ops import TRANSFER_OPS, Op


def chosen_weight_stages(chain: Chain, weights) -> tuple:
    """Stage indices from ``weights``: ``"all"`` (every stage with parameters), or indices as a list or a
    comma-separated string; stages without parameters are left out (nothing to move)."""
    if weights == "all":
        chosen = range(chain.length)
    else:
        items = weights.split(",") if isinstance(weights, str) else weights
        try:
            chosen = sorted({int(str(item).strip()) for item in items})
        except (TypeError, ValueError):
            raise MemschedError(f"weights: give 'all' or stage indices like 0,3,5, got {weights!r}") from None
        bad = [i for i in chosen if not 0 <= i < chain.length]
        if bad:
            raise MemschedError(f"weights: stage {bad[0]} does not exist (chain '{chain.name}' has stages 0 to "
                                f"{chain.length - 1})")
    stages = tuple(i for i in chosen if chain.stages[i].param_bytes > 0)
    if not stages:
        raise MemschedError(f"weights: none of the stages chosen has parameters to move in chain '{chain.name}'")
    return stages


def weight_reserve(chain: Chain, stages) -> int:
    """Bytes the host-weight stages' parameters can hold on the device at once: the two largest."""
    sizes = sorted((chain.stages[i].param_bytes for i in stages), reverse=True)
    return sum(sizes[:2])


def place_weight_transfers(schedule, stages) -> tuple:
    """``schedule`` with the weight and gradient transfers of the host-weight ``stages`` (docs/solvers.md)."""
    stages = set(stages)
    positions = [p for p, op in enumerate(schedule) if op.kind not in TRANSFER_OPS]  # compute operations
    compute = [schedule[p] for p in positions]
    before = {k: [] for k in range(len(compute))}
    after = {k: [] for k in range(len(compute))}
    for k, op in enumerate(compute):
        stage = op.stage if op.kind != "Loss" else None
        if stage not in stages:
            continue
        if k == 0 or compute[k - 1].stage != stage or compute[k - 1].kind == "Loss":  # a run starts
            before[max(0, k - 1)].append(Op("Prefetch", stage, "weights"))
        if k + 1 == len(compute) or compute[k + 1].stage != stage or compute[k + 1].kind == "Loss":  # it ends
            after[k].append(Op("Release", stage, "weights"))
        if op.kind == "B":
            after[k].append(Op("Offload", stage, "grads"))
            after[min(k + 1, len(compute) - 1)].append(Op("Release", stage, "grads"))
    out, k = [], 0
    for op in schedule:
        if op.kind in TRANSFER_OPS:
            out.append(op)
            continue
        out.extend(before[k])
        out.append(op)
        out.extend(after[k])
        k += 1
    return tuple(out)
