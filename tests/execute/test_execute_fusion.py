"""The fusion rules of the chain executor (planner/execute/fusion.py), without torch: which ``F_all`` continue a
graph, which ``B`` another one does, across transfers and host-weight stages; and where outputs are read last.

The schedule builders here are shared by the offload and host-weight executor tests.
"""

from planner.execute.fusion import fused_positions, output_releases
from planner.ops import TRANSFER_OPS, Op
from solvers.extremes import store_all_schedule

# --------------------------------------------------------------------------------------------------
# Schedules by hand


def store_all(length) -> tuple:
    return tuple([Op("F_all", i) for i in range(length)] + [Op("Loss")]
                 + [Op("B", i) for i in reversed(range(length))])


def store_all_offloaded(length: int, prefetch_ahead: bool = False) -> tuple:
    """Store-all with ``Offload i saved`` after ``F_all i``, ``Release i saved`` two forwards later and
    ``Prefetch i saved`` before ``B i+1`` (or, with ``prefetch_ahead``, every prefetch right after the loss),
    for every item released before the loss."""
    offloaded = range(length - 2)  # saved i is released after F_all i+2
    schedule = []
    for i in range(length):
        schedule.append(Op("F_all", i))
        if i in offloaded:
            schedule.append(Op("Offload", i, "saved"))
        if i - 2 in offloaded:
            schedule.append(Op("Release", i - 2, "saved"))
    schedule.append(Op("Loss"))
    if prefetch_ahead:
        schedule += [Op("Prefetch", i, "saved") for i in reversed(offloaded)]
    for i in reversed(range(length)):
        if not prefetch_ahead and i - 1 in offloaded:
            schedule.append(Op("Prefetch", i - 1, "saved"))
        schedule.append(Op("B", i))
    return tuple(schedule)


def with_host_weights(schedule, stages, ahead=1) -> tuple:
    """``schedule`` with the weights of ``stages`` on the host: before each run of consecutive compute operations
    of stage i, ``Prefetch i weights`` ``ahead`` compute operations earlier (0: right before); after it,
    ``Release i weights``; after ``B i``, ``Offload i grads``, released after the next compute operation. The
    schedule's own transfers stay after the compute operation they follow."""
    compute = [op for op in schedule if op.kind not in TRANSFER_OPS]

    def stage(c):
        return None if c < 0 or c >= len(compute) or compute[c].kind == "Loss" else compute[c].stage

    before, after = {}, {}
    for c, op in enumerate(compute):
        i = stage(c)
        if i not in stages:
            continue
        if stage(c - 1) != i:
            before.setdefault(max(0, c - ahead), []).append(Op("Prefetch", i, "weights"))
        if stage(c + 1) != i:
            after.setdefault(c, []).append(Op("Release", i, "weights"))
        if op.kind == "B":
            after.setdefault(c, []).append(Op("Offload", i, "grads"))
            after.setdefault(min(c + 1, len(compute) - 1), []).append(Op("Release", i, "grads"))
    out, c = [], 0
    for op in schedule:
        if op.kind in TRANSFER_OPS:
            out.append(op)
            continue
        out += before.get(c, []) + [op] + after.get(c, [])
        c += 1
    return tuple(out)


# --------------------------------------------------------------------------------------------------
# Without transfers


def test_the_store_all_schedule_runs_as_one_graph():
    schedule = store_all_schedule(4)  # F_all 0..3, Loss, B 3..0
    continued, absorbed, kept = fused_positions(schedule)
    assert [schedule[p] for p in sorted(continued)] == [Op("F_all", k) for k in (1, 2, 3)]
    assert [schedule[p] for p in sorted(absorbed)] == [Op("B", k) for k in (2, 1, 0)]
    assert [schedule[p] for p in sorted(kept)] == [Op("F_all", k) for k in (0, 1, 2)]


