"""A save-only graph plan from a choice of forward values to recompute (no torch).

A save-only plan only chooses which forward values to keep for the backward; it can run under a
``torch.utils.checkpoint`` selective-checkpoint policy (:func:`planner.execute.selective.selective_policy`,
:func:`planner.execute.selective.is_save_plan`) as well as on the graph executor.
"""

from planner.errors import MemschedError
from planner.graph import Graph
from planner.plan import Plan, Predicted
from planner.simulate.graph import GraphSimulator, schedule_with_frees


def save_only_plan(graph: Graph, recompute, budget_bytes: int = None) -> Plan:
    """The save-only plan keeping every forward value but those in ``recompute`` (forward node indices).

    The forward nodes run once in index order, each value freed after its last
    use; then the backward nodes in index order, each preceded by the
    recomputation (once, in index order) of the nodes of ``recompute`` it needs,
    directly or through other recomputed nodes. A node of ``recompute`` that no
    backward node needs is freed after the forward and not recomputed.
    Frees are eager (:func:`planner.simulate.graph.schedule_with_frees`), so a value a
    recomputation reads is kept. ``budget_bytes`` defaults to the plan's peak.
    """
    dropped = set(recompute)
    for v in dropped:
        if not 0 <= v < graph.size or graph.nodes[v].backward or graph.nodes[v].keep:
            raise MemschedError(f"node {v} cannot be recomputed: give indices of forward nodes that are not kept "
                                f"(0 to {graph.size - 1}, not backward, not keep)")
    order = [v for v, node in enumerate(graph.nodes) if not node.backward]
    redone = set()

    def needed(v, into):
        for dep in graph.nodes[v].deps:
            if dep in dropped and dep not in redone and dep not in into:
                into.add(dep)
                needed(dep, into)

    for b, node in enumerate(graph.nodes):
        if node.backward:
            wanted = set()
            needed(b, wanted)
            order.extend(sorted(wanted))
            redone |= wanted
            order.append(b)
    schedule = schedule_with_frees(graph, order)
    result = GraphSimulator(graph).run(schedule)
    budget = result.peak_bytes if budget_bytes is None else budget_bytes
    if result.peak_bytes > budget:
        raise MemschedError(f"the save-only plan peaks at {result.peak_bytes} bytes, above the budget {budget} bytes; "
                            "recompute more values or raise the budget")
    return Plan(problem_name=graph.name, fingerprint=graph.fingerprint(), solver="save",
                params={"recompute": sorted(dropped)}, budget_bytes=budget,
                predicted=Predicted(peak_bytes=result.peak_bytes, time=result.time, baseline_time=graph.compute_time),
                schedule=schedule, optimal=False, kind="graph")
