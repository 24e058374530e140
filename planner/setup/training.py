"""How a model is trained, as one value, and the memory of everything besides activations (no torch).

:class:`TrainingSetup` is the whole setup a plan is made for: the optimizer, the precision, the ZeRO stage over
``dp`` data-parallel ranks, when the optimizer updates (planner/updates.py; on the host for ``host_stages``), the
stages whose weights live on the host (solvers/weights.py) and the micro-batches whose gradients accumulate
(planner/accumulate.py). planner/setup/rules.py says which of these mix, planner/setup/lower.py turns a chain
into the one its solvers and simulator see, and a plan records the setup it was solved for.

A chain's budget bounds what one training step allocates. The parameters, the fp32 master copy of mixed
precision and the optimizer's state exist before the step starts and stay after it: they are *resident*.
:class:`TrainingSetup` sizes them per device (exact bytes per parameter, each item rounded up to whole bytes).
:func:`activation_budget` turns a device's memory into the budget left for the chain's step (``--budget
auto``) and :func:`describe_auto_budget` says how. With the update ``on-host`` the master copy and the
optimizer state live on the host (:meth:`TrainingSetup.host_bytes`), not on the device.
The byte tables, the ZeRO sharding rules, and why the budget is safe (and by how much it is conservative)
are in docs/model.md, "Whole-step memory".
"""

import math
from dataclasses import dataclass
from fractions import Fraction

from planner.accumulate import check_accumulate
from planner.errors import MemschedError
from planner.sharding import rank_parts
from planner.updates import UPDATES, check_update, host_stages_of

OPTIMIZERS = ("sgd", "momentum", "adam", "adamw", "adam8bit")
# bf16/fp16: mixed precision with an fp32 master copy; pure-bf16: parameters, gradients and optimizer state in bf16,
# no master copy (torchtune's full fine-tune on one device: the model built in bf16, a torch optimizer over it)
PRECISIONS = ("fp32", "bf16", "fp16", "pure-bf16")
ZERO_STAGES = (0, 1, 2, 3)
MAX_RANKS = 1 << 18  # data-parallel ranks: beyond the largest jobs run (each rank's shard is sized, ~5 s at this)
ITEMS = ("params", "grads", "master", "optimizer")

# Optimizer state tensors per parameter. A torch optimizer's states have the dtype of what it updates: the fp32
# master copy under mixed precision, else the parameter itself (bf16 under pure-bf16).
_STATES = {"sgd": 0, "momentum": 1, "adam": 2, "adamw": 2, "adam8bit": 2}
# bitsandbytes' 8-bit Adam (0.50, Optimizer2State.init_state): a tensor of fewer than ADAM8BIT_MIN_ELEMENTS elements
# (min_8bit_size) keeps two fp32 states; a larger one two uint8 states, an fp32 absmax per ADAM8BIT_BLOCK elements
# for each, and the two 256-entry fp32 quantisation maps once per optimizer (ADAM8BIT_MAPS_BYTES)
ADAM8BIT_MIN_ELEMENTS, ADAM8BIT_BLOCK, ADAM8BIT_MAPS_BYTES = 4096, 256, 2 * 256 * 4
# Bytes per parameter before sharding, as exact fractions.
_PRECISION_BYTES = {"fp32": {"params": Fraction(4), "grads": Fraction(4), "master": Fraction(0)},
                    "bf16": {"params": Fraction(2), "grads": Fraction(2), "master": Fraction(4)},
                    "fp16": {"params": Fraction(2), "grads": Fraction(2), "master": Fraction(4)},
                    "pure-bf16": {"params": Fraction(2), "grads": Fraction(2), "master": Fraction(0)}}
# The first ZeRO stage that shards each item over the data-parallel ranks.
_SHARDED_FROM = {"optimizer": 1, "master": 1, "grads": 2, "params": 3}
FP32_BYTES = 4  # a chain recording no parameter dtypes (no layout: synthetic chains) is counted in fp32


