"""The graph problem: one training step as a DAG of forward and backward operations.

Nodes are listed in a topological order (every dependency has a smaller index). Node ``v`` produces one
value of ``out_bytes`` bytes in ``time`` seconds, reading the values of its ``deps``, with ``tmp_bytes``
transient bytes; ``fixed_bytes`` stay resident for the whole step, ``keep`` values until it ends, and
``random`` nodes keep their index order. The file format is ``memsched.graph/1`` (docs/formats.md); the
simulator that judges a schedule is planner/simulate/graph.py (rules in docs/model.md).
"""

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import planner.validate as validate
from planner.errors import MemschedError
from planner.jsonio import read_json, write_json_atomic
from planner.units import sum_seconds

GRAPH_FORMAT = "memsched.graph/1"
_GRAPH_FIELDS = ("format", "name", "device", "source", "fixed_bytes", "nodes")
_NODE_FIELDS = ("name", "time", "out_bytes", "tmp_bytes", "backward", "deps", "params", "random", "keep")
SOURCES = ("measured", "estimate", "synthetic")


@dataclass(frozen=True)
class GraphNode:
    """One operation of the step: seconds, bytes of its output and transient bytes, the nodes it reads."""

    name: str
    time: float
    out_bytes: int
    deps: tuple
    tmp_bytes: int = 0
    backward: bool = False
    params: tuple = ()
    random: bool = False
    keep: bool = False

    def to_dict(self) -> dict:
        return {"name": self.name, "time": self.time, "out_bytes": self.out_bytes, "tmp_bytes": self.tmp_bytes,
                "backward": self.backward, "deps": list(self.deps), "params": list(self.params),
                "random": self.random, "keep": self.keep}


@dataclass(frozen=True)
class Graph:
    """A validated graph problem. Build it with :meth:`from_dict`, :func:`load_graph`, or directly (then call
    :meth:`check`)."""

    name: str
    nodes: tuple
    fixed_bytes: int = 0
    device: str = "cpu"
    source: str = "measured"

    @property
    def size(self) -> int:
        """Number of nodes."""
        return len(self.nodes)

    @cached_property
    def consumers(self) -> tuple:
        """Per node, the indices of the nodes that read it, ascending."""
        users = [[] for _ in self.nodes]
        for index, node in enumerate(self.nodes):
            for dep in node.deps:
                users[dep].append(index)
        return tuple(tuple(u) for u in users)

    @property
    def compute_time(self) -> float:
        """Seconds of one step without recomputation: every node once, added in index order (as the
        simulator adds the store-all schedule, so both give the same float)."""
        return sum_seconds(node.time for node in self.nodes)

    def check(self, where: str = "graph") -> "Graph":
        """Validate a graph built in Python through its JSON form; return it."""
        Graph.from_dict(self.to_dict(), where)
        return self

    def to_dict(self) -> dict:
        """The ``memsched.graph/1`` JSON object (every field written out)."""
        return {"format": GRAPH_FORMAT, "name": self.name, "device": self.device, "source": self.source,
                "fixed_bytes": self.fixed_bytes, "nodes": [node.to_dict() for node in self.nodes]}

    def fingerprint(self) -> str:
        """``sha256:<hex>`` of the canonical JSON (sorted keys, no spaces): ties plans to this exact problem."""
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()

    @classmethod
    def from_dict(cls, data: dict, where: str = "graph") -> "Graph":
        """Validate a ``memsched.graph/1`` object; a bad field raises a one-line :class:`MemschedError`."""
        validate.document(data, "graph", 1, _GRAPH_FIELDS, where)
        name = validate.text(data.get("name", "graph"), f"{where}: name")
        device = validate.text(data.get("device", "cpu"), f"{where}: device")
        source = validate.text(data.get("source", "measured"), f"{where}: source")
        if source not in SOURCES:
            raise MemschedError(f"{where}: source must be one of {', '.join(SOURCES)}, got {source!r}")
        fixed = validate.non_negative_bytes(data.get("fixed_bytes", 0), f"{where}: fixed_bytes")
        raw_nodes = validate.require(data, "nodes", where)
        if not isinstance(raw_nodes, list) or not raw_nodes:
            raise MemschedError(f"{where}: nodes must be a non-empty list of node objects")
        validate.count(len(raw_nodes), f"{where}: the number of nodes", 1)
        nodes, names = [], {}
        for index, raw in enumerate(raw_nodes):
            node = _node_from_dict(raw, f"{where}: nodes[{index}]", index)
            if node.name in names:
                raise MemschedError(f"{where}: nodes[{index}].name {node.name!r} is also the name of "
                                    f"nodes[{names[node.name]}]; names must be unique")
            names[node.name] = index
            nodes.append(node)
        validate.total_bytes([fixed] + [n.out_bytes + n.tmp_bytes for n in nodes], where)
        return cls(name=name, nodes=tuple(nodes), fixed_bytes=fixed, device=device, source=source)


def _flag(raw: dict, field: str, where: str) -> bool:
    value = raw.get(field, False)
    if not isinstance(value, bool):
        raise MemschedError(f"{where}.{field} must be true or false, got {value!r}")
    return value


def _node_from_dict(raw, where: str, index: int) -> GraphNode:
    if not isinstance(raw, dict):
        raise MemschedError(f"{where} must be an object with fields {', '.join(_NODE_FIELDS)}")
    validate.reject_unknown(raw, _NODE_FIELDS, where)
    name = validate.text(raw.get("name", f"node{index}"), f"{where}.name")
    deps = validate.require(raw, "deps", where)
    if not isinstance(deps, list):
        raise MemschedError(f"{where}.deps must be a list of node indices, got {deps!r}")
    seen = set()
    for k, dep in enumerate(deps):
        if isinstance(dep, bool) or not isinstance(dep, int):
            raise MemschedError(f"{where}.deps[{k}] must be a node index (a whole number), got {dep!r}")
        if not 0 <= dep < index:
            raise MemschedError(f"{where}.deps[{k}] = {dep}: a dependency must be an earlier node, 0 to {index - 1} "
                                "(nodes are in a topological order, so a later or own index is a cycle "
                                "or a wrong order)")
        if dep in seen:
            raise MemschedError(f"{where}.deps[{k}] = {dep} is listed twice")
        seen.add(dep)
    params = raw.get("params", [])
    if not isinstance(params, list) or not all(isinstance(p, str) for p in params):
        raise MemschedError(f"{where}.params must be a list of parameter names (strings), got {params!r}")
    return GraphNode(
        name=name,
        time=validate.non_negative_seconds(validate.require(raw, "time", where), f"{where}.time"),
        out_bytes=validate.non_negative_bytes(validate.require(raw, "out_bytes", where), f"{where}.out_bytes"),
        tmp_bytes=validate.non_negative_bytes(raw.get("tmp_bytes", 0), f"{where}.tmp_bytes"),
        deps=tuple(deps),
        backward=_flag(raw, "backward", where),
        params=tuple(params),
        random=_flag(raw, "random", where),
        keep=_flag(raw, "keep", where),
    )


def load_graph(path) -> Graph:
    """Read and validate a ``memsched.graph/1`` file."""
    return Graph.from_dict(read_json(path), where=str(path))


def save_graph(graph: Graph, path) -> None:
    """Write ``graph`` atomically as ``memsched.graph/1``."""
    write_json_atomic(Path(path), graph.to_dict())
