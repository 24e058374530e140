"""A chain as a training setup runs it: the one transform every solver and the simulator see (no torch).

:func:`lower` applies, in this order, the parts of a :class:`planner.setup.training.TrainingSetup` that change
what a step allocates: 1. when the optimizer updates (:func:`planner.updates.updated_chain`: gradients a
transient of each stage's backward, copies to the host for ``on-host``); 2. accumulation over micro-batches
(:func:`planner.accumulate.accumulating_chain`: every gradient held from the step's start, ``held_bytes``);
3. a sharded step, ZeRO 1-3 over 2 or more ranks (:func:`planner.sharding.sharded_chain` of the chain's
parameter layout: all-gathers, reduce-scatters and sharded gradients; ZeRO 2's whole parameters ``held_bytes``).
A sharded step updates after the backward and does not accumulate (planner/setup/rules.py). The
setup's resident state (parameters, master copy, optimizer state) is outside the step: it only sizes the budget
a device leaves (:func:`solvers.budgets.budget_of`). Weights on the host are placed in the solved schedule
(solvers/weights.py), not in the chain. Why each transform is exact: docs/model.md, "Whole-step memory".
"""

from dataclasses import dataclass

from planner.accumulate import accumulating_chain, held_gradient_bytes
from planner.setup.training import layout_of
from planner.sharding import shard_units, sharded_chain, step_constant
from planner.updates import updated_chain


@dataclass(frozen=True)
class Lowered:
    """``chain`` as the setup runs it, beside ``held_bytes`` allocated from the step's start to its end."""

    chain: object
    held_bytes: int = 0


def lower(chain, setup, transfer=None) -> Lowered:
    """``chain`` (a :class:`planner.chain.Chain`) lowered through ``setup``, the update's copies over ``transfer``
    (else the chain's channel). Its fingerprint differs from ``chain``'s whenever the setup changes it: a plan
    records the setup and the chain's own fingerprint."""
    lowered = updated_chain(chain, setup.update, transfer, setup.host_stages)
    if setup.accumulate > 1:  # (an update inside the backward does not mix with it: planner/setup/rules.py)
        return Lowered(accumulating_chain(lowered), held_gradient_bytes(lowered))
    if setup.sharded:
        units = shard_units(layout_of(chain), setup.dp)
        return Lowered(sharded_chain(lowered, setup.zero, units), step_constant(setup.zero, units))
    return Lowered(lowered)
