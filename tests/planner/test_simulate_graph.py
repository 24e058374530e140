"""The graph simulator (planner/simulate/graph.py): memory and time of a graph schedule, and schedules refused."""

import pytest
from test_graph_format import small_graph

from planner.errors import MemschedError
from planner.ops import GraphOp
from planner.simulate.graph import GraphSimulator, schedule_with_frees, store_all_graph_schedule
from solvers import store_all_graph_peak


def test_store_all_schedule_and_simulation():
    graph = small_graph()
    schedule = store_all_graph_schedule(graph)
    assert [str(op) for op in schedule] == ["compute 0", "compute 1", "compute 2", "free 0", "compute 3", "free 1",
                                            "free 3"]
    result = GraphSimulator(graph).run(schedule)
    # b: 100 + a 10 + b 20 + tmp 5; c: 100 + 10 + 20 + 3; d: 100 + 20 + 3 + 7
    assert [step.peak for step in result.timeline if step.op.kind == "compute"] == [110, 135, 133, 130]
    assert result.peak_bytes == 135 and result.time == graph.compute_time == 3.75
    assert result.timeline[-1].memory_after == 103
    assert store_all_graph_peak(graph) == 135


def test_eager_frees_with_recomputation():
    graph = small_graph()
    ops = schedule_with_frees(graph, [0, 1, 0, 2, 3])  # the first copy of a is read by b only, then recomputed
    assert [str(op) for op in ops][:4] == ["compute 0", "compute 1", "free 0", "compute 0"]
    assert GraphSimulator(graph).run(ops).time == 4.75


@pytest.mark.parametrize("schedule, fragment", [
    ([GraphOp("compute", 1)], "operation 0 (compute 1): dep 0 (a) is not resident"),
    ([GraphOp("compute", 0), GraphOp("compute", 0)], "operation 1 (compute 0): node 0 (a) is already resident"),
    ([GraphOp("free", 0)], "operation 0 (free 0): node 0 (a) is not resident"),
    ([GraphOp("compute", 0), GraphOp("compute", 1), GraphOp("compute", 2), GraphOp("free", 2)],
     "operation 3 (free 2): node 2 (c) is a keep value"),
    ([GraphOp("compute", 0), GraphOp("compute", 1), GraphOp("compute", 2)], "ends before node 3 (d) is computed"),
    ([GraphOp("compute", 9)], "operation 0 (compute 9): node must be between 0 and 3"),
    ([GraphOp("run", 0)], "unknown operation 'run'"),
])
def test_invalid_schedules(schedule, fragment):
    with pytest.raises(MemschedError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        GraphSimulator(small_graph()).run(schedule)
