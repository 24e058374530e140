"""The chain problem: a sequence of stages trained by backpropagation.

Stage ``i`` (0 <= i < L) maps activation ``a_i`` to ``a_{i+1}``; ``a_0`` is the input, and a :class:`Loss`
closes the chain. A :class:`Stage` gives the seconds of its forward and backward and the bytes of what it
makes, keeps and needs transiently; a :class:`Chain` may also carry the device-host copy channel
(``transfer``, left out of the fingerprint: it describes the machine, not the model), the parameters several
stages share (``shared``, planner/shared.py), what it was measured on (``measured_on``,
planner/measured_on.py) and its parameters' rows (``layout``, planner/layout.py: what sharding needs). Every
field is defined in docs/formats.md (``memsched.chain/1``), and how the simulator counts them in docs/model.md.
"""

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import planner.validate as validate
from planner.errors import MemschedError
from planner.jsonio import read_json, write_json_atomic
from planner.layout import layout_from_list, layout_to_list
from planner.measured_on import MeasuredOn
from planner.shared import shared_from_list
from planner.transfer import Transfer
from planner.units import sum_seconds

CHAIN_FORMAT = "memsched.chain/1"
_STAGE_FIELDS = ("name", "fwd_time", "bwd_time", "out_bytes", "saved_bytes", "fwd_tmp_bytes", "nograd_tmp_bytes",
                 "bwd_tmp_bytes", "param_bytes", "own_saved_bytes", "options", "held_bwd_tmp_bytes")
_OPTION_FIELDS = ("recompute", "fwd_time", "bwd_time", "saved_bytes", "own_saved_bytes", "fwd_tmp_bytes",
                  "bwd_tmp_bytes")
_CHAIN_FIELDS = ("format", "name", "device", "input_bytes", "stages", "loss", "transfer", "measured_on", "shared",
                 "layout")
_LOSS_FIELDS = ("bwd_time", "tmp_bytes", "saved_bytes")


@dataclass(frozen=True)
class StageOption:
    """Another way to run a stage's forward with autograd: drop the values of the forward operations at
    positions ``recompute`` (of the stage's graph's operations, in graph order: planner/execute/selective.py)
    once the forward is done, and recompute them when its backward first reads one; everything else autograd
    saves is kept. Its fields replace the stage's own for ``F_all`` and ``B``
    (the output is still made and held; ``saved_bytes`` includes it): ``fwd_time`` and ``fwd_tmp_bytes`` of that
    forward, ``saved_bytes`` / ``own_saved_bytes`` what it keeps for its backward, ``bwd_time`` and
    ``bwd_tmp_bytes`` of the backward, the recomputation included. Measured by profiles/options.py."""

    recompute: tuple
    fwd_time: float
    bwd_time: float
    saved_bytes: int
    own_saved_bytes: int
    fwd_tmp_bytes: int = 0
    bwd_tmp_bytes: int = 0

    def to_dict(self) -> dict:
        return {field: list(self.recompute) if field == "recompute" else getattr(self, field)
                for field in _OPTION_FIELDS}


