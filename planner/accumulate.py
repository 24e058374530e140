"""Gradient accumulation: several backwards add their gradients into ``.grad`` before one optimizer step (no torch).

The loop is ``for batch in micro_batches: loss(batch).backward()``, then ``optimizer.step()`` and
``optimizer.zero_grad()`` (which sets the gradients to None). The first micro-batch starts without gradients: its
step is the chain's own, each stage's ``param_bytes`` made by its ``B`` and held to the end. From the second on,
every parameter's gradient is resident from the start of the step (:func:`held_gradient_bytes`), and ``B i`` makes
its stage's gradients anew and adds them into ``.grad`` in place: they are a transient of its backward, freed at
its end, as with an update inside the backward (planner/updates.py); a tied parameter's summed contributions
stay from its owner's backward on. :func:`accumulating_chain` is the chain
those micro-batches run, which every chain solver plans unchanged within the budget less the held gradients; the
simulator replays it from that many bytes (``ChainSimulator(chain, held_bytes=...)``). Each stage's backward
adds its own gradients (the executor runs accumulating plans unfused: a graph of several stages would make all
their gradients before adding any). Why this is exact: docs/model.md, "Gradient accumulation".
"""

from planner.errors import MemschedError
from planner.updates import updated_chain

MAX_ACCUMULATE = 2**20  # micro-batches per optimizer step: each is a forward and a backward


def check_accumulate(value, where: str = "accumulate") -> int:
    """``value``, the micro-batches per optimizer step, if a whole number from 1 to :data:`MAX_ACCUMULATE`; else a
    one-line :class:`MemschedError`."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_ACCUMULATE:
        raise MemschedError(f"{where}: the micro-batches whose gradients add up before one optimizer step must be a "
                            f"whole number from 1 (no accumulation) to {MAX_ACCUMULATE}, got {value!r}")
    return value


def held_gradient_bytes(chain) -> int:
    """Bytes of every parameter gradient, held from the start of each micro-batch after the first: the sum of the
    stages' ``param_bytes`` (a shared parameter's counted once, by its owner)."""
    return sum(stage.param_bytes for stage in chain.stages)


def accumulating_chain(chain):
    """``chain`` as a micro-batch after the first runs it, beside :func:`held_gradient_bytes` held all step.

    A stage's backward makes the same gradients as in the first micro-batch (its measured ``bwd_tmp_bytes``
    include them: the profiler makes them from None) and adds them into ``.grad``, which allocates nothing, then
    frees them: they are a transient of its backward, exactly as with an update inside the backward, so this is
    :func:`planner.updates.updated_chain` for ``"in-backward"``. A tied parameter's contributions are summed
    before they are added into ``.grad``, as autograd sums them (planner/execute/autograd.py,
    ``TiedGradients``): that sum is held from its owner's backward on, so it stays in the owner's
    ``param_bytes``, as there. Its fingerprint differs from ``chain``'s: a plan records ``accumulate`` and the
    chain's own fingerprint.
    """
    return updated_chain(chain, "in-backward")
