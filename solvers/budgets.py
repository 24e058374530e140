"""Budgets of one chain: several solvers' overheads over evenly spaced budgets (``memsched pareto``), what a
device's memory leaves for the step under a training setup (:func:`budget_of`: ``memsched memory``, ``--budget
auto``), the least budget a setup's step needs (:func:`least_budget`) and what sets the least memory of a whole
training step under each optimizer update (:func:`whole_step_floors`). The floors, the budgets and the messages
of a refused budget all come from :func:`least_budget` and :func:`planner.setup.training.activation_budget`, so
they quote one figure for one setup.
"""

import dataclasses
from typing import NamedTuple, Optional

from planner import render, render_memory
from planner.errors import MemschedError
from planner.setup import TrainingSetup, account, lower
from planner.setup.account import activation_budget, describe_auto_budget
from planner.setup.training import (
    extra_gradient_bytes,
    parameters_of,
    resident_parts_on_device,
)
from planner.simulate import simulate
from planner.simulate.chain import ChainSimulator
from planner.units import describe_bytes, parse_budget
from solvers import OFFLOAD_SOLVERS, solve, store_all_peak
from solvers.minimum import least_memory_schedule, minimum_budget

CURVES = ("rotor", "sqrt", "store_all")
OFFLOAD_CURVES = ("pofo", "offload_greedy")  # pofo's table alone (not re-timed) and the greedy on store-all: fast


class Sweep(NamedTuple):
    """The solvers swept, and per budget ``(budget_bytes, {solver: overhead fraction or None})``, from the
    minimum feasible budget to the store-all peak (None: that solver has no schedule within the budget)."""

    solvers: tuple
    rows: list


def sweep(chain, points: int, slots: int = None, transfer=None, where: str = "chain") -> Sweep:
    """The overheads of :data:`CURVES` (and :data:`OFFLOAD_CURVES` over a usable ``transfer``) at ``points`` (at
    least 2) evenly spaced budgets; a one-line :class:`MemschedError` naming ``where`` for a chain that
    allocates nothing."""
    names = CURVES + (OFFLOAD_CURVES if transfer is not None and transfer.usable else ())
    low, high = minimum_budget(chain), store_all_peak(chain)
    if high == 0:
        raise MemschedError(f"{where}: chain '{chain.name}' allocates nothing (every size is 0, so is its "
                            "store-all peak): there is no memory to trade for time; profile the model again")
    rows = []
    for k in range(points):
        budget = low + (high - low) * k // (points - 1)
        rows.append((budget, {name: overhead(chain, budget, name, slots, transfer) for name in names}))
    return Sweep(solvers=names, rows=rows)


def overhead(chain, budget: int, solver: str, slots: int = None, transfer=None) -> Optional[float]:
    """The overhead fraction of ``solver``'s plan within ``budget`` bytes, or None when it has none (pofo: its
    table's figure, not re-timed)."""
    params = {"slots": slots} if solver in ("rotor", "pofo") else {}
    if solver in OFFLOAD_CURVES:
        params["transfer"] = transfer
    if solver == "pofo":
        params["time_limit"] = 0
    try:
        plan = solve(chain, budget, solver, **params)
    except MemschedError:
        return None
    return plan.predicted.overhead


def least_budget(chain, setup: TrainingSetup, solver: str = "auto") -> int:
    """Bytes: the least budget :func:`solvers.solve` accepts for ``chain`` under ``setup`` with a recomputation
    ``solver``: the least peak of the lowered step (stage options used by ``auto`` and ``hierarchical``) and what
    the setup holds beside it (:func:`planner.setup.lower`). Weights on the host are left out (their reserve
    depends on the stages chosen; the lowering does not read them)."""
    lowered = lower(chain, setup)
    return lowered.held_bytes + minimum_budget(lowered.chain, options=solver in ("auto", "hierarchical"))


def least_device_memory(chain, setup: TrainingSetup, solver: str = "auto") -> int:
    """Bytes: the least device memory whose ``--budget auto`` (:func:`budget_of`) reaches :func:`least_budget`."""
    return account(chain, setup, step=least_budget(chain, setup, solver)).total


def device_budget_report(chain, setup, device_memory: int, parameters: int) -> list:
    """The lines of the activation budget that ``device_memory`` bytes leave for ``chain``'s step under ``setup``
    (:class:`planner.setup.TrainingSetup`), against its store-all peak and least budget; a note first when the
    chain counts other than ``parameters`` trainable parameters (a CUDA estimate's blocks)."""
    lines = []
    if parameters_of(chain) != parameters:
        lines.append(f"note       the estimated chain's param_bytes count {parameters_of(chain)} parameters "
                     "(each rounded to the allocator's blocks): the budget below is computed from those")
    budget = activation_budget(chain, setup, device_memory)
    return lines + render_memory.device_budget_lines(device_memory, budget, store_all_peak(chain, setup.accumulate),
                                              least_budget(chain, setup))


