"""One call from an unmodified model to planned training: ``fit(model, example_inputs, budget)``.

:func:`fit` discovers the model's stages (:mod:`profiles.discover`), profiles them on the example batch
(:func:`profiles.chain_profiler.profile_chain`), solves for the budget (:func:`solvers.solve`) and returns a
:class:`FittedModel`: called as the model is called, it returns the loss, computed under the plan (its
backward then runs the plan's backward); ``.plan``, ``.chain`` and ``.predicted`` say what was planned. It is
``loss = fitted(**batch); loss.backward(); optimizer.step()``, with ``fitted.parameters()`` the model's own.
"""

import dataclasses
import sys
import time

import torch

import solvers
from planner.errors import MemschedError
from planner.execute.chain import apply_plan
from planner.units import format_bytes, parse_budget
from profiles.chain_profiler import profile_chain
from profiles.discover import discover, returned_loss
from profiles.options import DEFAULT_OPTIONS
from solvers.minimum import least_budget_bound, minimum_budget
from solvers.rotor import check_length


def fit(model: torch.nn.Module, example_inputs, budget, loss_fn=None, solver: str = "auto", *,
        replan: bool = False, max_stages: int = None, warmup: int = 1, repeats: int = 3,
        stage_options: int = DEFAULT_OPTIONS, compile: bool = False, optimizer: str = "adam", lr: float = 1e-3,
        progress=True, **options) -> "FittedModel":
    """``model`` planned to train within ``budget`` on batches laid out as ``example_inputs``.

    ``example_inputs``: a tensor, a tuple of positional arguments or a dict of keyword arguments (as the model
    is called). ``budget``: bytes (an int), a string with a unit (``"6GiB"``) or a percentage of the store-all
    peak (``"50%"``); a budget below the least feasible one fails in one line saying what that is.
    ``loss_fn(output)``: the scalar loss (default: ``output.loss`` when the model returns one, else the mean of
    its output). ``solver``: as for ``memsched solve`` (``auto``: store everything when it fits, else the
    hierarchical solver over the stages' options, or rotor without them); ``options`` go to it. A batch of
    other shapes, dtypes or arguments is refused in one line, or planned for anew with ``replan=True`` (the
    plans kept per layout). ``warmup`` and ``repeats``: the profiler's runs per stage; ``max_stages``: at most
    that many stages; ``stage_options``: candidates measured per distinct stage (profiles/options.py; 0:
    none); ``compile``: the plan runs through ``torch.compile`` (planner/execute/chain.py). With the option
    ``update="in-backward"`` (or ``"on-host"``, with a ``transfer`` channel: planner/updates.py) the backward
    also updates the parameters, by ``optimizer`` (sgd, momentum, adam, adamw) at ``lr``, freeing each stage's
    gradients as it goes: the loop is ``fitted(**batch).backward()``, without an optimizer of its own.
    ``progress``: planning tells what it does on stderr, a line at a time (stages discovered, each stage measured
    or shared with an identical one, each stage's options, the solve); False: nothing; a callable: each line to it.
    A budget is refused as soon as it is known to be too small: before the stages' options are measured when it
    is below the least that any options could reach (``solvers.minimum.least_budget_bound``).
    """
    say = progress if callable(progress) else _on_stderr if progress else (lambda line: None)
    return FittedModel(model, example_inputs, budget, loss_fn, solver, replan=replan, max_stages=max_stages,
                       warmup=warmup, repeats=repeats, stage_options=stage_options, compile=compile,
                       options=dict(options, optimizer=optimizer, lr=lr), say=say)


@dataclasses.dataclass
class _Planned:
    """A plan for one layout of inputs: the discovery, its chain, the plan and the module that runs it."""

    discovery: object
    chain: object
    plan: object
    run: torch.nn.Module


