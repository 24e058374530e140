"""One rank's memory and traffic under PyTorch's DistributedDataParallel, for a chain plan (no torch).

DDP keeps **gradient buckets** beside each rank's step: flat tensors holding every trainable parameter's gradient
once, allocated when DDP is built and resident from then on, as the parameters are. Its reducer copies each
gradient into its bucket once complete and all-reduces the bucket (planner/execute/ddp.py announces them):

* ``gradient_as_bucket_view=False`` (DDP's default): the step is the plan's, its gradients allocated by each
  stage's backward and living to the step's end as the chain counts them; the buckets add their bytes.
* ``gradient_as_bucket_view=True``: the reducer makes ``.grad`` a view of its bucket as soon as the gradient is
  announced, and the gradient the backward made is freed: a stage's gradients are a transient of its backward, as
  an update inside the backward has them (:func:`planner.updates.updated_chain`), a tied parameter's held to the
  backward of the first stage reading it. The buckets are then the gradients' only home.

Buckets hold ``Σ param_bytes`` of the chain (each trainable parameter once; DDP pads nothing). DDP rebuilds them
once, at the second step's forward, in the order the gradients arrived: for a moment both sets exist, before any
activation of that step (PyTorch says so in ``DistributedDataParallel._pre_forward``); this is not added.

A **communication hook** changes what is sent and what is kept (:class:`CommHook`): the fp16/bf16 compression hooks
send a 16-bit copy of each bucket, half the bytes, which the collective's work may keep until the next step (gloo
drops it at a moment of its own: counted as kept, an upper bound); PowerSGD (Vogels et al., NeurIPS 2019;
``powerSGD_hook``) views each gradient as an ``n x m`` matrix (its first dimension by the rest), sends ``P``
(``n x r``) and ``Q`` (``m x r``) instead where ``(n + m) r · min_compression_rate < n m`` and the rest whole, and
keeps, from its first compressed step on, ``P`` and ``Q`` (with ``warm_start``) and an error-feedback buffer the size
of every gradient (with ``use_error_feedback``), all in the gradients' dtype. Its per-bucket temporaries while it
runs (a copy of the bucket for the error, the uncompressed gradients concatenated, the new error beside the old:
up to twice the bucket and its uncompressed part) are not modelled.
"""

import dataclasses
from dataclasses import dataclass

from planner.simulate.chain import ChainSimulator
from planner.updates import updated_chain

HOOKS = ("allreduce", "fp16", "bf16", "powersgd")


@dataclass(frozen=True)
class CommHook:
    """DDP's communication hook as sizing needs it: ``kind`` one of :data:`HOOKS`; for ``powersgd`` its
    ``rank`` (``matrix_approximation_rank``), ``min_compression_rate``, ``use_error_feedback`` and
    ``warm_start``."""

    kind: str = "allreduce"
    rank: int = 1
    min_compression_rate: float = 2.0
    use_error_feedback: bool = True
    warm_start: bool = True


@dataclass(frozen=True)
class Gradient:
    """One trainable parameter's gradient as DDP buckets it: ``rows`` (its first dimension; 1 for a scalar),
    ``columns`` (elements per row) and ``element_bytes``."""

    rows: int
    columns: int
    element_bytes: int

    @property
    def bytes(self) -> int:
        return self.rows * self.columns * self.element_bytes

    def compressed(self, hook: CommHook) -> bool:
        """Whether PowerSGD sends this gradient as ``P`` and ``Q`` (``_should_compress``)."""
        rank = min(self.rows, self.columns, hook.rank)
        return (self.rows + self.columns) * rank * hook.min_compression_rate < self.rows * self.columns

    def low_rank_bytes(self, hook: CommHook) -> int:
        """Bytes of its ``P`` and ``Q``."""
        return (self.rows + self.columns) * min(self.rows, self.columns, hook.rank) * self.element_bytes


@dataclass(frozen=True)
class DDPRank:
    """One rank's bytes under DDP (see the module's docstring): ``buckets`` and ``hook_state`` resident beside the
    parameters and optimizer state, ``step_peak`` the step's own peak above them, and the bytes each step sends
    (``sent``: what all-reduce is given) and would send without the hook (``uncompressed``)."""

    buckets: int
    hook_state: int
    step_peak: int
    sent: int
    uncompressed: int

    @property
    def added(self) -> int:
        """Bytes DDP keeps beside the plan's own resident state: its buckets and its hook's state."""
        return self.buckets + self.hook_state

    @property
    def peak(self) -> int:
        """The step's peak with what DDP keeps: the rank's bytes above the parameters and optimizer state."""
        return self.added + self.step_peak


def ddp_rank(step_peak: int, gradients: list, hook: CommHook = CommHook()) -> DDPRank:
    """A rank's :class:`DDPRank` for a step peaking at ``step_peak`` bytes (:func:`bucket_view_peak` when the
    gradients are bucket views), its trainable parameters' ``gradients`` (:class:`Gradient`, each once) and
    ``hook``."""
    total = sum(gradient.bytes for gradient in gradients)
    if hook.kind in ("fp16", "bf16"):
        half = sum(g.rows * g.columns * 2 for g in gradients)
        return DDPRank(total, half, step_peak, half, total)
    if hook.kind != "powersgd":
        return DDPRank(total, 0, step_peak, total, total)
    low_rank = sum(g.low_rank_bytes(hook) for g in gradients if g.compressed(hook))
    sent = low_rank + sum(g.bytes for g in gradients if not g.compressed(hook))
    state = (total if hook.use_error_feedback else 0) + (low_rank if hook.warm_start else 0)
    return DDPRank(total, state, step_peak, sent, total)


def bucket_view_peak(chain, schedule, held: int = 0) -> int:
    """Bytes: the peak of ``schedule`` on ``chain`` when each stage's gradients leave the step as its backward ends
    (``gradient_as_bucket_view=True``), ``held`` bytes of the last stage's ``param_bytes`` being no gradients but
    what the caller holds to the step's end (profiles/fit.py's ``held_by_caller``)."""
    last = chain.stages[-1]
    bare = _last_stage_params(chain, last.param_bytes - held)
    handed_off = updated_chain(bare, "in-backward")
    handed_off = _last_stage_params(handed_off, handed_off.stages[-1].param_bytes + held)
    return ChainSimulator(handed_off).run(schedule).peak_bytes


def _last_stage_params(chain, param_bytes: int):
    last = dataclasses.replace(chain.stages[-1], param_bytes=param_bytes)
    return dataclasses.replace(chain, stages=chain.stages[:-1] + (last,))
