"""The graph executor: runs a graph plan's schedule in a real training step, exactly, and nothing else.

``GraphExecutor(model, plan, graph)`` re-captures the model's joint forward+backward graph (planner/execute/
capture.py, grouped into the same nodes the profile measured), checks that it is the graph the plan was solved
for (:func:`check_same_graph`), and ``step(*inputs)`` runs one training step by the plan: ``compute v`` runs
node v's operations without autograd (the backward is part of the graph) and keeps its value, ``free v`` drops
the value, so the memory follows planner/simulate/graph.py. The step is the unmodified model's: dropout masks,
BatchNorm statistics and gradients as in the plain step; the loss is returned. How: docs/execution.md
("Graph executor"). This module does not import the solvers: plans come in, steps go out.
"""

import torch

from planner.errors import MemschedError
from planner.execute.autograd import accumulate_grads, rng_state, set_rng_state
from planner.execute.capture import GroupRun, JointGraph, capture
from planner.execute.stages import StagedModel
from planner.graph import Graph
from planner.plan import Plan
from planner.simulate import simulate


class GraphExecutor:
    """Runs ``model``'s training step by a graph ``plan`` solved for ``graph`` (see the module docstring).

    ``model``: a :class:`planner.execute.stages.StagedModel` (its example inputs and loss are used unless given),
    or the module or stages given to :func:`profiles.graph_profiler.profile_graph`, with the same
    ``example_inputs`` and ``loss_fn``. Tensors the loss closes over (targets) are constants of the captured
    graph: a step reads their current contents, never other tensors.
    """

    def __init__(self, model, plan: Plan, graph: Graph, example_inputs=None, loss_fn=None):
        model = StagedModel.of(model, example_inputs, loss_fn, user="GraphExecutor")
        simulate(graph, plan)  # the plan is for this graph and its schedule is valid
        self.plan, self.graph = plan, graph
        self.joint = capture(model, nodes=graph.size)
        check_same_graph(self.joint, graph)
        computes = [op.node for op in plan.schedule if op.kind == "compute"]
        firsts = list(dict.fromkeys(computes))
        randoms = [v for v in firsts if graph.nodes[v].random]
        for earlier, later in zip(randoms, randoms[1:]):
            if earlier > later:
                raise MemschedError(f"the plan first computes random node {earlier} before random node {later}; random "
                                    "nodes must first run in index order (the eager step's dropout masks); solve again")
        self.replayed = {v for v in set(computes) if graph.nodes[v].random and computes.count(v) > 1}
        self.example_inputs = self.joint.example_inputs
        self.loss_group = self.joint.group_of[self.joint.loss_node]

    def step(self, *inputs) -> torch.Tensor:
        """One training step by the plan on ``inputs`` (default: the example inputs); returns the loss."""
        loss, parameters, grads = self.gradients(*inputs)
        accumulate_grads(parameters, grads)
        return loss

    def gradients(self, *inputs) -> tuple:
        """:meth:`step` without writing ``.grad``: ``(loss, parameters, gradients)``, a gradient per parameter that
        the step gives one (the caller accumulates them, as :func:`profiles.fit_graph` does in the backward)."""
        inputs = inputs or self.example_inputs
        if len(inputs) != len(self.example_inputs) or any(
                not isinstance(t, torch.Tensor) or t.shape != e.shape or t.dtype != e.dtype
                for t, e in zip(inputs, self.example_inputs)):
            raise MemschedError("step() takes tensors of the example inputs' shapes and dtypes "
                                f"({', '.join(f'{tuple(e.shape)} {e.dtype}' for e in self.example_inputs)})")
        run = GroupRun(self.joint, self.joint.fixed_values(inputs))
        states = {}
        devices = [self.joint.device] if self.joint.device.type == "cuda" else []
        for op in self.plan.schedule:
            v = op.node
            if op.kind == "free":
                run.free(v)
            elif v in self.replayed and v in states:
                with torch.random.fork_rng(devices=devices):
                    set_rng_state(states[v])
                    run.compute(v)
            else:
                if v in self.replayed:
                    states[v] = rng_state()
                run.compute(v)
        loss = run.values[self.loss_group][self.joint.loss_node]
        parameters, grads = [], []
        for node, name in self.joint.param_grads.items():
            parameter = self.joint.module.get_parameter(name)
            parameters.append(parameter)
            grads.append(run.values[self.joint.group_of[node]][node])
        run.values.clear()
        return loss, parameters, grads


def check_same_graph(joint: JointGraph, graph: Graph) -> None:
    """The re-captured step must be the graph's: the same fixed bytes (so the same parameter and input sizes) and
    groups matching its nodes in names, dependencies, parameters, keep and random."""
    mismatch = "the plan was solved for another graph"
    if len(joint.groups) != graph.size:
        raise MemschedError(f"{mismatch}: this model's captured step has {len(joint.groups)} nodes, the plan's graph "
                            f"'{graph.name}' {graph.size}; "
                            f"profile this model (memsched profile SPEC --graph) and solve again")
    if joint.fixed_bytes != graph.fixed_bytes:
        raise MemschedError(f"{mismatch}: its parameters, buffers and inputs take {graph.fixed_bytes} bytes, "
                            f"this model's "
                            f"{joint.fixed_bytes} (another batch size or width?); profile this model and solve again")
    for index, (group, node) in enumerate(zip(joint.groups, graph.nodes)):
        ours = (group.name, tuple(group.deps), tuple(group.params), group.keep, group.random)
        theirs = (node.name, tuple(node.deps), tuple(node.params), node.keep, node.random)
        if ours != theirs:
            field = next(f for f, a, b in zip(("name", "deps", "params", "keep", "random"), ours, theirs) if a != b)
            raise MemschedError(f"{mismatch}: node {index} differs in {field} "
                                f"({theirs[0]!r} in the graph '{graph.name}', "
                                f"{ours[0]!r} in this model's captured step); profile this model and solve again")
