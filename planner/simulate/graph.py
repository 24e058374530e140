"""The graph simulator: replays a graph schedule and predicts its peak memory and time.

It is the judge of every graph solver, as planner/simulate/chain.py is for chains.
A schedule is a sequence of :class:`planner.plan.GraphOp`; with ``resident``
the values held between operations and ``fixed`` the graph's ``fixed_bytes``:

* ``compute v``: every dependency of ``v`` must be resident and ``v`` must not
  be; while it runs, memory is ``fixed + Σ out_bytes(resident) + out_bytes(v) +
  tmp_bytes(v)``; afterwards ``v`` is resident. It takes ``time(v)`` seconds.
* ``free v``: ``v`` must be resident and not ``keep``; it takes no time and
  allocates nothing.
* At the end every node has been computed at least once (so every ``keep``
  value, never freed, is resident).

The peak is the largest memory over the computations and the end state; the
time is the sum of the computations' times.
"""

from typing import NamedTuple

from planner.graph import Graph
from planner.ops import GraphOp
from planner.plan import Plan, check_graph_plan_matches
from planner.simulate.chain import ScheduleError, SimResult, replay


class GraphState(NamedTuple):
    """Between two operations: resident values and values computed at least once (bit masks over node
    indices), and resident bytes, ``fixed_bytes`` included."""

    resident: int
    computed: int
    memory: int


class GraphSimulator:
    """Replays operations on one graph; :meth:`step` is also used by exhaustive searches."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.dep_masks = [sum(1 << d for d in node.deps) for node in graph.nodes]
        self.full_mask = (1 << graph.size) - 1

    def initial_state(self) -> GraphState:
        """Nothing but the fixed bytes is resident."""
        return GraphState(resident=0, computed=0, memory=self.graph.fixed_bytes)

    def is_complete(self, state: GraphState) -> bool:
        """True once every node has been computed (``keep`` values, never freed, are then resident)."""
        return state.computed == self.full_mask

    def step(self, state: GraphState, op: GraphOp):
        """Apply ``op`` to ``state``; return ``(new_state, peak_bytes, seconds)`` or raise ``ValueError``."""
        v = op.node
        if not 0 <= v < self.graph.size:
            raise ValueError(f"node must be between 0 and {self.graph.size - 1}")
        node = self.graph.nodes[v]
        bit = 1 << v
        if op.kind == "compute":
            missing = self.dep_masks[v] & ~state.resident
            if missing:
                dep = (missing & -missing).bit_length() - 1
                raise ValueError(f"dep {dep} ({self.graph.nodes[dep].name}) is not resident")
            if state.resident & bit:
                raise ValueError(f"node {v} ({node.name}) is already resident")
            memory = state.memory + node.out_bytes
            return GraphState(state.resident | bit, state.computed | bit, memory), memory + node.tmp_bytes, node.time
        if op.kind == "free":
            if not state.resident & bit:
                raise ValueError(f"node {v} ({node.name}) is not resident")
            if node.keep:
                raise ValueError(f"node {v} ({node.name}) is a keep value; it stays until the step ends")
            return GraphState(state.resident & ~bit, state.computed, state.memory - node.out_bytes), state.memory, 0.0
        raise ValueError(f"unknown operation {op.kind!r}")

    def run(self, schedule) -> SimResult:
        """Replay a whole schedule; an invalid one raises :class:`ScheduleError` naming the operation.

        The timeline holds one :class:`planner.simulate.chain.Step` per operation
        (memory in bytes, ``fixed_bytes`` included; start and end in seconds).
        """
        state, result = replay(self.initial_state(), self.step, schedule, "operation {index}")
        if state.computed != self.full_mask:
            missing = next(i for i in range(self.graph.size) if not state.computed >> i & 1)
            raise ScheduleError(f"schedule ends before node {missing} ({self.graph.nodes[missing].name}) is computed")
        return result


def simulate_graph(graph: Graph, plan_or_schedule) -> SimResult:
    """Peak bytes, total seconds and per-operation timeline of a graph plan (checked against ``graph``) or schedule."""
    if isinstance(plan_or_schedule, Plan):
        check_graph_plan_matches(plan_or_schedule, graph)
        schedule = plan_or_schedule.schedule
    else:
        schedule = plan_or_schedule
    return GraphSimulator(graph).run(schedule)