@dataclass(frozen=True)
class TrainingSetup:
    """How a model is trained: its optimizer, precision, ZeRO stage and data-parallel ranks (what is resident),
    when the optimizer updates the parameters (planner/updates.py: after the backward, in it, or in it on the
    host for ``host_stages``: None, every stage), the stages whose parameters live on the host (``host_weights``:
    ``"all"`` or stage indices; None, none) and the micro-batches whose gradients add up before each optimizer
    step (``accumulate``). Which of these mix: planner/setup/rules.py."""

    optimizer: str = "adam"
    precision: str = "fp32"
    zero: int = 0  # ZeRO stage 0..3
    dp: int = 1  # data-parallel ranks
    update: str = "after"
    host_stages: tuple = None
    host_weights: object = None
    accumulate: int = 1

    def __post_init__(self):
        if self.optimizer not in OPTIMIZERS:
            raise MemschedError(f"optimizer: unknown {self.optimizer!r}; use one of {', '.join(OPTIMIZERS)}")
        if self.precision not in PRECISIONS:
            raise MemschedError(f"precision: unknown {self.precision!r}; use one of {', '.join(PRECISIONS)} "
                                "(bf16, fp16: mixed precision with an fp32 master copy; pure-bf16: none)")
        if isinstance(self.zero, bool) or not isinstance(self.zero, int) or self.zero not in ZERO_STAGES:
            raise MemschedError(f"zero: the ZeRO stage must be 0, 1, 2 or 3, got {self.zero!r}")
        if isinstance(self.dp, bool) or not isinstance(self.dp, int) or not 1 <= self.dp <= MAX_RANKS:
            raise MemschedError(f"dp: the number of data-parallel ranks must be a whole number from 1 to {MAX_RANKS}, "
                                f"got {str(self.dp)[:40]}")
        check_update(self.update)
        if self.precision == "pure-bf16" and self.update == "on-host":
            raise MemschedError("precision 'pure-bf16' does not mix with update 'on-host': the update on the host runs "
                                "on an fp32 master copy there, which pure-bf16 training has none of; drop one of them")
        check_accumulate(self.accumulate)
        if self.host_stages is not None:
            if self.update != "on-host":
                raise MemschedError(f"host_stages are the stages an update 'on-host' runs on the host; the update is "
                                    f"{self.update!r}: give update 'on-host', or drop host_stages")
            object.__setattr__(self, "host_stages", _indices(self.host_stages, "host_stages"))
        if self.host_weights is not None and self.host_weights != "all":
            object.__setattr__(self, "host_weights", _indices(self.host_weights, "weights"))

    def updates(self) -> tuple:
        """The updates (:data:`planner.updates.UPDATES`) this setup's other fields take: a sharded step's is after
        the backward; pure-bf16 training has no fp32 master copy for the update on the host."""
        if self.sharded:
            return ("after",)
        return tuple(update for update in UPDATES if not (update == "on-host" and self.precision == "pure-bf16"))

    @property
    def sharded(self) -> bool:
        """True for a sharded step: ZeRO 1, 2 or 3 over 2 or more ranks (planner/sharding.py)."""
        return self.zero >= 1 and self.dp > 1

    def per_parameter_byte(self, element_bytes=FP32_BYTES) -> dict:
        """Per item of :data:`ITEMS`, its bytes per byte of a parameter as the model holds it (``element_bytes`` per
        element: 4 in fp32, 2 in bf16), before sharding."""
        return {item: value / element_bytes for item, value in self._unsharded().items()}

    def sizing(self) -> dict:
        """The fields that size the resident state: ``optimizer``, ``precision``, ``zero``, ``dp``."""
        return {"optimizer": self.optimizer, "precision": self.precision, "zero": self.zero, "dp": self.dp}

    def _unsharded(self) -> dict:
        """Bytes per parameter of each item of :data:`ITEMS` before sharding, as exact fractions (8-bit Adam's
        absmax per block of a large tensor: :func:`optimizer_state_bytes` counts each tensor exactly)."""
        if self.optimizer == "adam8bit":
            optimizer = _STATES["adam8bit"] * (1 + Fraction(4, ADAM8BIT_BLOCK))
        else:
            optimizer = Fraction(_STATES[self.optimizer] * self.state_element_bytes())
        return dict(_PRECISION_BYTES[self.precision], optimizer=optimizer)

    def state_element_bytes(self) -> int:
        """Bytes of one element of a torch optimizer's state: that of what it updates (the fp32 master copy, or
        the parameters in fp32 or, under ``pure-bf16``, in bf16)."""
        return 2 if self.precision == "pure-bf16" else 4

    def _exact(self) -> dict:
        """Bytes per parameter on one device, after sharding, as exact fractions."""
        return {item: value / (self.dp if self.zero >= _SHARDED_FROM[item] else 1)
                for item, value in self._unsharded().items()}

    def per_parameter(self) -> dict:
        """Bytes per parameter on one device, after sharding: ``params``, ``grads``, ``master``, ``optimizer``
        (ints when whole, else floats such as ``8 / dp``)."""
        return {item: int(value) if value.denominator == 1 else float(value) for item, value in self._exact().items()}

    def breakdown(self, parameters: int) -> dict:
        """Bytes on one device for ``parameters`` trainable parameters: each item rounded up to whole bytes."""
        _check_parameters(parameters)
        return {item: math.ceil(value * parameters) for item, value in self._exact().items()}

    def resident_parts(self, parameters: int, on_device: int = 0) -> dict:
        """Per device, what exists before a step starts: ``params``, ``master`` and ``optimizer`` bytes; with the
        update on the host, the master copy and state only of the ``on_device`` parameters whose stages update
        on the device (planner/updates.py, ``host_stages``)."""
        sizes = self.breakdown(parameters)
        kept = self.breakdown(on_device) if self.update == "on-host" else sizes
        return {"params": sizes["params"], "master": kept["master"], "optimizer": kept["optimizer"]}

    def resident_bytes(self, parameters: int, on_device: int = 0) -> int:
        """Per device: the sum of :meth:`resident_parts`."""
        return sum(self.resident_parts(parameters, on_device).values())

    def host_bytes(self, parameters: int) -> int:
        """Per device, what the update ``on-host`` keeps on the host: master copy, optimizer state and a buffer
        the gradients are copied into (0 for the other updates)."""
        if self.update != "on-host":
            return 0
        sizes = self.breakdown(parameters)
        return sizes["master"] + sizes["optimizer"] + sizes["grads"]

    def gradient_bytes(self, parameters: int) -> int:
        """Per device: the parameter gradients, allocated during the step."""
        return self.breakdown(parameters)["grads"]

    def describe(self) -> str:
        """``adam, bf16 mixed precision, ZeRO stage 2 over 8 data-parallel ranks``."""
        precision = {"fp32": "fp32", "pure-bf16": "bf16 parameters, gradients and optimizer state (no master copy)"}
        precision = precision.get(self.precision, f"{self.precision} mixed precision (fp32 master copy)")
        zero = f"ZeRO stage {self.zero}" if self.zero else "no ZeRO"
        update = {"after": "", "in-backward": ", update in the backward",
                  "on-host": ", update in the backward on the host"}[self.update]
        weights = "" if self.host_weights is None else (
            f", weights of {'every stage' if self.host_weights == 'all' else 'stages ' + _listed(self.host_weights)} "
            "on the host")
        accumulated = f", gradients accumulated over {self.accumulate} micro-batches" if self.accumulate > 1 else ""
        return (f"{self.optimizer}, {precision}, {zero}, {self.dp} data-parallel rank{'s' if self.dp != 1 else ''}"
                f"{update}{weights}{accumulated}")