def test_fusion_stops_where_the_backwards_are_not_consecutive_or_a_stage_is_recomputed():
    schedule = (Op("F_ck", 0), Op("F_all", 1), Op("F_all", 2), Op("Loss"), Op("B", 2), Op("B", 1),
                Op("F_all", 0), Op("B", 0))
    continued, absorbed, _ = fused_positions(schedule)
    assert continued == {2} and absorbed == {5}  # F_all 2 on F_all 1; F_all 0 follows B 1, not F_all
    recomputed = (Op("F_all", 0), Op("F_all", 1), Op("F_ck", 1), Op("F_all", 2), Op("Loss"), Op("B", 2),
                  Op("B", 1), Op("B", 0))
    assert fused_positions(recomputed) == (set(), set(), set())  # stage 1 is run again inside the (0, 1) pair


def test_an_output_is_released_after_its_last_reader():
    # F_all 0's a_1 is read by F_all 1; F_all 1's a_2 by F_ck 2 and, after the loss, by F_all 2 (until B 1);
    # F_all 2, recomputed after the loss, has no later reader of a_3: released at once.
    schedule = (Op("F_all", 0), Op("F_all", 1), Op("F_ck", 2), Op("Loss"), Op("F_all", 2), Op("B", 2), Op("B", 1),
                Op("B", 0))
    assert output_releases(schedule, 3) == {1: [0], 4: [1, 2]}


# --------------------------------------------------------------------------------------------------
# Across transfers and host-weight stages


def test_fusion_across_transfers():
    # Store-all on 4 stages with every item offloaded and all prefetches before B 3: one graph throughout.
    schedule = store_all_offloaded(4, prefetch_ahead=True)
    continued, absorbed, kept = fused_positions(schedule)
    assert sorted(schedule[p] for p in continued) == [Op("F_all", k) for k in (1, 2, 3)]
    assert sorted(schedule[p] for p in absorbed) == [Op("B", k) for k in (0, 1, 2)]
    assert sorted(schedule[p] for p in kept) == [Op("F_all", k) for k in (0, 1, 2)]
    # Prefetching saved i just before B i+1: a call fusing stages 2 and 3 at B 3 would read saved 1 before
    # its prefetch (stage 2's input a_2 is in it), one fusing 1 and 2 at B 2 saved 0; stages 0 and 1 fuse.
    schedule = store_all_offloaded(4)
    continued, absorbed, _ = fused_positions(schedule)
    assert [schedule[p] for p in continued] == [Op("F_all", 1)]  # saved 0 is prefetched before B 1
    assert [schedule[p] for p in absorbed] == [Op("B", 0)]
    # A Release of the output the next stage continues on, between the two forwards, breaks the pair.
    schedule = (Op("F_all", 0), Op("Offload", 0, "saved"), Op("Release", 0, "saved"), Op("Prefetch", 0, "saved"),
                Op("F_all", 1), Op("Loss"), Op("B", 1), Op("B", 0))
    assert fused_positions(schedule) == (set(), set(), set())
    # Between two fused backwards, an Offload of another item keeps the pair; a Prefetch of another item
    # breaks it (the fused call would run B 2 before that allocation, not after it as the plan says).
    # (input 2, the first fused stage's input, is the group's own: an Offload of it breaks the pair too.)
    head = (Op("F_ck", 0), Op("F_ck", 1), Op("F_all", 2), Op("F_all", 3), Op("Loss"), Op("B", 3))
    tail = (Op("B", 2), Op("F_all", 1), Op("B", 1), Op("F_all", 0), Op("B", 0))
    for between, fused in (((Op("Offload", 1, "input"),), True), ((Op("Prefetch", 1, "input"),), False),
                           ((Op("Offload", 2, "input"),), False)):
        schedule = head + between + tail
        continued, absorbed, _ = fused_positions(schedule)
        assert [schedule[p] for p in continued] == ([Op("F_all", 3)] if fused else []), between
        assert [schedule[p] for p in absorbed] == ([Op("B", 2)] if fused else []), between


