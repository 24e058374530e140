"""The parameters of each stage as sharding cuts them: rows and bytes per row (no torch).

FSDP2's ``fully_shard`` cuts every parameter along its first dimension (planner/sharding.py), so what one rank
keeps depends on each parameter's rows, not only on its bytes. ``memsched profile`` records, per stage, the
parameters its module holds that no earlier stage holds, in the module's order, each as :class:`ParameterRows`:
its rows (1 for a scalar), the bytes of one row, its kind: ``trainable``, ``frozen`` (no gradient) or ``shared``
(needing gradients and read by several stages: kept whole, the chain's ``shared`` list), and the bytes of one
element (2 for a model built in bf16; 4, fp32, when not written). The chain's optional ``layout`` field
(docs/formats.md) holds them; a chain without it cannot be planned for a sharded step. planner/execute/records.py
reads them from live stages.
"""

from typing import NamedTuple

from planner.errors import MemschedError

KINDS = ("trainable", "frozen", "shared")


class ParameterRows(NamedTuple):
    """One parameter: ``rows`` along its first dimension (1 for a scalar), ``row_bytes`` per row, its kind, and
    ``element_bytes`` per element (its dtype's size)."""

    rows: int
    row_bytes: int
    kind: str
    element_bytes: int = 4

    @property
    def bytes(self) -> int:
        return self.rows * self.row_bytes

    @property
    def elements(self) -> int:
        return self.bytes // self.element_bytes


def layout_to_list(layout: tuple) -> list:
    """The JSON of a layout: per stage, ``[[rows, row_bytes, kind], ...]``, each with its ``element_bytes`` after
    ``kind`` when not 4 (an fp32 chain's layout reads and hashes as before)."""
    return [[list(parameter) if parameter.element_bytes != 4 else list(parameter[:3]) for parameter in stage]
            for stage in layout]


def layout_from_list(raw, where: str, length: int) -> tuple:
    """Validate a ``layout`` list for a chain of ``length`` stages; a bad entry is one line naming it."""
    if not isinstance(raw, list) or len(raw) != length:
        raise MemschedError(f"{where} must be a list with one list of parameters per stage ({length}); profile the "
                            "model again")
    return tuple(tuple(_parameter(item, f"{where}[{k}][{j}]") for j, item in enumerate(_stage(stage, f"{where}[{k}]")))
                 for k, stage in enumerate(raw))


def trainable_sizes(layout: tuple) -> list:
    """Bytes of each parameter needing a gradient, in the optimizer's order (stage by stage, each once)."""
    return [parameter.bytes for stage in layout for parameter in stage if parameter.kind != "frozen"]


def shared_bytes(layout: tuple) -> int:
    """Bytes of the parameters several stages share (kept whole on every rank)."""
    return sum(parameter.bytes for stage in layout for parameter in stage if parameter.kind == "shared")


def _stage(raw, where: str) -> list:
    if not isinstance(raw, list):
        raise MemschedError(f"{where} must be a list of [rows, row_bytes, kind] parameters")
    return raw


def _parameter(item, where: str) -> ParameterRows:
    if (not isinstance(item, list) or len(item) not in (3, 4)
            or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in item[:2]) or item[2] not in KINDS
            or len(item) == 4 and (isinstance(item[3], bool) or item[3] not in (1, 2, 4, 8) or item[1] % item[3])):
        raise MemschedError(f"{where} must be [rows, row_bytes, kind] or [rows, row_bytes, kind, element_bytes] with "
                            f"whole numbers >= 0, kind one of {', '.join(KINDS)} and element_bytes 1, 2, 4 or 8 "
                            f"dividing row_bytes, got {item!r}")
    return ParameterRows(*item)
