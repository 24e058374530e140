"""The graph simulator: replays a graph schedule and predicts its peak bytes and seconds; graph schedules.

It is the judge of every graph solver, as planner/simulate/chain.py is for chains; its rules (``compute v``,
``free v``, the end state) are in docs/model.md, "The graph simulator". :class:`GraphSimulator` follows the
protocol of :func:`planner.simulate.replay.run`. :func:`schedule_with_frees` turns an order of computations
into a schedule that frees each value as early as it can.
"""

from typing import NamedTuple

from planner.graph import Graph
from planner.ops import GraphOp
from planner.simulate.replay import ScheduleError, SimResult, run


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

    def check_complete(self, state: GraphState) -> None:
        """Raise :class:`ScheduleError` unless every node has been computed."""
        if state.computed != self.full_mask:
            missing = next(i for i in range(self.graph.size) if not state.computed >> i & 1)
            raise ScheduleError(f"schedule ends before node {missing} ({self.graph.nodes[missing].name}) is computed")

    def run(self, schedule) -> SimResult:
        """Replay a whole schedule; an invalid one raises :class:`ScheduleError` naming the operation.

        The timeline holds one :class:`planner.simulate.replay.Step` per operation
        (memory in bytes, ``fixed_bytes`` included; start and end in seconds).
        """
        return run(self, schedule, "operation {index}")[1]


def schedule_with_frees(graph: Graph, order) -> tuple:
    """The operations that compute the nodes in ``order`` (node indices, repeats allowed), each value freed eagerly.

    A computed value is freed right after the last computation that reads it
    before the value is computed again (right after it is made when nothing
    reads it then); ``keep`` values are never freed. No schedule computing in
    this order holds less at any point. Frees after one computation come in
    ascending node order.
    """
    order = list(order)
    next_compute = [None] * len(order)  # position of the next computation of the same node
    seen = {}
    for position in reversed(range(len(order))):
        next_compute[position] = seen.get(order[position])
        seen[order[position]] = position
    last_read = {}  # position of a computation -> position of the last read of its value (itself if none)
    made_at = {}  # node -> position of the computation whose value is resident
    for position, v in enumerate(order):
        for dep in graph.nodes[v].deps:
            if dep in made_at:
                last_read[made_at[dep]] = position
        made_at[v] = position
        last_read[position] = position
    frees = [[] for _ in order]
    for position, v in enumerate(order):
        if graph.nodes[v].keep and next_compute[position] is None:
            continue
        frees[last_read[position]].append(v)
    ops = []
    for position, v in enumerate(order):
        ops.append(GraphOp("compute", v))
        ops.extend(GraphOp("free", u) for u in sorted(frees[position]))
    return tuple(ops)


def store_all_graph_schedule(graph: Graph) -> tuple:
    """Compute every node once in index order, freeing each non-``keep`` value right after its last consumer."""
    return schedule_with_frees(graph, range(graph.size))
