"""The operations of a schedule: their names, the two op types (chain :class:`Op`, graph :class:`GraphOp`), and
what a chain schedule says without its chain (:func:`activation_read`, :func:`host_weight_stages`,
:func:`planned_stages`).

The semantics of each operation are in docs/model.md, "The operations".
"""

from typing import NamedTuple, Optional

FORWARD_OPS = ("F_all", "F_ck", "F_none")
TRANSFER_OPS = ("Offload", "Release", "Prefetch")
ITEMS = ("saved", "input", "weights", "grads")
OPS = FORWARD_OPS + ("Loss", "B") + TRANSFER_OPS
GRAPH_OPS = ("compute", "free")


class Op(NamedTuple):
    """One scheduled operation: ``kind`` in :data:`OPS`, ``stage`` (None for ``Loss``), for a transfer the
    item ``what`` in :data:`ITEMS`, and for ``F_all`` the index of the stage's ``option`` it runs with (None:
    the stage keeps everything it saves; planner/chain.py, :class:`planner.chain.StageOption`)."""

    kind: str
    stage: Optional[int] = None
    what: Optional[str] = None
    option: Optional[int] = None

    def __str__(self) -> str:
        text = self.kind if self.stage is None else f"{self.kind} {self.stage}"
        text = text if self.option is None else f"{text} option {self.option}"
        return text if self.what is None else f"{text} {self.what}"

    def to_dict(self) -> dict:
        out = {"op": self.kind} if self.stage is None else {"op": self.kind, "stage": self.stage}
        out = out if self.option is None else {**out, "option": self.option}
        return out if self.what is None else {**out, "what": self.what}


class GraphOp(NamedTuple):
    """One operation of a graph schedule: ``kind`` in :data:`GRAPH_OPS`, on node index ``node``."""

    kind: str
    node: int

    def __str__(self) -> str:
        return f"{self.kind} {self.node}"

    def to_dict(self) -> dict:
        return {"op": self.kind, "node": self.node}


def activation_read(op: Op, length: int) -> Optional[int]:
    """The index ``i`` of the activation ``a_i`` a compute operation on a chain of ``length`` stages reads:
    ``a_L`` for ``Loss``, ``a_i`` for ``F_* i`` and ``B i``; None for a transfer."""
    if op.kind == "Loss":
        return length
    return None if op.kind in TRANSFER_OPS else op.stage


def chosen_options(schedule) -> dict:
    """``{stage: option}`` for every ``F_all`` of ``schedule`` that runs with one of its stage's options."""
    return {op.stage: op.option for op in schedule if op.kind == "F_all" and op.option is not None}


def host_weight_stages(schedule) -> frozenset:
    """The stages whose parameters live on the host between steps: those whose ``weights`` the schedule moves."""
    return frozenset(op.stage for op in schedule if op.what == "weights")


def planned_stages(schedule) -> int:
    """The number of stages a chain schedule runs: one more than the highest stage it computes (0 if none)."""
    return 1 + max((op.stage for op in schedule if op.stage is not None and op.kind not in TRANSFER_OPS), default=-1)