class Floor(NamedTuple):
    """The least device memory of a whole training step under one optimizer ``update`` (bytes): what is
    ``resident`` before the step (parameters, master copy, optimizer state: ``parts``), the least ``step``
    budget, and at the peak of its least-memory schedule the operation there (``at``) and the ``gradients`` of
    the backwards before it still held (the rest of the step's peak is activations and temporaries)."""

    update: str
    parts: dict
    step: int
    at: str
    gradients: int

    @property
    def resident(self) -> int:
        return sum(self.parts.values())

    @property
    def total(self) -> int:
        return self.resident + self.step


def whole_step_floors(chain, setup: TrainingSetup) -> list:
    """A :class:`Floor` per update of :data:`planner.updates.UPDATES` for ``chain`` trained with ``setup``'s
    optimizer, precision and ZeRO stage (its own update ignored; on the host, every stage): its ``total`` is
    :func:`least_device_memory`, the least memory ``solve --budget auto`` accepts (stage options used)."""
    floors, steps = [], {}
    for update in setup.updates():  # (a sharded step's after the backward; pure-bf16's not on the host)
        trained = dataclasses.replace(setup, update=update, host_stages=None)
        parts = resident_parts_on_device(chain, trained)
        # on the host the step's bytes are in-backward's (its copies take time only): one least schedule for both
        kind = "after" if update == "after" else "in-backward"
        if kind not in steps:
            lowered = lower(chain, trained)  # ZeRO 2's whole parameters held beside the step
            problem = lowered.chain
            result = ChainSimulator(problem, lowered.held_bytes).run(least_memory_schedule(problem, options=True))
            peak = max(result.timeline, key=lambda step: step.peak)
            done = {step.op.stage for step in result.timeline[:peak.index] if step.op.kind == "B"}
            steps[kind] = (result.peak_bytes, _working_set(problem, peak.op),
                           sum(problem.stages[k].param_bytes for k in done))
        step, at, gradients = steps[kind]
        floors.append(Floor(update, parts, step + extra_gradient_bytes(chain, trained), at, gradients))
    return floors


def _working_set(chain, op) -> str:
    """Whose working set the operation ``op`` is: the loss head's (the loss, or the last stage's backward,
    which holds the loss's gradient), else its stage's."""
    if op.kind == "Loss" or (op.kind == "B" and op.stage == chain.length - 1):
        return f"{op} (the loss head)"
    return f"{op} ({chain.stages[op.stage].name}'s working set)"


def solve_within(chain, budget: int, solver: str, setup: TrainingSetup, how: str = None, **params):
    """:func:`solvers.solve`; for a budget that a device's memory left (``how``: how, from :func:`budget_of`), a
    budget below :func:`least_budget` is refused in one line that says so and names the least device memory."""
    try:
        return solve(chain, budget, solver, setup, **params)
    except MemschedError:
        if how and setup.host_weights is None and solver not in OFFLOAD_SOLVERS:
            least = least_budget(chain, setup, solver)
            if budget < least:
                device = least_device_memory(chain, setup, solver)
                raise MemschedError(f"--budget auto leaves {describe_bytes(budget)}, below the minimum feasible "
                                    f"{describe_bytes(least)} for chain {chain.name!r} ({how}); the least device "
                                    f"memory for this setup is {describe_bytes(device)}: use a device with more "
                                    "memory, more ranks or a higher ZeRO stage") from None
        raise


