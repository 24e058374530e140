"""The operations of a schedule: their names and the two op types (chain :class:`Op`, graph :class:`GraphOp`).

The semantics of each operation are in docs/model.md.
"""

from typing import NamedTuple, Optional

FORWARD_OPS = ("F_all", "F_ck", "F_none")
TRANSFER_OPS = ("Offload", "Release", "Prefetch")
ITEMS = ("saved", "input", "weights", "grads")
OPS = FORWARD_OPS + ("Loss", "B") + TRANSFER_OPS
GRAPH_OPS = ("compute", "free")


class Op(NamedTuple):
    """One scheduled operation: ``kind`` in :data:`OPS`, ``stage`` (None for ``Loss``), and for a transfer the
    item ``what`` in :data:`ITEMS`."""

    kind: str
    stage: Optional[int] = None
    what: Optional[str] = None

    def __str__(self) -> str:
        text = self.kind if self.stage is None else f"{self.kind} {self.stage}"
        return text if self.what is None else f"{text} {self.what}"

    def to_dict(self) -> dict:
        out = {"op": self.kind} if self.stage is None else {"op": self.kind, "stage": self.stage}
        return out if self.what is None else {**out, "what": self.what}


class GraphOp(NamedTuple):
    """One operation of a graph schedule: ``kind`` in :data:`GRAPH_OPS`, on node index ``node``."""

    kind: str
    node: int

    def __str__(self) -> str:
        return f"{self.kind} {self.node}"

    def to_dict(self) -> dict:
        return {"op": self.kind, "node": self.node}
