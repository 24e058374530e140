"""Parameters shared by several stages of a chain (tied weights: a language model's token embedding reused by
its output head).

A chain counts a shared parameter once, in the ``param_bytes`` of the **last** stage that reads it (its
backward runs first and makes the gradient; the earlier stages' backwards add theirs into it). That is exact
on one device; a pipeline that puts those stages on different devices gives each device a copy (counted by
planner/simulate/pipeline.py, docs/model.md; summed by planner/execute/pipeline.py). The chain's optional
``shared`` list records them (its fields are in docs/formats.md, ``memsched.chain/1``).
planner/execute/records.py finds them in live stages (parameters needing gradients, by identity).
"""

from dataclasses import dataclass

import planner.validate as validate
from planner.errors import MemschedError

_FIELDS = ("name", "stages", "bytes")


@dataclass(frozen=True)
class SharedParameter:
    """A parameter read by ``stages`` (ascending; at least two) of ``bytes`` bytes, counted in the
    ``param_bytes`` of ``stages[-1]`` (its owner)."""

    name: str
    stages: tuple
    bytes: int

    @property
    def owner(self) -> int:
        """The stage whose ``param_bytes`` count it: the last that reads it."""
        return self.stages[-1]

    def to_dict(self) -> dict:
        return {"name": self.name, "stages": list(self.stages), "bytes": self.bytes}


def shared_from_list(raw, where: str, length: int, stages=None) -> tuple:
    """Validate a ``shared`` list for a problem of ``length`` stages (absent: ``()``); with a chain's ``stages``,
    also that each owner's ``param_bytes`` hold what it owns. A bad entry is one line naming it."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise MemschedError(f"{where} must be a list of {{\"name\", \"stages\", \"bytes\"}} objects (parameters "
                            "shared by several stages)")
    shared = tuple(_entry(item, f"{where}[{k}]", length) for k, item in enumerate(raw))
    if stages is not None:
        _check_owners(shared, stages, where)
    return shared


def _check_owners(shared, stages, where: str) -> None:
    owned = {}
    for entry in shared:
        owned[entry.owner] = owned.get(entry.owner, 0) + entry.bytes
    for owner, total in sorted(owned.items()):
        if total > stages[owner].param_bytes:
            raise MemschedError(f"{where}: the parameters it lists as owned by stage {owner} ({stages[owner].name}) "
                                f"add up to {total} bytes, more than its param_bytes = {stages[owner].param_bytes}; "
                                "a shared parameter is counted in the param_bytes of the last stage reading it")


def _entry(item, where: str, length: int) -> SharedParameter:
    if not isinstance(item, dict):
        raise MemschedError(f"{where} must be an object with fields {', '.join(_FIELDS)}")
    validate.reject_unknown(item, _FIELDS, where)
    name = validate.text(validate.require(item, "name", where), f"{where}.name")
    stages = validate.require(item, "stages", where)
    if (not isinstance(stages, list) or len(stages) < 2
            or any(isinstance(s, bool) or not isinstance(s, int) for s in stages)):
        raise MemschedError(f"{where}.stages must list at least two stage indices, got {stages!r}")
    if any(not 0 <= s < length for s in stages) or sorted(set(stages)) != stages:
        raise MemschedError(f"{where}.stages must be distinct stage indices from 0 to {length - 1} in ascending "
                            f"order, got {stages!r}")
    return SharedParameter(name=name, stages=tuple(stages),
                           bytes=validate.non_negative_bytes(validate.require(item, "bytes", where), f"{where}.bytes"))