@dataclass(frozen=True)
class Stage:
    """One stage of the chain (seconds and bytes); ``options``: :class:`StageOption` s an ``F_all`` may run
    with instead (``Op.option`` indexes them)."""

    name: str
    fwd_time: float
    bwd_time: float
    out_bytes: int
    saved_bytes: int
    fwd_tmp_bytes: int = 0
    bwd_tmp_bytes: int = 0
    param_bytes: int = 0
    nograd_tmp_bytes: int = None  # None: as fwd_tmp_bytes
    own_saved_bytes: int = None  # None: as saved_bytes
    options: tuple = ()
    # The backward's temporaries when its caller holds the stage's outputs to its end (a pipeline engine holds a
    # device's output): more than bwd_tmp_bytes by an output the backward saved and frees early. None: the same
    # (read it through held_bwd_tmp).
    held_bwd_tmp_bytes: int = None

    def __post_init__(self):
        if self.nograd_tmp_bytes is None:
            object.__setattr__(self, "nograd_tmp_bytes", self.fwd_tmp_bytes)
        if self.own_saved_bytes is None:
            object.__setattr__(self, "own_saved_bytes", self.saved_bytes)

    @property
    def held_bwd_tmp(self) -> int:
        """Bytes: the backward's temporaries with the stage's outputs held to its end (``held_bwd_tmp_bytes``)."""
        return self.bwd_tmp_bytes if self.held_bwd_tmp_bytes is None else self.held_bwd_tmp_bytes

    def to_dict(self) -> dict:
        """The stage's JSON object; ``own_saved_bytes`` only where it differs from ``saved_bytes`` (its default)
        and ``options`` only when there are some, so that chains without them keep their fingerprints."""
        fields = [f for f in _STAGE_FIELDS if (f != "own_saved_bytes" or self.own_saved_bytes != self.saved_bytes)
                  and (f != "options" or self.options)
                  and (f != "held_bwd_tmp_bytes" or self.held_bwd_tmp != self.bwd_tmp_bytes)]
        return {field: [option.to_dict() for option in self.options] if field == "options" else getattr(self, field)
                for field in fields}

    def running_option(self, option: int, error=MemschedError) -> StageOption:
        """Option ``option`` of this stage; one it lacks raises ``error`` in one line."""
        if isinstance(option, bool) or not isinstance(option, int) or not 0 <= option < len(self.options):
            raise error(f"stage {self.name!r} has {len(self.options)} options; option {option} is not one "
                        "(the plan is for another chain: solve again)")
        return self.options[option]

    def running(self, option) -> "Stage":
        """This stage as ``F_all`` with ``option`` (an index into :attr:`options`; None: itself) runs it, and the
        ``B`` after it."""
        if option is None:
            return self
        chosen = self.running_option(option, ValueError)  # the simulator turns a ValueError into its own error
        return Stage(name=self.name, fwd_time=chosen.fwd_time, bwd_time=chosen.bwd_time, out_bytes=self.out_bytes,
                     saved_bytes=chosen.saved_bytes, fwd_tmp_bytes=chosen.fwd_tmp_bytes,
                     bwd_tmp_bytes=chosen.bwd_tmp_bytes, param_bytes=self.param_bytes,
                     nograd_tmp_bytes=self.nograd_tmp_bytes, own_saved_bytes=chosen.own_saved_bytes)


@dataclass(frozen=True)
class Loss:
    """The loss at the end of the chain: its backward time and transient bytes, and what its forward leaves for
    its backward (the loss value and its saved tensors; part of ``tmp_bytes``)."""

    bwd_time: float = 0.0
    tmp_bytes: int = 0
    saved_bytes: int = 0

    def to_dict(self) -> dict:
        """The JSON object; ``saved_bytes`` only when not 0 (older chains read and hash as before)."""
        return {"bwd_time": self.bwd_time, "tmp_bytes": self.tmp_bytes,
                **({"saved_bytes": self.saved_bytes} if self.saved_bytes else {})}