def solve_for_budget(chain, budget: str, solver: str, setup: TrainingSetup, device_memory: int = None,
                     update_auto: bool = False, **params) -> tuple:
    """``(plan, how)``: :func:`solve_within` at ``budget`` as :func:`budget_of` reads it under ``setup``, ``how``
    saying how ``--budget auto`` came about (None otherwise).

    Args:
        chain: the chain as profiled.
        budget: the step's budget as the command line gives it: bytes (``"123456789"``, ``"4GiB"``), a
            percentage of the store-all peak (``"50%"``, over ``setup.accumulate`` micro-batches), or ``"auto"``:
            what ``device_memory`` leaves once the setup's resident state is on it.
        solver: a name of :data:`solvers.SOLVER_NAMES`.
        setup: the :class:`planner.setup.TrainingSetup` to plan for.
        device_memory: bytes of the device's memory, for ``"auto"``.
        update_auto: (``--update auto``, with ``--budget auto``: the resident state differs between updates)
            solve for each of :data:`planner.updates.UPDATES` within what the device leaves under it (``on-host``
            only over a usable channel, ``transfer`` or the chain's: on the host the largest 1, 2, ... stages,
            then every stage, the others updating on the device) and keep the fastest predicted plan (the first
            on a tie: after the backward, then in it), ``how`` saying what each update's fastest took (seconds).
            Which stages go to the host is a heuristic: a stage's copies and its resident state are both in
            proportion to its parameters, and the largest first moves the most per copy.
        params: the solver's parameters, as :func:`solvers.solve` takes them (``transfer`` included).

    Returns:
        ``(plan, how)``: the :class:`planner.plan.Plan` and, for ``"auto"``, how the budget came from the
        device's memory, in words (None otherwise).

    Raises:
        MemschedError: a budget that cannot be read; ``"auto"`` without ``device_memory``, or with nothing left
            for the step; ``update_auto`` without both; under ``"auto"``, a budget below the setup's least (no
            weights on the host, no offload solver: the message states the least device memory); with
            ``update_auto``, no update fitting the device; and whatever :func:`solvers.solve` refuses.
    """
    if not update_auto:
        amount, how = budget_of(chain, budget, setup, device_memory)
        return solve_within(chain, amount, solver, setup, how, **params), how
    if budget != "auto" or device_memory is None:
        raise MemschedError("--update auto compares whole steps, whose resident state differs by update: give "
                            "--budget auto and --device-memory")
    if setup.sharded:  # the only update a sharded step takes (planner/setup/rules.py)
        plan, how = solve_for_budget(chain, budget, solver, dataclasses.replace(setup, update="after"), device_memory,
                                     **params)
        return plan, f"{how}; update after, the only one a sharded step takes"
    transfer = params.pop("transfer", None) or chain.transfer
    candidates = [(dataclasses.replace(setup, update=update), {}) for update in ("after", "in-backward")]
    if transfer is not None and transfer.usable and "on-host" in setup.updates():  # the largest stages first
        by_size = sorted((k for k, stage in enumerate(chain.stages) if stage.param_bytes),
                         key=lambda k: -chain.stages[k].param_bytes)
        candidates += [(dataclasses.replace(setup, update="on-host", host_stages=hosted), dict(transfer=transfer))
                       for hosted in [tuple(sorted(by_size[:n])) for n in range(1, len(by_size))] + [None]]
    best, times = None, {}  # update -> its fastest plan's predicted seconds (None: none fits)
    for each, given in candidates:
        try:
            plan, how = solve_for_budget(chain, budget, solver, each, device_memory, **params, **given)
        except MemschedError:
            times.setdefault(each.update, None)
            continue
        if best is None or plan.predicted.time < best[0].predicted.time:
            best = (plan, how)
        if times.get(each.update) is None or plan.predicted.time < times[each.update]:
            times[each.update] = plan.predicted.time
    said = ", ".join(f"{each} " + ("does not fit" if seconds is None else f"{seconds:.4g} s")
                     for each, seconds in times.items())
    if transfer is None or not transfer.usable:
        said += ", on-host needs a copy channel (--bandwidth)"
    if best is None:
        raise MemschedError(f"--update auto: no update fits the device ({said}); use a device with more "
                            "memory, more ranks or a higher ZeRO stage")
    return best[0], f"{best[1]}; update {best[0].update}, the fastest predicted ({said})"


def budget_of(chain, budget: str, setup: TrainingSetup, device_memory: int = None) -> tuple:
    """``(bytes, how)``: ``budget`` as :func:`planner.units.parse_budget` reads it against the store-all peak of
    ``chain``'s step (:func:`store_all_of`), and None; for ``"auto"``, the
    activation budget that ``device_memory`` bytes leave under ``setup`` and how, in words."""
    if budget != "auto":
        return parse_budget(budget, store_all_of(chain, setup)), None
    if device_memory is None:
        raise MemschedError("--budget auto is what a device's memory leaves for the step: give --device-memory "
                            "(e.g. 80GiB)")
    return (activation_budget(chain, setup, device_memory),
            describe_auto_budget(chain, setup, device_memory))


def store_all_of(chain, setup: TrainingSetup) -> int:
    """Bytes: what a percentage budget is of: the store-all peak of the chain's step (over ``setup.accumulate``
    micro-batches: :func:`solvers.store_all_peak`), or of a sharded step as it runs (its all-gathers, ZeRO 2's
    whole parameters: :func:`planner.setup.lower`)."""
    if setup.sharded:
        lowered = lower(chain, setup)
        return lowered.held_bytes + store_all_peak(lowered.chain)
    return store_all_peak(chain, setup.accumulate)


def solved_lines(plan, solver: str, chain, how: str = None) -> list:
    """The summary of a fresh plan of ``chain`` (``solver``: the one asked for), re-simulated when it moves data,
    after how ``--budget auto`` came about (``how``, from :func:`chain_budget`, if it did)."""
    result = simulate(chain, plan) if plan.moves_data else None
    return ([f"budget auto: {how}"] if how else []) + render.solve_summary(plan, solver, result)
