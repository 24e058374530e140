"""The memory of everything besides activations: parameters, gradients and optimizer state.

A chain's budget (docs/formats.md) bounds what one training step allocates: the input, activations, their
gradients, temporaries and parameter gradients. The model's parameters, the fp32 master copy of mixed
precision and the optimizer's state exist before the step starts and stay after it: they are *resident*.
This module sizes them per device for an optimizer, a precision and a ZeRO stage over ``dp`` data-parallel
ranks (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", SC 2020),
and turns a device's memory into the budget that is left for the chain's step.

Bytes per parameter before sharding (no torch needed)::

    precision       params  grads  master
    fp32               4      4      0
    bf16, fp16         2      2      4      (mixed precision)

    optimizer       state (any precision)
    sgd                0
    momentum           4
    adam               8
    adam8bit           2.03125

* ``bf16``/``fp16`` mean mixed precision: 16-bit parameters and gradients used by the step, and an fp32
  master copy of the parameters that the optimizer updates. Mixed-precision Adam is 2 + 2 + 4 + 8 = 16 bytes
  per parameter, the paper's ``2Ψ + 2Ψ + KΨ`` with ``K = 12`` (master copy and two fp32 moments).
* ``momentum``: one fp32 buffer; ``adam``: two fp32 moments (AdamW is the same).
* ``adam8bit`` (bitsandbytes' ``Adam8bit``, Dettmers et al. 2022): two 1-byte states plus one fp32 absmax
  per 256-element block for each of them, ``2 + 2 * 4 / 256 = 2.03125`` bytes. Assumed: every tensor is a
  whole number of blocks and is quantised. Not modelled: bitsandbytes keeps tensors of fewer than 4096
  elements (``min_8bit_size``) in fp32 states (8 bytes), rounds each tensor up to whole blocks, and holds two
  256-entry fp32 quantisation maps (2 KiB) per optimizer.

ZeRO over ``N = dp`` ranks divides, per device:

* stage 0: nothing (plain data parallelism: every rank holds everything);
* stage 1: the optimizer state **and the fp32 master copy** (the paper's "optimizer states" include the
  master weights of mixed precision) by ``N``;
* stage 2: also the gradients;
* stage 3: also the parameters.

Sharded sizes are exact fractions (``P * bytes / N``), rounded up to whole bytes per item. The paper's
Figure 1 example (``Ψ = 7.5e9``, ``K = 12``, ``N = 64``, Adam mixed precision) gives 120 GB, 31.4 GB,
16.6 GB and 1.9 GB per device for stages 0 to 3 (GB = 1e9 bytes). Not modelled: ZeRO's communication
buckets (a gradient bucket exists in full before it is reduce-scattered; stage 3 gathers a layer's full
parameters while it runs), padding of shards, and the allocator's fragmentation.

**The chain's budget.** Chain profiles are measured in fp32: a stage's ``param_bytes`` are the fp32
gradients of its parameters, which the chain model already counts inside the step (made by each backward,
kept to its end). So :func:`parameters_of` is ``sum(param_bytes) / 4`` (rounded up), and
:func:`activation_budget` is::

    device_memory - resident_bytes(P) - max(0, gradient_bytes(P) - sum(param_bytes))

The chain's own gradients stand in for the setup's. With fp32 and ZeRO 0-1 they are the same bytes (the
last term is at most the 3 bytes of rounding ``P`` up), and the budget is exact in the chain model. With
16-bit gradients or ZeRO 2-3 the setup's gradients are smaller than the chain's, and the chain model
over-counts them by ``sum(param_bytes) - gradient_bytes(P)`` once every backward has run; that difference
is **not** credited to the budget, since a plan's peak usually falls during the backward, when only part of
the gradients exist and only part of the difference would be saved. The budget is therefore safe for any
schedule of the unmodified chain (so a plan for it still matches ``CHAIN.json``) and conservative by at
most that difference. To plan exactly with the setup's gradients, solve :func:`setup_chain` (every stage's
``param_bytes`` scaled by ``gradient_bytes(P) / sum(param_bytes)``, rounded up) at ``device_memory -
resident_bytes(P)``. Activations stay as profiled: a chain profiled in fp32 does not shrink its activations
for ``bf16``; profile the model in the precision it trains in for that.
"""