def test_no_fusion_with_a_host_weight_stage():
    # Store-all on 4 stages, every saved item prefetched after the loss, fuses into one graph (see
    # tests/execute/test_execute_offload.py); with stage 0's weights on the host (prefetched right before its
    # operations), stage 0 runs alone and stages 1..3 still fuse.
    schedule = with_host_weights(store_all_offloaded(4, prefetch_ahead=True), {0}, ahead=0)
    continued, absorbed, _ = fused_positions(schedule)
    assert sorted(schedule[p] for p in continued) == [Op("F_all", 2), Op("F_all", 3)]
    assert sorted(schedule[p] for p in absorbed) == [Op("B", 1), Op("B", 2)]
    # With every stage host-weight, nothing fuses.
    schedule = with_host_weights(store_all(4), {0, 1, 2, 3})
    assert fused_positions(schedule) == (set(), set(), set())


# --------------------------------------------------------------------------------------------------
# Runs merged for compiled plans


def parsed(text: str) -> tuple:
    """``"F_all 0, F_ck 1, Loss, B 1"`` as operations (``F_all 2/1``: with option 1)."""
    ops = []
    for item in text.split(", "):
        kind, *rest = item.split()
        stage, _, option = rest[0].partition("/") if rest else (None, "", "")
        ops.append(Op(kind, None if stage is None else int(stage), option=int(option) if option else None))
    return tuple(ops)


def test_runs_the_schedule_always_runs_together_are_merged():
    from planner.execute.fusion import merged_runs, merged_schedule

    schedule = parsed("F_all 0, F_ck 1, F_all 2/2, F_all 3/2, F_all 4/1, F_all 5, Loss, B 5, B 4, B 3, B 2, "
                      "F_all 1, B 1, B 0")
    runs = merged_runs(schedule, 6)
    assert runs == [(0, 0), (1, 1), (2, 5)]  # stage 0 then 1: F_all then F_ck, not together
    assert merged_schedule(schedule, runs) == parsed("F_all 0, F_ck 1, F_all 2, Loss, B 2, F_all 1, B 1, B 0")
    recomputed = parsed("F_ck 0, F_none 1, F_none 2, F_all 3, Loss, B 3, F_all 0/1, F_all 1, F_all 2, B 2, B 1, B 0")
    runs = merged_runs(recomputed, 4)
    assert runs == [(0, 2), (3, 3)]  # F_ck 0 + F_none 1 + F_none 2 is F_ck of the run
    assert merged_schedule(recomputed, runs) == parsed("F_ck 0, F_all 1, Loss, B 1, F_all 0, B 0")
    assert merged_runs(store_all(5), 5) == [(0, 4)]
    # F_ck i followed by F_ck i+1 keeps a_{i+1}: not one operation of a merged stage
    assert merged_runs(parsed("F_ck 0, F_ck 1, F_all 2, Loss, B 2, F_all 1, B 1, F_all 0, B 0"), 3) == [
        (0, 0), (1, 1), (2, 2)]


def test_merged_schedules_of_solved_plans_are_valid():
    from planner.execute.fusion import merged_runs, merged_schedule
    from planner.simulate import check_schedule
    from profiles.synthetic import random_chain
    from solvers import solve, store_all_peak
    from solvers.minimum import minimum_budget

    merged_some = 0
    for seed in range(30):
        chain = random_chain(8, seed, options=2)
        low, high = minimum_budget(chain, options=True), store_all_peak(chain)
        for budget in (low, (low + high) // 2, high):
            schedule = solve(chain, budget, "hierarchical").schedule
            runs = merged_runs(schedule, chain.length)
            assert [first for first, _ in runs] == [0] + [last + 1 for _, last in runs[:-1]]
            merged = merged_schedule(schedule, runs)
            check_schedule(merged, len(runs))
            firsts = {first for first, _ in runs}
            assert [op.kind for op in merged if op.kind != "B"] == [
                op.kind for op in schedule if op.kind == "Loss" or (op.kind != "B" and op.stage in firsts)]
            assert sum(op.kind == "B" for op in merged) == len(runs)
            merged_some += len(runs) < chain.length
    assert merged_some > 30