def _indices(value, where: str) -> tuple:
    """``value`` (indices, or a comma-separated string of them) as a tuple of distinct stage indices in ascending
    order, else a one-line error naming ``where``."""
    items = value.split(",") if isinstance(value, str) else (value,) if isinstance(value, int) else value
    try:
        indices = tuple(sorted({int(str(item).strip()) for item in items}))
    except (TypeError, ValueError):
        indices = ()
    if not indices or any(k < 0 for k in indices) or any(isinstance(k, bool) for k in items):
        raise MemschedError(f"{where}: give {'all or ' if where == 'weights' else ''}stage indices like 0,3,5, "
                            f"got {value!r}")
    return indices


def _listed(indices) -> str:
    return ", ".join(str(k) for k in indices)


def _check_parameters(parameters) -> None:
    if isinstance(parameters, bool) or not isinstance(parameters, int) or parameters < 0:
        raise MemschedError(f"parameters: expected a whole number >= 0, got {parameters!r}")


def chain_gradient_bytes(chain) -> int:
    """The parameter gradients the chain model counts inside a step: the sum of the stages' ``param_bytes``."""
    return sum(stage.param_bytes for stage in chain.stages)


def gradient_element_bytes(chain) -> Fraction:
    """Bytes per element of the chain's parameter gradients (its ``param_bytes``; a gradient has its parameter's
    dtype): its trainable parameters' bytes over their elements as its ``layout`` records them, exact (2 for a
    model built in bf16, between 2 and 4 for one keeping some layers in fp32); 4 for a chain without a layout."""
    trained = [parameter for stage in chain.layout or () for parameter in stage if parameter.kind != "frozen"]
    elements = sum(parameter.elements for parameter in trained)
    return Fraction(sum(parameter.bytes for parameter in trained), elements) if elements else Fraction(FP32_BYTES)


def parameters_in(chain, param_bytes: int) -> int:
    """Parameters in ``param_bytes`` bytes of ``chain``'s gradients (:func:`gradient_element_bytes` each),
    rounded up."""
    return math.ceil(param_bytes / gradient_element_bytes(chain))


def parameters_of(chain) -> int:
    """Trainable parameters of a chain profile: its ``param_bytes`` (the gradients its backward makes, as large as
    its parameters; a parameter shared by stages counted once, by the last) over the bytes of one element
    (:func:`gradient_element_bytes`: a model built in bf16 has 2), rounded up."""
    return parameters_in(chain, chain_gradient_bytes(chain))