class FittedModel(torch.nn.Module):
    """The model of :func:`fit`: ``fitted(*args, **kwargs)`` is the loss of ``model(*args, **kwargs)`` under the
    plan. Its parameters are the model's (``model`` is its submodule)."""

    def __init__(self, model, example_inputs, budget, loss_fn, solver, *, replan, max_stages, warmup, repeats,
                 stage_options, compile, options, say):
        super().__init__()
        _budget_bytes(budget, None)  # an unreadable budget fails before any profiling
        self.model = model
        self._settings = dict(budget=budget, loss_fn=loss_fn, solver=solver, max_stages=max_stages,
                              warmup=warmup, repeats=repeats, stage_options=stage_options, compile=compile,
                              options=options)
        self._say = say
        self.replan = replan
        self._plans = []
        self._current = self._planned(example_inputs)

    def _planned(self, example_inputs) -> _Planned:
        """Discover, profile and solve for inputs laid out as ``example_inputs``."""
        s, say, started = self._settings, self._say, time.perf_counter()
        name = type(self.model).__name__
        say(f"fit: discovering {name}'s stages...")
        discovery = discover(self.model, example_inputs, s["loss_fn"], name=name, max_stages=s["max_stages"])
        staged = discovery.staged
        say(f"{name}: {len(staged.stages)} stages discovered in {_since(started)}; profiling them...")
        options = dict(s["options"])
        optimizer, lr, ordered = options.pop("optimizer"), options.pop("lr"), []
        chain = profile_chain(staged.stages, staged.example_inputs, loss_fn=returned_loss, warmup=s["warmup"],
                              repeats=s["repeats"], name=staged.name, options=s["stage_options"],
                              say=lambda line: say(f"  {line}"),
                              check=lambda so_far, pending: _refuse_early(so_far, pending, s, options, say, ordered))
        budget = _budget_bytes(s["budget"], chain)
        say(f"{name}: discovered and profiled in {_since(started)}; solving for {format_bytes(budget)}...")
        solving = time.perf_counter()
        plan = solvers.solve(chain, budget, s["solver"], **options)
        say(f"{name}: planned in {_since(solving)} ({plan.solver}): predicted peak "
            f"{format_bytes(plan.predicted.peak_bytes)}, {plan.predicted.overhead:.1%} slower than storing everything")
        # the example batch is not kept: it would sit in memory beside every step
        discovery.staged = dataclasses.replace(staged, example_inputs=None)
        run = apply_plan(staged.stages, plan, chain, compile=s["compile"], optimizer=optimizer, lr=lr)
        planned = _Planned(discovery, chain, plan, run)
        self._plans.append(planned)
        return planned

    @property
    def plan(self):
        """The plan the next call runs by (:class:`planner.plan.Plan`)."""
        return self._current.plan

    @property
    def chain(self):
        """The profiled chain (:class:`planner.chain.Chain`) the plan was solved for."""
        return self._current.chain

    @property
    def predicted(self):
        """The simulator's prediction for the plan: ``.peak_bytes`` and ``.time`` (seconds)."""
        return self._current.plan.predicted

    @property
    def discovery(self):
        """The stages found (:class:`profiles.discover.Discovery`; ``describe()`` gives lines for people)."""
        return self._current.discovery

    def _apply(self, fn, *args, **kwargs):
        """``.to()``, ``.cuda()``, ``.half()`` and the like are refused: the plan was measured on the model as it
        was (device, dtypes), and its stages hold the model's buffers as they were then."""
        raise MemschedError("a fitted model is planned for the device and dtypes it was fitted on: move or cast "
                            "the model and its batch first, then call fit")

    def forward(self, *args, **kwargs):
        try:
            inputs = self._current.discovery.chain_inputs(args, kwargs)
        except MemschedError:
            if not self.replan:
                raise
            self._current = self._matching(args, kwargs) or self._planned(_example(args, kwargs))
            inputs = self._current.discovery.chain_inputs(args, kwargs)
        return self._current.run(*inputs)

    def _matching(self, args, kwargs):
        """The plan already made for inputs laid out as these, if any."""
        for planned in self._plans:
            try:
                planned.discovery.check_batch(args, kwargs)
            except MemschedError:
                continue
            return planned
        return None


def _example(args: tuple, kwargs: dict):
    """A batch as :func:`fit` takes example inputs: the keywords, else the positional arguments."""
    if args and kwargs:
        raise MemschedError("fit(..., replan=True) plans again for positional or keyword inputs, not both at once")
    return kwargs or args


def _on_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _since(started: float) -> str:
    return f"{time.perf_counter() - started:.1f} s"


def _refuse_early(chain, pending: dict, settings: dict, options: dict, say, ordered: list):
    """Refuse the budget, as :func:`solvers.solve` would once every option is measured, as soon as it lies below
    the least feasible budget of ``chain`` whatever options the ``pending`` stages get (``check`` of
    :func:`profiles.options.measure_options`): exactly that least when the solver uses no options, else
    :func:`least_budget_bound`. Then, once (into ``ordered``), the pending stages in the order to measure them:
    those whose options could lower that least the most first. Only for the recomputation solvers on the chain as
    measured: the offload solvers, weights on the host and updates in the backward have floors of their own."""
    solver = settings["solver"]
    if solver not in ("auto", "rotor", "hierarchical") or options.get("weights") is not None or \
            options.get("update", "after") != "after":
        return None
    budget, store_all = _budget_bytes(settings["budget"], chain), solvers.store_all_peak(chain)
    check_length(chain)
    uses_options = settings["stage_options"] and solver != "rotor"
    to_come = [j for stages in pending.values() for j in stages] if uses_options else []
    least, most = least_budget_bound(chain, to_come), minimum_budget(chain, options=True)
    share = f"{least / store_all:.1%} of the store-all peak"
    if budget < least:
        where = f"{format_bytes(least)} ({least} bytes, {share})" if least == most else (
            f"at least {format_bytes(least)} ({share}) whatever options {len(to_come)} of its stages get, and at most "
            f"{format_bytes(most)} ({most / store_all:.1%})")
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


def _budget_bytes(budget, chain):
    """``budget`` in bytes (a percentage of ``chain``'s store-all peak); with no chain yet, only read (None when it
    is a percentage)."""
    if isinstance(budget, bool) or not isinstance(budget, (int, str)):
        raise MemschedError(f"fit budget: give bytes (an int), a string like '6GiB' or a percentage like '50%', "
                            f"got {type(budget).__name__}")
    if chain is None and str(budget).strip().endswith("%"):
        return None
    return parse_budget(str(budget), None if chain is None else solvers.store_all_peak(chain), what="fit budget")