import dataclasses
import math
from dataclasses import dataclass
from fractions import Fraction

from planner.errors import MemschedError

OPTIMIZERS = ("sgd", "momentum", "adam", "adam8bit")
PRECISIONS = ("fp32", "bf16", "fp16")  # bf16/fp16: mixed precision with an fp32 master copy
ZERO_STAGES = (0, 1, 2, 3)
ITEMS = ("params", "grads", "master", "optimizer")

# Bytes per parameter before sharding, as exact fractions.
_OPTIMIZER_BYTES = {"sgd": Fraction(0), "momentum": Fraction(4), "adam": Fraction(8),
                    "adam8bit": Fraction(2) + Fraction(2 * 4, 256)}  # two uint8 states + an fp32 absmax per 256
_PRECISION_BYTES = {"fp32": {"params": Fraction(4), "grads": Fraction(4), "master": Fraction(0)},
                    "bf16": {"params": Fraction(2), "grads": Fraction(2), "master": Fraction(4)},
                    "fp16": {"params": Fraction(2), "grads": Fraction(2), "master": Fraction(4)}}
# The first ZeRO stage that shards each item over the data-parallel ranks.
_SHARDED_FROM = {"optimizer": 1, "master": 1, "grads": 2, "params": 3}
PROFILE_GRADIENT_BYTES = 4  # chain profiles are fp32: param_bytes are 4 bytes per parameter


@dataclass(frozen=True)
class TrainingSetup:
    """How a model is trained: its optimizer, precision, ZeRO stage and data-parallel ranks."""

    optimizer: str = "adam"
    precision: str = "fp32"
    zero: int = 0  # ZeRO stage 0..3
    dp: int = 1  # data-parallel ranks

    def __post_init__(self):
        if self.optimizer not in OPTIMIZERS:
            raise MemschedError(f"optimizer: unknown {self.optimizer!r}; use one of {', '.join(OPTIMIZERS)}")
        if self.precision not in PRECISIONS:
            raise MemschedError(f"precision: unknown {self.precision!r}; use one of {', '.join(PRECISIONS)} "
                                "(bf16, fp16: mixed precision with an fp32 master copy)")
        if isinstance(self.zero, bool) or not isinstance(self.zero, int) or self.zero not in ZERO_STAGES:
            raise MemschedError(f"zero: the ZeRO stage must be 0, 1, 2 or 3, got {self.zero!r}")
        if isinstance(self.dp, bool) or not isinstance(self.dp, int) or self.dp < 1:
            raise MemschedError(f"dp: the number of data-parallel ranks must be a whole number >= 1, got {self.dp!r}")

    def _exact(self) -> dict:
        """Bytes per parameter on one device, after sharding, as exact fractions."""
        unsharded = dict(_PRECISION_BYTES[self.precision], optimizer=_OPTIMIZER_BYTES[self.optimizer])
        return {item: unsharded[item] / (self.dp if self.zero >= _SHARDED_FROM[item] else 1) for item in ITEMS}

    def per_parameter(self) -> dict:
        """Bytes per parameter on one device, after sharding: ``params``, ``grads``, ``master``, ``optimizer``
        (ints when whole, else floats such as ``8 / dp``)."""
        return {item: int(value) if value.denominator == 1 else float(value) for item, value in self._exact().items()}

    def breakdown(self, parameters: int) -> dict:
        """Bytes on one device for ``parameters`` trainable parameters: each item rounded up to whole bytes."""
        _check_parameters(parameters)
        return {item: math.ceil(value * parameters) for item, value in self._exact().items()}

    def resident_bytes(self, parameters: int) -> int:
        """Per device: parameters, master copy and optimizer state (what exists before a step starts)."""
        sizes = self.breakdown(parameters)
        return sizes["params"] + sizes["master"] + sizes["optimizer"]

    def gradient_bytes(self, parameters: int) -> int:
        """Per device: the parameter gradients, allocated during the step."""
        return self.breakdown(parameters)["grads"]

    def describe(self) -> str:
        """``adam, bf16 mixed precision, ZeRO stage 2 over 8 data-parallel ranks``."""
        precision = "fp32" if self.precision == "fp32" else f"{self.precision} mixed precision (fp32 master copy)"
        zero = f"ZeRO stage {self.zero}" if self.zero else "no ZeRO"
        return f"{self.optimizer}, {precision}, {zero}, {self.dp} data-parallel rank{'s' if self.dp != 1 else ''}"