def device_parameters(chain, setup: TrainingSetup, host_stages=None) -> int:
    """Parameters of ``chain`` whose stages update on the device under ``setup`` (all but for the update
    ``on-host``, where the stages outside ``host_stages``: none when None), as :func:`parameters_of` counts."""
    host = host_stages_of(chain, setup.update, host_stages)
    return parameters_in(chain, sum(stage.param_bytes for k, stage in enumerate(chain.stages) if k not in host))


def layout_of(chain) -> tuple:
    """The chain's parameter layout (planner/layout.py), or a one-line error saying to profile it again."""
    if chain.layout is None:
        raise MemschedError(f"chain {chain.name!r} records no parameter layout, which a sharded step (ZeRO 1-3 over "
                            "2 or more ranks) needs: profile the model again with memsched profile")
    return chain.layout


def optimizer_state_bytes(setup: TrainingSetup, elements) -> int:
    """Bytes of the optimizer state ``setup`` keeps for trainable tensors of ``elements`` elements each: a torch
    optimizer's states per element (:meth:`TrainingSetup.state_element_bytes`); 8-bit Adam's per tensor, as
    bitsandbytes allocates them (:data:`ADAM8BIT_MIN_ELEMENTS`, :data:`ADAM8BIT_BLOCK`, the maps once)."""
    states = _STATES[setup.optimizer]
    if setup.optimizer != "adam8bit":
        return states * setup.state_element_bytes() * sum(elements)
    small = sum(n for n in elements if n < ADAM8BIT_MIN_ELEMENTS)
    large = [n for n in elements if n >= ADAM8BIT_MIN_ELEMENTS]
    quantised = sum(n + 4 * math.ceil(n / ADAM8BIT_BLOCK) for n in large)
    return states * (4 * small + quantised) + (ADAM8BIT_MAPS_BYTES if large else 0)


def _exactly(chain, setup: TrainingSetup, sizes: dict, stages=None) -> dict:
    """``sizes`` with 8-bit Adam's state of ``chain``'s trainable parameters (of ``stages``: None, all) counted
    tensor by tensor (:func:`optimizer_state_bytes`) where its layout records them (a torch optimizer's state is
    its parameters' count times a constant, as ``sizes`` has it)."""
    if chain.layout is None or setup.optimizer != "adam8bit":
        return sizes
    elements = [parameter.elements for k, stage in enumerate(chain.layout) if stages is None or k in stages
                for parameter in stage if parameter.kind != "frozen"]
    return dict(sizes, optimizer=optimizer_state_bytes(setup, elements))


def device_sizes(chain, setup: TrainingSetup) -> dict:
    """Bytes per item of :data:`ITEMS` on a device: a sharded step's largest rank's, from the chain's parameter
    layout (:func:`planner.sharding.rank_parts`); other setups' :meth:`TrainingSetup.breakdown` of the chain's
    parameters."""
    if not setup.sharded:
        return _exactly(chain, setup, setup.breakdown(parameters_of(chain)))
    ranks = rank_parts(setup.zero, setup.dp, layout_of(chain), setup.per_parameter_byte(gradient_element_bytes(chain)))
    return max(ranks, key=lambda parts: parts["params"] + parts["master"] + parts["optimizer"])


def resident_parts_on_device(chain, setup: TrainingSetup) -> dict:
    """Bytes per device resident before ``chain``'s step under ``setup``: ``params``, ``master``, ``optimizer``
    (its ``host_stages`` updating on the host). A sharded step's are its largest rank's, from the chain's
    parameter layout (:func:`planner.sharding.rank_parts`: padded shards, shared parameters kept whole); other
    setups' are :meth:`TrainingSetup.resident_parts` of the chain's parameters."""
    if setup.sharded:
        return {item: size for item, size in device_sizes(chain, setup).items() if item != "grads"}
    parts = setup.resident_parts(parameters_of(chain), device_parameters(chain, setup, setup.host_stages))
    host = host_stages_of(chain, setup.update, setup.host_stages)
    return _exactly(chain, setup, parts, [k for k in range(chain.length) if k not in host])


def resident_on_device(chain, setup: TrainingSetup) -> int:
    """Bytes per device resident before ``chain``'s step under ``setup``: the sum of
    :func:`resident_parts_on_device`."""
    return sum(resident_parts_on_device(chain, setup).values())


def extra_gradient_bytes(chain, setup: TrainingSetup) -> int:
    """Bytes of the setup's gradients beyond the chain's ``param_bytes`` (0 unless the setup keeps larger gradients
    than the model's parameters make: fp32 gradients for a model built in bf16; the chain's gradients stand in
    for the setup's, which are never larger otherwise)."""
    return max(0, setup.gradient_bytes(parameters_of(chain)) - chain_gradient_bytes(chain))
