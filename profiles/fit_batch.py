"""``fit(..., batch=...)``: the micro-batch a fitted model is planned for, and with ``batch="auto"`` the fastest.

The example batch is made of another size by :func:`planner.execute.stages.batch_resized` (every tensor whose
first size is the batch, the first tensor's, gets that many rows, cycled from the example's). ``batch="auto"``
searches as ``memsched plan --batch auto`` does (:func:`profiles.device_plan.tried_batches`: micro-batches of 1,
2, 4, ... until one does not fit the device or the samples per second stop growing), each size's chain found and
profiled on fake copies of the model's tensors and of the resized batch (``estimate_at``: nothing allocated, no
forward run for real), solved within the budget and judged on the device
(:func:`profiles.device_plan.judged`), and keeps :func:`profiles.device_plan.best`. With ``global_batch``, each
micro-batch is accumulated ``global_batch / micro-batch`` times per optimizer step.
"""

import contextlib
import dataclasses
from typing import NamedTuple

from planner.errors import MemschedError
from planner.render_memory import device_plan_lines
from planner.setup import TrainingSetup
from profiles.device_plan import MAX_BATCH, Candidate, best, judged, tried_batches
from profiles.discover import ExampleFailed


class Batching(NamedTuple):
    """What :func:`fit` plans for: ``size`` samples per micro-batch (None: the example as given, its size not
    read), ``setup`` accumulating ``global_batch / size`` micro-batches when a global batch is given, and the
    :class:`profiles.device_plan.Candidate` s ``searched`` (none unless ``batch="auto"``)."""

    size: int
    setup: TrainingSetup
    searched: tuple = ()


def checked(batch, global_batch) -> None:
    """:func:`fit`'s ``batch`` and ``global_batch`` refused in one line when they cannot be: ``batch`` not None,
    ``"auto"`` or a micro-batch of 1 to :data:`profiles.device_plan.MAX_BATCH` samples (the most ``auto`` tries), a
    ``global_batch`` not a positive int (what they do not mix with, or need: planner/setup/rules.py)."""
    if not (batch is None or batch == "auto" or _positive(batch) and batch <= MAX_BATCH):
        raise MemschedError(f"fit batch: 'auto' (the fastest on device_spec), a micro-batch size (an int from 1 to "
                            f"{MAX_BATCH}) or None (the example's), not {repr(batch)[:40]}")
    if global_batch is not None and not _positive(global_batch):
        raise MemschedError(f"fit global_batch: samples per optimizer step, a positive int, not {global_batch!r}")


def batching(example_batch: int, batch, global_batch, setup: TrainingSetup, estimate_at, device, budget,
             solver: str, what: str, say, **params) -> Batching:
    """The :class:`Batching` for ``batch``: None, ``example_batch`` (the example's, None when not read); an int;
    or ``"auto"``, the fastest of those :func:`tried_batches` tries on ``device``, ``estimate_at(size)`` giving
    the model's :class:`profiles.estimate.Estimate` at that micro-batch, each solved by ``solver`` with ``params``
    within ``budget`` (``"auto"``, bytes or a percentage, as :func:`fit` reads them), the table searched said line
    by line to ``say``."""
    if batch != "auto":
        size = example_batch if batch is None else batch
        return Batching(size, dataclasses.replace(setup, accumulate=_accumulated(global_batch, size, setup)))
    budget = budget if isinstance(budget, str) else str(budget)

    def at(size: int, accumulate: int) -> Candidate:
        say(f"batch auto: micro-batch {size} x {accumulate}...")
        return judged(estimate_at(size), size, accumulate, device, setup, solver, budget=budget, **params)

    tried = tried_batches(at, "auto", global_batch, what, device)
    chosen = best(tried)
    for line in device_plan_lines(device, tried, chosen):
        say(line)
    return Batching(chosen.batch, dataclasses.replace(setup, accumulate=chosen.accumulate), tuple(tried))


@contextlib.contextmanager
def resized_failures(size: int, loss_fn):
    """The model failing on the example made ``size`` rows long (:class:`profiles.discover.ExampleFailed`) said
    so; with a ``loss_fn`` of the user's, that one closing over targets of the example's batch cannot take
    another; the example made that long not fitting this machine's memory, said in one line."""
    try:
        yield
    except ExampleFailed as exc:
        hint = ("; a loss_fn closing over targets of the example's batch cannot take another: pass the targets "
                "among the inputs") if loss_fn is not None else ""
        raise MemschedError(f"{exc} (fit batch: the example's batched tensors given {size} rows{hint})") from None
    except RuntimeError as exc:  # the allocator, when the example made that long does not fit this machine
        if "allocate" not in str(exc) and "out of memory" not in str(exc):
            raise
        raise MemschedError(f"fit batch={size}: the example's batched tensors given {size} rows do not fit this "
                            "machine's memory; give a smaller batch, or device_spec= to estimate it on fake "
                            "tensors") from None


def _accumulated(global_batch, size: int, setup: TrainingSetup) -> int:
    """Micro-batches per optimizer step: ``global_batch / size``, else the setup's."""
    if global_batch is None:
        return setup.accumulate
    if global_batch % size:
        raise MemschedError(f"fit global_batch={global_batch} is not a multiple of the micro-batch {size}: give a "
                            "batch that divides it")
    return global_batch // size


def _positive(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