def _check_parameters(parameters) -> None:
    if isinstance(parameters, bool) or not isinstance(parameters, int) or parameters < 0:
        raise MemschedError(f"parameters: expected a whole number >= 0, got {parameters!r}")


def chain_gradient_bytes(chain) -> int:
    """The parameter gradients the chain model counts inside a step: the sum of the stages' ``param_bytes``."""
    return sum(stage.param_bytes for stage in chain.stages)


def parameters_of(chain) -> int:
    """Trainable parameters of a chain profile: ``sum(param_bytes) / 4``, rounded up.

    Profiles are measured in fp32, so a stage's ``param_bytes`` (the gradients its backward makes, as large as
    its parameters) are 4 bytes per parameter; a parameter shared by stages is counted once, by the last.
    A chain profiled with 16-bit parameters would be counted at half its parameters.
    """
    return -(-chain_gradient_bytes(chain) // PROFILE_GRADIENT_BYTES)


def activation_budget(chain, setup: TrainingSetup, device_memory: int) -> int:
    """Bytes left for the chain's step budget (activations, temporaries and the chain's parameter gradients)
    once ``setup``'s resident state is on a device of ``device_memory`` bytes.

    ``device_memory - resident_bytes(P) - max(0, gradient_bytes(P) - sum(param_bytes))`` with
    ``P = parameters_of(chain)``: the chain's fp32 gradients stand in for the setup's, which are never larger
    (16-bit or ZeRO-sharded gradients are smaller; the difference is not credited, see the module docstring).
    A one-line :class:`MemschedError` when nothing is left.
    """
    if isinstance(device_memory, bool) or not isinstance(device_memory, int) or device_memory < 1:
        raise MemschedError(f"device memory: expected a whole number of bytes >= 1, got {device_memory!r}")
    parameters = parameters_of(chain)
    resident = setup.resident_bytes(parameters)
    extra_gradients = max(0, setup.gradient_bytes(parameters) - chain_gradient_bytes(chain))
    budget = device_memory - resident - extra_gradients
    if budget <= 0:
        extra = f" and {extra_gradients} bytes of gradients beyond the chain's" if extra_gradients else ""
        raise MemschedError(
            f"no memory left for activations: {parameters} parameters with {setup.describe()} keep "
            f"{resident} bytes resident{extra}, at least the device's {device_memory} bytes; "
            "use a larger device, more ranks or a higher ZeRO stage")
    return budget


def setup_chain(chain, setup: TrainingSetup):
    """``chain`` with each stage's ``param_bytes`` scaled to the setup's gradients (rounded up): solved at
    ``device_memory - resident_bytes(parameters_of(chain))`` it plans exactly with 16-bit or sharded
    gradients (its fingerprint differs from ``chain``'s)."""
    total = chain_gradient_bytes(chain)
    if total == 0:
        return chain
    target = setup.gradient_bytes(parameters_of(chain))
    stages = tuple(dataclasses.replace(stage, param_bytes=-(-stage.param_bytes * target // total))
                   for stage in chain.stages)
    return dataclasses.replace(chain, stages=stages)