@dataclass(frozen=True)
class Chain:
    """A validated chain problem. Build it with :meth:`from_dict` or :func:`load_chain`."""

    name: str
    device: str
    input_bytes: int
    stages: tuple
    loss: Loss
    transfer: Transfer = None  # the copy channel, when measured or given
    measured_on: MeasuredOn = None  # the input and parameter tensors it was measured on, when recorded
    shared: tuple = ()  # planner.shared.SharedParameter: parameters several stages read (tied weights)
    layout: tuple = None  # per stage, planner.layout.ParameterRows: what sharding cuts (None: not recorded)

    @property
    def length(self) -> int:
        """Number of stages L."""
        return len(self.stages)

    @property
    def has_options(self) -> bool:
        """True when some stage has :class:`StageOption` s (the hierarchical solver chooses among them)."""
        return any(stage.options for stage in self.stages)

    def without_options(self) -> "Chain":
        """This chain with every stage's options dropped (a different problem: another fingerprint)."""
        return dataclasses.replace(self, stages=tuple(dataclasses.replace(s, options=()) for s in self.stages))

    @property
    def compute_time(self) -> float:
        """Seconds of one step without recomputation: every forward, the loss, every backward.

        Added in that order, as the simulator adds a store-all schedule, so both give the same float.
        """
        return sum_seconds([s.fwd_time for s in self.stages] + [self.loss.bwd_time]
                           + [s.bwd_time for s in reversed(self.stages)])

    def act_bytes(self, i: int) -> int:
        """Size of activation ``a_i`` (0 <= i <= L); ``a_0`` is the input."""
        return self.input_bytes if i == 0 else self.stages[i - 1].out_bytes

    def to_dict(self) -> dict:
        """The ``memsched.chain/1`` JSON object."""
        return {
            "format": CHAIN_FORMAT,
            "name": self.name,
            "device": self.device,
            "input_bytes": self.input_bytes,
            "stages": [s.to_dict() for s in self.stages],
            "loss": self.loss.to_dict(),
            **({} if self.transfer is None else {"transfer": self.transfer.to_dict()}),
            **({} if self.measured_on is None else {"measured_on": self.measured_on.to_dict()}),
            **({"shared": [entry.to_dict() for entry in self.shared]} if self.shared else {}),
            **({} if self.layout is None else {"layout": layout_to_list(self.layout)}),
        }

    def fingerprint(self) -> str:
        """``sha256:<hex>`` of the canonical JSON (sorted keys, no spaces) without the copy channel: ties plans to
        this exact problem."""
        problem = {key: value for key, value in self.to_dict().items() if key != "transfer"}
        canonical = json.dumps(problem, sort_keys=True, separators=(",", ":"))
        return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()

    @classmethod
    def from_dict(cls, data: dict, where: str = "chain") -> "Chain":
        """Validate a ``memsched.chain/1`` object; a bad field raises a one-line :class:`MemschedError`."""
        validate.document(data, "chain", 1, _CHAIN_FIELDS, where)
        name = validate.text(data.get("name", "chain"), f"{where}: name")
        device = validate.text(data.get("device", "unknown"), f"{where}: device")
        input_bytes = validate.non_negative_bytes(validate.require(data, "input_bytes", where), f"{where}: input_bytes")
        raw_stages = validate.require(data, "stages", where)
        if not isinstance(raw_stages, list) or not raw_stages:
            raise MemschedError(f"{where}: stages must be a non-empty list of stage objects")
        validate.count(len(raw_stages), f"{where}: the number of stages", 1)
        stages = tuple(_stage_from_dict(raw, f"{where}: stages[{i}]", i) for i, raw in enumerate(raw_stages))
        loss = _loss_from_dict(data.get("loss", {}), f"{where}: loss")
        validate.total_bytes([input_bytes, loss.tmp_bytes, loss.saved_bytes] + [  # own_saved_bytes: inside saved_bytes
            getattr(s, f) for s in stages for f in _STAGE_FIELDS
            if f.endswith("_bytes") and f not in ("own_saved_bytes", "held_bwd_tmp_bytes")],
                             where)
        transfer = None if data.get("transfer") is None else Transfer.from_dict(data["transfer"], f"{where}: transfer")
        measured = None if data.get("measured_on") is None else MeasuredOn.from_dict(
            data["measured_on"], f"{where}: measured_on", len(stages))
        layout = None if data.get("layout") is None else layout_from_list(data["layout"], f"{where}: layout",
                                                                         len(stages))
        return cls(name=name, device=device, input_bytes=input_bytes, stages=stages, loss=loss, transfer=transfer,
                   measured_on=measured, shared=shared_from_list(data.get("shared"), f"{where}: shared", len(stages),
                                                            stages), layout=layout)


def _stage_from_dict(raw, where: str, index: int) -> Stage:
    if not isinstance(raw, dict):
        raise MemschedError(f"{where} must be an object with fields {', '.join(_STAGE_FIELDS)}")
    name = validate.text(raw.get("name", f"stage{index}"), f"{where}.name")
    where = f"{where} ({name})"
    validate.reject_unknown(raw, _STAGE_FIELDS, where)
    values = {"name": name}
    for field in ("fwd_time", "bwd_time"):
        values[field] = validate.non_negative_seconds(validate.require(raw, field, where), f"{where}.{field}")
    for field in ("out_bytes", "saved_bytes"):
        values[field] = validate.non_negative_bytes(validate.require(raw, field, where), f"{where}.{field}")
    for field in ("fwd_tmp_bytes", "bwd_tmp_bytes", "param_bytes"):
        values[field] = validate.non_negative_bytes(raw.get(field, 0), f"{where}.{field}")
    values["nograd_tmp_bytes"] = validate.non_negative_bytes(raw.get("nograd_tmp_bytes", values["fwd_tmp_bytes"]),
                                                             f"{where}.nograd_tmp_bytes")
    if values["saved_bytes"] < values["out_bytes"]:
        raise MemschedError(
            f"{where}.saved_bytes = {values['saved_bytes']} is below out_bytes = {values['out_bytes']}; "
            "saved_bytes includes the stage's output, so it must be >= out_bytes"
        )
    own = values["own_saved_bytes"] = validate.non_negative_bytes(raw.get("own_saved_bytes", values["saved_bytes"]),
                                                                  f"{where}.own_saved_bytes")
    if not values["saved_bytes"] - values["out_bytes"] <= own <= values["saved_bytes"]:
        raise MemschedError(
            f"{where}.own_saved_bytes = {own} must be between saved_bytes - out_bytes = "
            f"{values['saved_bytes'] - values['out_bytes']} and saved_bytes = {values['saved_bytes']} "
            "(it is saved_bytes less the outputs the stage's backward does not read)"
        )
    values["options"] = _options_from_list(raw.get("options", []), f"{where}.options", values["out_bytes"])
    if "held_bwd_tmp_bytes" in raw:
        held = values["held_bwd_tmp_bytes"] = validate.non_negative_bytes(raw["held_bwd_tmp_bytes"],
                                                                          f"{where}.held_bwd_tmp_bytes")
        if not values["bwd_tmp_bytes"] <= held <= values["bwd_tmp_bytes"] + values["out_bytes"]:
            raise MemschedError(f"{where}.held_bwd_tmp_bytes = {held} must be between bwd_tmp_bytes = "
                                f"{values['bwd_tmp_bytes']} and bwd_tmp_bytes + out_bytes (the held outputs)")
    return Stage(**values)


