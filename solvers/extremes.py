"""The extreme schedules of a chain and of a graph, and the least memory any graph schedule needs.

* ``store_all`` (chain), :func:`store_all_graph`: every forward with autograd, then every backward (each graph
  node once, in index order): no recomputation, the largest useful budget.
* ``recompute_all``: keep only the input; before each backward, recompute the chain from the input up to that
  stage (Revolve with one snapshot): the smallest memory of any schedule that holds at most one checkpoint.
* :func:`graph_lower_bound`: bytes no graph schedule can go below.
"""

from planner.chain import Chain
from planner.graph import Graph
from planner.ops import Op
from planner.simulate.graph import store_all_graph_schedule
from solvers.result import Solution


def store_all_schedule(length: int) -> tuple:
    """``F_all 0..L-1, Loss, B L-1..0``."""
    return (*(Op("F_all", i) for i in range(length)), Op("Loss"), *(Op("B", i) for i in reversed(range(length))))


def store_all(chain: Chain, budget: int) -> Solution:
    """Store everything; optimal (no recomputation) whenever it fits."""
    return Solution(store_all_schedule(chain.length), optimal=True)


def recompute_all(chain: Chain, budget: int) -> Solution:
    """Recompute from the input before every backward: quadratic time, minimal checkpoint memory."""
    schedule = []
    for target in reversed(range(chain.length)):
        if target > 0:
            schedule.append(Op("F_ck", 0))
            schedule.extend(Op("F_none", k) for k in range(1, target))
        schedule.append(Op("F_all", target))
        if target == chain.length - 1:
            schedule.append(Op("Loss"))
        schedule.append(Op("B", target))
    return Solution(tuple(schedule))


def store_all_graph(graph: Graph, budget: int) -> Solution:
    """Every node once, in index order, each value freed after its last consumer: optimal whenever it fits."""
    return Solution(store_all_graph_schedule(graph), optimal=True, gap=0.0)


def graph_lower_bound(graph: Graph) -> int:
    """Bytes no schedule can go below: ``fixed_bytes`` plus the largest of every ``keep`` value together (they are
    all resident at the end) and, for each node, its dependencies, its output and its temporary (resident while
    it runs). A bound, not always attained."""
    keep = sum(node.out_bytes for node in graph.nodes if node.keep)
    running = max(node.out_bytes + node.tmp_bytes + sum(graph.nodes[d].out_bytes for d in node.deps)
                  for node in graph.nodes)
    return graph.fixed_bytes + max(keep, running)
