"""Which operations of a chain schedule the executor runs as one autograd graph, and when an output is read last.

Pure functions over :class:`planner.ops.Op` (no torch), the rules of docs/execution.md ("Fusion"):
:func:`fused_positions` gives the ``F_all`` run on the previous stage's graph, the ``B`` done by a later one's
and the ``F_all`` whose output object is kept for it; :func:`output_releases` where each ``F_all`` output is read
for the last time.
"""

from planner.ops import FORWARD_OPS, TRANSFER_OPS, Op, host_weight_stages


def output_releases(schedule, length) -> dict:
    """``{position: [i, ...]}``: after the operation at ``position``, stage i's output is read no more.

    An ``F_all i`` output ``a_{i+1}`` is read by later forwards of stage i+1 (or by the loss when
    ``i+1 = L``) until ``B i``; after the last such read the executor keeps only stage i's graph.
    """
    releases = {}
    for start, op in enumerate(schedule):
        if op.kind != "F_all":
            continue
        last = start
        for position in range(start + 1, len(schedule)):
            later = schedule[position]
            if later.kind == "B" and later.stage == op.stage:
                break
            if ((later.kind in FORWARD_OPS and later.stage == op.stage + 1)
                    or (later.kind == "Loss" and op.stage + 1 == length)):
                last = position
        releases.setdefault(last, []).append(op.stage)
    return releases


def fused_positions(schedule) -> tuple:
    """``(continued, absorbed, kept)``: positions of the ``F_all i`` run on stage i-1's graph, of the ``B`` done
    with a later one, and of the ``F_all`` whose output object the next operation continues on.

    On the compute operations (transfers left out), ``F_all i`` at position p continues the graph of ``F_all i-1``
    at p-1 when its ``B i`` (the first after p) is directly followed by ``B i-1`` and no forward of stage i-1 or i
    runs between p and that ``B i``; the fused graph's backward runs at ``B i`` of its last stage, the ``B``s of its
    other stages only release. A host-weight stage never fuses, and a transfer between the two forwards or the two
    backwards breaks the pair where the fused graph would read an item or change memory at another time than the
    plan says (docs/execution.md). Positions are those of the whole schedule.
    """
    compute = [p for p, op in enumerate(schedule) if op.kind not in TRANSFER_OPS]
    ops = tuple(schedule[p] for p in compute)
    continued, absorbed, kept = set(), set(), set()
    start = {}  # compute index of a kept continued F_all -> the first stage of its group
    host_weights = host_weight_stages(schedule)
    for c, end in _consecutive(ops):
        upper = ops[c].stage
        lower = upper - 1
        if lower in host_weights or upper in host_weights:  # a host-weight stage always runs on its own
            continue
        first = start.get(c - 1, lower)
        forward_gap = schedule[compute[c - 1] + 1:compute[c]]
        backward_gap = schedule[compute[end] + 1:compute[end + 1]]
        broken = any(op.kind in ("Release", "Prefetch") and (op.what, op.stage) == ("saved", lower)
                     for op in forward_gap)
        broken = broken or any(op.kind != "Offload" or (first - 1 <= op.stage <= lower if op.what == "saved"
                                                        else first <= op.stage <= lower) for op in backward_gap)
        if broken:
            continue
        start[c] = first
        continued.add(compute[c])
        absorbed.add(compute[end + 1])
        kept.add(compute[c - 1])
    return continued, absorbed, kept


def _consecutive(ops) -> list:
    """``[(p, q), ...]`` in order of p: ``F_all i`` at p directly after ``F_all i-1``, its ``B i`` at q directly
    followed by ``B i-1``, and no forward of stage i-1 or i between p and q (transfers are not in ``ops``)."""
    backward_of = {}
    for start, op in enumerate(ops):
        if op.kind == "F_all":
            backward_of[start] = next((q for q in range(start + 1, len(ops)) if ops[q] == Op("B", op.stage)), None)
    pairs = []
    for position, op in enumerate(ops):
        if op.kind != "F_all" or position == 0 or ops[position - 1] != Op("F_all", op.stage - 1):
            continue
        end = backward_of[position]
        if end is None or end + 1 >= len(ops) or ops[end + 1] != Op("B", op.stage - 1):
            continue
        if any(later.kind in FORWARD_OPS and later.stage in (op.stage - 1, op.stage)
               for later in ops[position + 1:end]):
            continue
        pairs.append((position, end))
    return pairs


_FOLLOWER = {"F_all": "F_all", "F_ck": "F_none", "F_none": "F_none"}  # F_ck i, F_none i+1: F_ck of the two


def merged_runs(schedule, length) -> list:
    """``[(first, last), ...]``: the stages in order, in runs the schedule always runs together, so that a run
    can be one compiled call: stages i and i+1 are in one run when every forward of stage i is directly followed
    by one of stage i+1 (``F_all`` by ``F_all``, ``F_ck`` or ``F_none`` by ``F_none``), every ``B i+1`` directly
    by ``B i``, and stage i+1 has no other operation. For a schedule without transfers."""
    runs, first = [], 0
    for stage in range(length - 1):
        if not _together(schedule, stage):
            runs.append((first, stage))
            first = stage + 1
    runs.append((first, length - 1))
    return runs


def merged_schedule(schedule, runs) -> tuple:
    """``schedule`` over the ``runs`` of :func:`merged_runs` as stages: a run's forwards are those of its first
    stage (their kinds; the options of a run of several stages are its stages' business), its ``B`` that of
    its last."""
    by_first = {first: k for k, (first, _) in enumerate(runs)}
    by_last = {last: k for k, (_, last) in enumerate(runs)}
    merged = []
    for op in schedule:
        if op.kind == "Loss":
            merged.append(op)
        elif op.kind == "B" and op.stage in by_last:
            merged.append(Op("B", by_last[op.stage]))
        elif op.kind in FORWARD_OPS and op.stage in by_first:
            k = by_first[op.stage]
            merged.append(Op(op.kind, k, option=op.option if runs[k][0] == runs[k][1] else None))
    return tuple(merged)


def _together(schedule, stage) -> bool:
    lower = [p for p, op in enumerate(schedule) if op.stage == stage and op.kind != "Loss"]
    upper = [p for p, op in enumerate(schedule) if op.stage == stage + 1 and op.kind != "Loss"]
    if len(lower) != len(upper):
        return False
    for p in lower:
        op = schedule[p]
        if op.kind == "B":
            if p == 0 or schedule[p - 1] != Op("B", stage + 1):
                return False
        elif op.kind not in _FOLLOWER or p + 1 == len(schedule) or (
                schedule[p + 1].stage, schedule[p + 1].kind) != (stage + 1, _FOLLOWER[op.kind]):
            return False
    return True