def _options_from_list(raw, where: str, out_bytes: int) -> tuple:
    if not isinstance(raw, list):
        raise MemschedError(f"{where} must be a list of option objects with fields {', '.join(_OPTION_FIELDS)}")
    options = []
    for k, item in enumerate(raw):
        here = f"{where}[{k}]"
        if not isinstance(item, dict):
            raise MemschedError(f"{here} must be an object with fields {', '.join(_OPTION_FIELDS)}")
        validate.reject_unknown(item, _OPTION_FIELDS, here)
        positions = validate.require(item, "recompute", here)
        if not isinstance(positions, list) or any(isinstance(p, bool) or not isinstance(p, int) or p < 0
                                                  for p in positions) or positions != sorted(set(positions)):
            raise MemschedError(f"{here}.recompute must be a list of distinct operation positions (integers >= 0) "
                                f"in increasing order, got {positions!r}")
        values = {"recompute": tuple(positions)}
        for field in ("fwd_time", "bwd_time"):
            values[field] = validate.non_negative_seconds(validate.require(item, field, here), f"{here}.{field}")
        for field in ("saved_bytes", "own_saved_bytes"):
            values[field] = validate.non_negative_bytes(validate.require(item, field, here), f"{here}.{field}")
        for field in ("fwd_tmp_bytes", "bwd_tmp_bytes"):
            values[field] = validate.non_negative_bytes(item.get(field, 0), f"{here}.{field}")
        if values["saved_bytes"] < out_bytes:
            raise MemschedError(f"{here}.saved_bytes = {values['saved_bytes']} is below the stage's out_bytes = "
                                f"{out_bytes}; an option still makes and holds the output")
        if not values["saved_bytes"] - out_bytes <= values["own_saved_bytes"] <= values["saved_bytes"]:
            raise MemschedError(f"{here}.own_saved_bytes = {values['own_saved_bytes']} must be between saved_bytes "
                                f"- out_bytes and saved_bytes")
        options.append(StageOption(**values))
    return tuple(options)


def _loss_from_dict(raw, where: str) -> Loss:
    if not isinstance(raw, dict):
        raise MemschedError(f"{where} must be an object with fields {', '.join(_LOSS_FIELDS)}")
    validate.reject_unknown(raw, _LOSS_FIELDS, where)
    return Loss(
        bwd_time=validate.non_negative_seconds(raw.get("bwd_time", 0.0), f"{where}.bwd_time"),
        tmp_bytes=validate.non_negative_bytes(raw.get("tmp_bytes", 0), f"{where}.tmp_bytes"),
        saved_bytes=validate.non_negative_bytes(raw.get("saved_bytes", 0), f"{where}.saved_bytes"),
    )


def load_chain(path) -> Chain:
    """Read and validate a ``memsched.chain/1`` file."""
    return Chain.from_dict(read_json(path), where=str(path))


def save_chain(chain: Chain, path) -> None:
    """Write ``chain`` atomically as ``memsched.chain/1``."""
    write_json_atomic(Path(path), chain.to_dict())
