"""One call from an unmodified model to planned training: ``fit(model, example_inputs, budget)``.

:func:`fit` discovers the model's stages (:mod:`profiles.discover`), profiles them on the example batch
(:func:`profiles.chain_profiler.profile_chain`), solves for the budget (:func:`solvers.solve`) and returns a
:class:`FittedModel`: called as the model is called, it returns the loss, computed under the plan (its
backward then runs the plan's backward); ``.plan``, ``.chain`` and ``.predicted`` say what was planned. It is
``loss = fitted(**batch); loss.backward(); optimizer.step()``, with ``fitted.parameters()`` the model's own.
"""

import dataclasses

import torch

import solvers
from planner.accumulate import check_accumulate, check_mixes
from planner.errors import MemschedError
from planner.execute.chain import apply_plan
from planner.simulate import micro_batch_peaks
from planner.units import parse_budget
from profiles.chain_profiler import profile_chain
from profiles.discover import discover, returned_loss
from profiles.fit_graph import fit_graph, offer_graph
from profiles.options import DEFAULT_OPTIONS
from profiles.precision import planned as planned_precision


def fit(model: torch.nn.Module, example_inputs, budget, loss_fn=None, solver: str = "auto", *,
        replan: bool = False, max_stages: int = None, warmup: int = 1, repeats: int = 3,
        stage_options: int = DEFAULT_OPTIONS, compile: bool = False, optimizer: str = "adam", lr: float = 1e-3,
        accumulate: int = 1, graph: bool = False, autocast=None, **options) -> "FittedModel":
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
    ``accumulate=k``: the loop adds ``k`` micro-batches' gradients before each ``optimizer.step();
    optimizer.zero_grad()``; the plan is solved for the micro-batches after the first, which start with every
    gradient held (planner/accumulate.py), and ``.micro_batch_peaks`` predicts each one's peak (a percentage
    budget is then of that step's store-all peak).

    A budget below the chain's least feasible one that the step's joint graph meets (a model whose blocks keep
    several tensors live has few cuts) fails in one line naming ``graph=True``. With ``graph=True`` the joint
    forward+backward graph is profiled (at most ``nodes=60`` nodes), solved by a graph solver (``solver``:
    ``auto``, store-all when it fits else Checkmate's MILP then Moccasin, within ``time_limit=60`` seconds) and
    run by the graph executor (profiles/fit_graph.py): the call runs the whole step and returns the loss, whose
    ``backward()`` hands over the gradients; ``.chain`` is then the graph and ``.plan`` a graph plan, which counts
    the parameters and buffers in its budget and peak (``.predicted`` leaves them out, as fit's budget does).
    ``autocast``: the mixed precision the loop runs its forward under, ``with torch.autocast(device, dtype)``
    (``torch.bfloat16``, ``torch.float16``; ``False``: none; default: the autocast state active at ``fit``): the
    step is captured, profiled and planned in it, and a call under another state is refused in one line
    (profiles/precision.py; docs/execution.md, "Mixed precision (autocast)").
    """
    return FittedModel(model, example_inputs, budget, loss_fn, solver, replan=replan, max_stages=max_stages,
                       warmup=warmup, repeats=repeats, stage_options=stage_options, compile=compile,
                       options=dict(options, optimizer=optimizer, lr=lr, accumulate=accumulate), graph=graph,
                       autocast=autocast)


@dataclasses.dataclass
class _Planned:
    """A plan for one layout of inputs: the discovery, its chain, the plan and the module that runs it."""

    discovery: object
    chain: object
    plan: object
    run: torch.nn.Module
    predicted: object = None  # the prediction on fit's footing when it is not the plan's (a graph plan's)


class FittedModel(torch.nn.Module):
    """The model of :func:`fit`: ``fitted(*args, **kwargs)`` is the loss of ``model(*args, **kwargs)`` under the
    plan. Its parameters are the model's (``model`` is its submodule)."""

    def __init__(self, model, example_inputs, budget, loss_fn, solver, *, replan, max_stages, warmup, repeats,
                 stage_options, compile, options, graph=False, autocast=None):
        super().__init__()
        _budget_bytes(budget, None)  # an unreadable budget fails before any profiling, and so does a bad accumulate
        check_mixes(check_accumulate(options["accumulate"], "fit accumulate"), update=options.get("update", "after"),
                    compile=compile)
        self.model = model
        self.precision = planned_precision(autocast, model, type(model).__name__)  # profiles/precision.py
        self._settings = dict(budget=budget, loss_fn=loss_fn, solver=solver, max_stages=max_stages,
                              warmup=warmup, repeats=repeats, stage_options=stage_options, compile=compile,
                              options=options, graph=graph)
        self.replan = replan
        self._plans = []
        self._current = self._planned(example_inputs)

    def _planned(self, example_inputs) -> _Planned:
        """Discover, profile and solve for inputs laid out as ``example_inputs``."""
        s = self._settings
        with self.precision.capturing():
            discovery = discover(self.model, example_inputs, s["loss_fn"], name=type(self.model).__name__,
                                 max_stages=s["max_stages"])
        staged = discovery.staged
        if s["graph"]:
            with self.precision.profiling():
                planned = _Planned(discovery, *fit_graph(staged, s["budget"], s["solver"], s["options"],
                                                         compile=s["compile"], warmup=s["warmup"],
                                                         repeats=s["repeats"]))
            discovery.staged = dataclasses.replace(staged, example_inputs=None)
            self._plans.append(planned)
            return planned
        with self.precision.profiling():
            chain = profile_chain(staged.stages, staged.example_inputs, loss_fn=returned_loss, warmup=s["warmup"],
                                  repeats=s["repeats"], name=staged.name, options=s["stage_options"])
        options = dict(s["options"])
        budget = _budget_bytes(s["budget"], chain, options["accumulate"])
        optimizer, lr = options.pop("optimizer"), options.pop("lr")
        offer_graph(staged, chain, budget, s["solver"], options)
        plan = solvers.solve(chain, budget, s["solver"], **options)
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
    def micro_batch_peaks(self) -> tuple:
        """Bytes: the predicted peak of each micro-batch of an optimizer step (one without ``accumulate``), the
        first's from no gradient (:func:`planner.simulate.micro_batch_peaks`; a graph plan's step is one)."""
        if self._current.predicted is not None:  # a graph plan, on fit's footing
            return (self._current.predicted.peak_bytes,)
        return micro_batch_peaks(self._current.chain, self._current.plan)

    @property
    def chain(self):
        """The profiled chain (:class:`planner.chain.Chain`) the plan was solved for (with ``graph=True``, the
        :class:`planner.graph.Graph`)."""
        return self._current.chain

    @property
    def predicted(self):
        """The simulator's prediction for the plan: ``.peak_bytes`` and ``.time`` (seconds)."""
        return self._current.predicted or self._current.plan.predicted

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
        self.precision.check_call(type(self.model).__name__)
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


def _budget_bytes(budget, chain, accumulate: int = 1):
    """``budget`` in bytes (a percentage of ``chain``'s store-all peak, over ``accumulate`` micro-batches); with no
    chain yet, only read (None when it is a percentage)."""
    if isinstance(budget, bool) or not isinstance(budget, (int, str)):
        raise MemschedError(f"fit budget: give bytes (an int), a string like '6GiB' or a percentage like '50%', "
                            f"got {type(budget).__name__}")
    if chain is None and str(budget).strip().endswith("%"):
        return None
    return parse_budget(str(budget), None if chain is None else solvers.store_all_peak(chain, accumulate),
                        what="fit budget")
