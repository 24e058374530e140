"""What a chain was measured on: the shapes and dtypes of its inputs and of each stage's parameters.

A chain's bytes hold for these tensors only. ``memsched profile`` records them (``measured_on`` of
``memsched.chain/1``; the fields are in docs/formats.md), the solvers copy them into the plan, and running a
chain or plan on other tensors is refused in one line naming the first difference
(:func:`planner.execute.chain.apply_plan`, ``memsched train``, :func:`planner.execute.pipeline.run_pipeline`).
Inputs are matched by label; parameters by position, so that a stage wrapped in another module (its names
prefixed, as ``nn.Sequential(stage, hook)`` or a DDP wrapper does) still matches: the names only label the
message. Buffers are not recorded (their sizes follow the inputs or the parameters). Reading them from live
modules and tensors is planner/execute/records.py's job; this module stays torch-free.
"""

import re
from dataclasses import dataclass
from typing import NamedTuple, Optional

import planner.validate as validate
from planner.errors import MemschedError

_TEXT = re.compile(r"([a-z][a-z0-9_]*)\[((?:\d+(?:,\d+)*)?)\]\Z")
_FIELDS = ("inputs", "stages")


class TensorSpec(NamedTuple):
    """A tensor's shape and its dtype's name (``float32``: ``torch.float32`` without ``torch.``)."""

    shape: tuple
    dtype: str

    def __str__(self) -> str:
        """``(4, 128) float32``."""
        return f"{self.shape} {self.dtype}"

    def to_text(self) -> str:
        """``float32[4,128]``, as in the JSON files."""
        return f"{self.dtype}[{','.join(str(size) for size in self.shape)}]"

    @classmethod
    def parse(cls, text, where: str) -> "TensorSpec":
        """The spec written ``dtype[d0,d1,...]``; anything else is a one-line error naming ``where``."""
        match = _TEXT.match(text) if isinstance(text, str) else None
        if match is None:
            raise MemschedError(f"{where} must be a tensor's dtype and sizes written like 'float32[4,128]' "
                                f"('float32[]' for a scalar), got {text!r}")
        sizes = match.group(2)
        return cls(tuple(int(size) for size in sizes.split(",")) if sizes else (), match.group(1))

    @classmethod
    def of(cls, tensor) -> "TensorSpec":
        """The spec of a live (or fake) tensor."""
        return cls(tuple(int(size) for size in tensor.shape), str(tensor.dtype).removeprefix("torch."))


@dataclass(frozen=True)
class MeasuredOn:
    """The input tensors ``((label, TensorSpec), ...)`` and, per stage, its parameters ``((name, TensorSpec), ...)``."""

    inputs: tuple
    stages: tuple

    def to_dict(self) -> dict:
        return {"inputs": {label: spec.to_text() for label, spec in self.inputs},
                "stages": [{name: spec.to_text() for name, spec in stage} for stage in self.stages]}

    @classmethod
    def from_dict(cls, raw, where: str, length: Optional[int] = None) -> "MeasuredOn":
        """Validate a ``measured_on`` object (``length``: the number of stages it must describe, when known)."""
        if not isinstance(raw, dict):
            raise MemschedError(f"{where} must be an object with fields inputs and stages")
        validate.reject_unknown(raw, _FIELDS, where)
        inputs = _specs(validate.require(raw, "inputs", where), f"{where}.inputs")
        stages = validate.require(raw, "stages", where)
        if not isinstance(stages, list):
            raise MemschedError(f"{where}.stages must be a list with one object of parameters per stage")
        if length is not None and len(stages) != length:
            raise MemschedError(f"{where}.stages describes {len(stages)} stages but the chain has {length}; "
                                "profile the model again")
        return cls(inputs=inputs, stages=tuple(_specs(stage, f"{where}.stages[{k}]") for k, stage in enumerate(stages)))

    def check_stages(self, stages, source: str) -> None:
        """Refuse ``stages`` (``[(name, parameter specs), ...]``, :func:`planner.execute.records.stage_specs`)
        unless every stage has the recorded parameters."""
        if len(stages) != len(self.stages):
            raise MemschedError(f"the {source} was measured on a model of {len(self.stages)} stages, this one has "
                                f"{len(stages)}; {_fix_model(source)}")
        for k, ((name, specs), recorded) in enumerate(zip(stages, self.stages)):
            difference = _parameter_difference(recorded, specs, source)
            if difference:
                raise MemschedError(f"stage {k} ({name}): {difference}; {_fix_model(source)}")

    def check_inputs(self, inputs, source: str, fix: str = None) -> None:
        """Refuse ``inputs`` (the specs of ``(a_0, *extra)``, :func:`planner.execute.records.input_specs`) unless
        they are the recorded tensors; ``fix`` ends the line."""
        difference = _input_difference(self.inputs, inputs, source)
        if difference:
            fix = fix or f"give the inputs the {source} was measured on, or profile the model again on these"
            raise MemschedError(f"{difference}; {fix}")

    def recorded_batch(self, inputs) -> Optional[int]:
        """Input 0's recorded first size (the batch of the built-in models and most factories) when that size is
        all that differs in ``inputs``' (input specs) input 0, else None: the batch to give instead."""
        recorded, given = dict(self.inputs).get("0"), dict(inputs).get("0")
        if recorded is None or given is None or not recorded.shape or len(recorded.shape) != len(given.shape):
            return None
        same_rest = recorded.dtype == given.dtype and recorded.shape[1:] == given.shape[1:]
        return recorded.shape[0] if same_rest and recorded.shape[0] != given.shape[0] else None


def record_of(chain, plan) -> tuple:
    """``(MeasuredOn, source)``: the chain's record when it has one (``source`` "chain"), else the plan's copy
    ("plan"; None when it has none either)."""
    if chain is not None and chain.measured_on is not None:
        return chain.measured_on, "chain"
    return plan.measured_on, "plan"


def _fix_model(source: str) -> str:
    return f"use the {source} with the model it was measured on, or profile this model and solve again"


def _specs(raw, where: str) -> tuple:
    if not isinstance(raw, dict):
        raise MemschedError(f"{where} must be an object of tensors by name, like {{\"weight\": \"float32[64,32]\"}}")
    return tuple((name, TensorSpec.parse(text, f"{where}['{name}']")) for name, text in raw.items())


def _input_difference(recorded: tuple, actual: tuple, source: str) -> Optional[str]:
    """The first difference between the recorded and the actual ``((label, TensorSpec), ...)``, or None."""
    given, expected = dict(actual), dict(recorded)
    for label, spec in recorded:
        if label not in given:
            return f"input {label} is {spec} in the {source}, not given here"
        if given[label] != spec:
            return f"input {label} is {spec} in the {source}, {given[label]} here"
    for label, spec in actual:
        if label not in expected:
            return f"input {label} ({spec}) is given here, not in the {source}"
    return None


def _parameter_difference(recorded: tuple, actual: tuple, source: str) -> Optional[str]:
    """The first difference, position by position, between a stage's recorded and actual parameters, or None."""
    for (name, spec), (actual_name, actual_spec) in zip(recorded, actual):
        if spec != actual_spec:
            label = name if name == actual_name else f"{name} ({actual_name} in the model)"
            return f"parameter {label} is {spec} in the {source}, {actual_spec} in the model"
    if len(recorded) == len(actual):
        return None
    name, spec = (recorded[len(actual):] or actual[len(recorded):])[0]
    where = f"in the {source}" if len(recorded) > len(actual) else "in the model"
    return (f"{len(recorded)} parameters in the {source}, {len(actual)} in the model (the first extra one: {name} "
            f"{spec} {where})")
