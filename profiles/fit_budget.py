"""``fit``'s budget: read from what the caller gives, and refused against the floor as soon as the floor is known.

:func:`budget_bytes` reads a budget in bytes, with a unit or as a percentage of the store-all peak of the step the
setup runs (over its micro-batches, or one rank's sharded step); :func:`refuse_early` refuses one below the least
feasible budget while the stages' options are still being measured, and orders the pending stages so that those
which could lower that least the most are measured first.
"""

import solvers
from planner.errors import MemschedError
from planner.setup import TrainingSetup
from planner.units import format_bytes, parse_budget
from profiles.fit_graph import offer_graph
from solvers.budgets import store_all_of
from solvers.minimum import least_budget_bound, minimum_budget
from solvers.rotor import check_length


def refuse_early(staged, chain, pending: dict, settings: dict, say, ordered: list):
    """Refuse the budget, as :func:`solvers.solve` would once every option is measured, as soon as it lies below
    the least feasible budget of ``chain`` whatever options the ``pending`` stages get (``check`` of
    :func:`profiles.options.measure_options`): exactly that least when the solver uses no options, else
    :func:`least_budget_bound`. Then, once (into ``ordered``), the pending stages in the order to measure them:
    those whose options could lower that least the most first. Only for the recomputation solvers on the chain as
    measured: the offload solvers, weights on the host, updates in the backward and accumulation have floors of their
    own. A budget below it that the step's joint graph may meet is refused naming ``graph=True`` (:func:`offer_graph`
    on the discovered ``staged`` model)."""
    solver, setup = settings["solver"], settings["setup"]
    if (solver not in ("auto", "rotor", "hierarchical") or setup != TrainingSetup(**setup.sizing())
            or setup.sharded):
        return None
    budget, store_all = budget_bytes(settings["budget"], chain), solvers.store_all_peak(chain)
    check_length(chain)
    uses_options = settings["stage_options"] and solver != "rotor"
    to_come = [j for stages in pending.values() for j in stages] if uses_options else []
    least, most = least_budget_bound(chain, to_come), minimum_budget(chain, options=True)
    share = f"{least / store_all:.1%} of the store-all peak"
    if budget < least:
        where = f"{format_bytes(least)} ({least} bytes, {share})" if least == most else (
            f"at least {format_bytes(least)} ({share}) whatever options {len(to_come)} of its stages get, and at most "
            f"{format_bytes(most)} ({most / store_all:.1%})")
        if settings["offer_graph"]:
            offer_graph(staged, chain, budget, solver, setup, least)
        raise MemschedError(f"fit budget {settings['budget']!r}: {format_bytes(budget)} ({budget} bytes) is below "
                            f"the least feasible budget for {chain.name}, {where}; raise the budget")
    say(f"{chain.name}: store-all peak {format_bytes(store_all)}; least feasible budget "
        + (f"between {format_bytes(least)} and {format_bytes(most)} ({len(pending)} stages' options to come)"
           if to_come else format_bytes(most)))
    if not to_come or budget >= most or ordered:
        return None
    ordered += sorted(pending, key=lambda k: -least_budget_bound(chain, [j for stages in pending.values()
                                                                         if stages[0] != k for j in stages]))
    return ordered


def budget_bytes(budget, chain, setup: TrainingSetup = TrainingSetup()):
    """``budget`` in bytes (a percentage of the store-all peak of ``chain``'s step under ``setup``: over its
    micro-batches, or one rank's sharded step: :func:`solvers.budgets.store_all_of`); with no chain yet, only read
    (None when it is a percentage)."""
    if isinstance(budget, bool) or not isinstance(budget, (int, str)):
        raise MemschedError(f"fit budget: give bytes (an int), a string like '6GiB' or a percentage like '50%', "
                            f"got {type(budget).__name__}")
    if chain is None and str(budget).strip().endswith("%"):
        return None
    return parse_budget(str(budget), None if chain is None else store_all_of(chain, setup), what="fit budget")
