"""The plan: a schedule of operations and what the simulator predicts for it.

Every solver returns a :class:`Plan`; on disk it is ``memsched.plan/1`` JSON (docs/formats.md). A plan of
kind ``chain`` has a schedule of :class:`planner.ops.Op` (with transfers over its ``transfer`` channel for an
offload plan), one of kind ``graph`` a schedule of :class:`planner.ops.GraphOp`, and one of kind
``pipeline`` a :class:`Pipeline` whose devices carry their own chain schedules. What each operation does is
in docs/model.md. :func:`check_plan_matches` refuses a plan on a problem other than the one it was solved
for; :func:`load_plan` checks the fields only (:func:`planner.simulate.check_plan_schedules` replays the
schedules without the problem).
"""

import hashlib
import json
from dataclasses import dataclass, field
from typing import Optional

import planner.validate as validate
from planner.accumulate import check_accumulate
from planner.errors import MemschedError
from planner.graph import Graph
from planner.jsonio import read_json, write_json_atomic
from planner.measured_on import MeasuredOn
from planner.ops import FORWARD_OPS, GRAPH_OPS, ITEMS, OPS, TRANSFER_OPS, GraphOp, Op
from planner.setup.rules import Run, check
from planner.setup.training import TrainingSetup
from planner.shared import shared_from_list
from planner.transfer import Transfer
from planner.updates import check_update

PLAN_FORMAT = "memsched.plan/1"
KINDS = ("chain", "graph", "pipeline")
PIPELINE_SCHEDULES = ("1f1b", "gpipe")
# Micro-batches of one pipeline step: each is a forward and a backward on every device and a receive buffer on
# each but the first (PyTorch's schedules), and at least one sample of the batch.
MAX_MICRO_BATCHES = 2**20
_PLAN_FIELDS = ("format", "kind", "problem", "solver", "budget_bytes", "predicted", "schedule", "transfer", "pipeline",
                "update", "host_stages", "accumulate", "setup", "check")
_PIPELINE_FIELDS = ("schedule", "micro_batches", "bandwidth", "latency", "setup", "devices", "shared")
_DEVICE_FIELDS = ("first", "last", "schedule", "peak_bytes", "time")
_PREDICTED_FIELDS = ("peak_bytes", "time", "baseline_time", "overhead")


@dataclass(frozen=True)
class Predicted:
    """What the simulator predicts: peak bytes, step seconds, and the no-recomputation baseline."""

    peak_bytes: int
    time: float
    baseline_time: float

    @property
    def overhead(self) -> float:
        """Extra time relative to the baseline (0.15 = 15% slower)."""
        return self.time / self.baseline_time - 1.0 if self.baseline_time > 0 else 0.0


@dataclass(frozen=True)
class PipelineDevice:
    """One device of a pipeline plan: stages ``[first, last)``, its schedule (chain stage indices), and its
    predicted peak bytes and seconds per micro-batch."""

    first: int
    last: int
    schedule: tuple
    peak_bytes: int
    time: float

    def to_dict(self) -> dict:
        return {"first": self.first, "last": self.last, "schedule": [op.to_dict() for op in self.schedule],
                "peak_bytes": self.peak_bytes, "time": self.time}


@dataclass(frozen=True)
class Pipeline:
    """What a pipeline plan runs: the schedule name (``1f1b`` or ``gpipe``), micro-batches per iteration, the
    activation channel between devices (bytes/s, or None for free transfers; seconds of latency), the training
    setup (planner.setup.training.TrainingSetup's fields), the devices in order, and the chain's shared parameters
    (planner/shared.py) the devices' figures count, copied when solving: what the executor checks and sums."""

    schedule: str
    micro_batches: int
    bandwidth: Optional[float]
    latency: float
    setup: dict
    devices: tuple
    shared: tuple = ()

    def to_dict(self) -> dict:
        return {"schedule": self.schedule, "micro_batches": self.micro_batches, "bandwidth": self.bandwidth,
                "latency": self.latency, "setup": dict(self.setup), "devices": [d.to_dict() for d in self.devices],
                **({"shared": [entry.to_dict() for entry in self.shared]} if self.shared else {})}


@dataclass(frozen=True)
class Plan:
    """A solved schedule for one problem, with the solver's identity and the simulator's prediction."""

    problem_name: str
    fingerprint: str
    solver: str
    budget_bytes: int
    predicted: Predicted
    schedule: tuple
    params: dict = field(default_factory=dict)
    solve_seconds: float = 0.0
    optimal: bool = False
    kind: str = "chain"
    gap: Optional[float] = None  # relative gap to the solver's bound, when it reports one (graph solvers)
    transfer: Optional[Transfer] = None  # the copy channel an offload plan was solved for
    pipeline: Optional[Pipeline] = None  # the devices of a plan of kind "pipeline" (its schedule is empty)
    measured_on: Optional[MeasuredOn] = None  # the chain's, copied when solving: what the executor checks
    # When the optimizer updates the parameters (planner/updates.py): a chain plan other than "after" was solved,
    # and is simulated, on planner.updates.updated_chain of its chain (over ``transfer`` for "on-host").
    update: str = "after"
    host_stages: Optional[tuple] = None  # "on-host": the stages updated on the host (None: every stage)
    # Micro-batches whose gradients add up before one optimizer step (planner/accumulate.py): above 1, a chain plan
    # solved, and simulated, for the micro-batches after the first (gradients held from the start).
    accumulate: int = 1
    # What sizes the resident state (TrainingSetup.sizing(): optimizer, precision, ZeRO stage, ranks) when it is not
    # the default's (None), written as "setup".
    sizing: Optional[dict] = None

    @property
    def setup(self) -> TrainingSetup:
        """The :class:`planner.setup.TrainingSetup` the plan was solved for (its sizing the default's when not
        recorded)."""
        return TrainingSetup(**(self.sizing or {}), update=self.update, host_stages=self.host_stages,
                             host_weights=self.params.get("weights") if self.kind == "chain" else None,
                             accumulate=self.accumulate)

    @property
    def moves_data(self) -> bool:
        """True when the schedule has transfers (an offload plan)."""
        return any(op.kind in TRANSFER_OPS for op in self.schedule) if self.kind == "chain" else False

    @property
    def recomputed_forwards(self) -> int:
        """Forward operations beyond one per stage; on a graph plan, computations beyond one per node."""
        if self.kind == "pipeline":
            return sum(sum(op.kind in FORWARD_OPS for op in d.schedule) - (d.last - d.first)
                       for d in self.pipeline.devices)
        if self.kind == "graph":
            computed = [op.node for op in self.schedule if op.kind == "compute"]
            return len(computed) - len(set(computed))
        return (sum(op.kind in FORWARD_OPS for op in self.schedule)
                - len({op.stage for op in self.schedule if op.kind in FORWARD_OPS}))

    def to_dict(self) -> dict:
        """The ``memsched.plan/1`` JSON object, its ``check`` (:func:`plan_check`) last."""
        fields = self._fields()
        return {**fields, "check": plan_check(fields)}

    def _fields(self) -> dict:
        """Every field of the JSON object but ``check``."""
        if self.kind == "pipeline":
            return {**self._common_dict(), "pipeline": self.pipeline.to_dict()}
        return {
            **self._common_dict(),
            "schedule": [op.to_dict() for op in self.schedule],
            **({} if self.transfer is None else {"transfer": self.transfer.to_dict()}),
            **({} if self.update == "after" else {"update": self.update}),
            **({} if self.host_stages is None else {"host_stages": list(self.host_stages)}),
            **({} if self.accumulate == 1 else {"accumulate": self.accumulate}),
            **({} if self.sizing is None else {"setup": dict(self.sizing)}),
        }

    def _common_dict(self) -> dict:
        """Every field but the schedule (a pipeline plan's devices carry their own)."""
        return {
            "format": PLAN_FORMAT,
            "kind": self.kind,
            "problem": {"name": self.problem_name, "fingerprint": self.fingerprint,
                        **({} if self.measured_on is None else {"measured_on": self.measured_on.to_dict()})},
            "solver": {"name": self.solver, "params": dict(self.params), "solve_seconds": self.solve_seconds,
                       "optimal": self.optimal, **({} if self.gap is None else {"gap": self.gap})},
            "budget_bytes": self.budget_bytes,
            "predicted": {"peak_bytes": self.predicted.peak_bytes, "time": self.predicted.time,
                          "baseline_time": self.predicted.baseline_time, "overhead": self.predicted.overhead},
        }

    @classmethod
    def from_dict(cls, data: dict, where: str = "plan") -> "Plan":
        """Validate a ``memsched.plan/1`` object; a bad field raises a one-line :class:`MemschedError`."""
        validate.document(data, "plan", 1, _PLAN_FIELDS, where)
        kind = validate.require(data, "kind", where)
        if kind not in KINDS:
            raise MemschedError(f"{where}: plan kind {kind!r} is not supported by this memsched "
                                "(it reads 'chain', 'graph' and 'pipeline' plans)")
        if kind == "pipeline":
            if "schedule" in data or "transfer" in data:
                extra = "schedule" if "schedule" in data else "transfer"
                raise MemschedError(f"{where}: a plan of kind 'pipeline' has no top-level '{extra}'; its devices "
                                    "carry their schedules (pipeline.devices[k].schedule)")
            pipeline = _pipeline_from_dict(validate.require(data, "pipeline", where), f"{where}: pipeline")
        elif "pipeline" in data:
            raise MemschedError(f"{where}: only a plan of kind 'pipeline' has a 'pipeline' object, not one of "
                                f"kind {kind!r}")
        update = check_update(data.get("update", "after"), f"{where}: update")
        if update != "after" and kind != "chain":
            raise MemschedError(f"{where}: only a plan of kind 'chain' updates in the backward (update "
                                f"{update!r}), not one of kind {kind!r}")
        if update == "on-host" and data.get("transfer") is None:
            raise MemschedError(f"{where}: update 'on-host' copies over a channel: the plan needs its 'transfer'")
        host_stages = data.get("host_stages")
        if host_stages is not None:
            if update != "on-host":
                raise MemschedError(f"{where}: host_stages are the stages an update 'on-host' runs on the host; "
                                    f"this plan's update is {update!r}")
            if not isinstance(host_stages, list):
                raise MemschedError(f"{where}: host_stages must be a list of stage indices")
            host_stages = tuple(validate.count(k, f"{where}: host_stages[{n}]") for n, k in enumerate(host_stages))
        accumulate = check_accumulate(data.get("accumulate", 1), f"{where}: accumulate")
        if accumulate > 1 and kind != "chain":
            raise MemschedError(f"{where}: only a plan of kind 'chain' accumulates gradients over micro-batches "
                                f"(accumulate {accumulate}), not one of kind {kind!r}")
        sizing = None if "setup" not in data else _sizing(data["setup"], f"{where}: setup")
        problem = _object(validate.require(data, "problem", where), f"{where}: problem")
        validate.reject_unknown(problem, ("name", "fingerprint", "measured_on"), f"{where}: problem")
        solver = _object(validate.require(data, "solver", where), f"{where}: solver")
        validate.reject_unknown(solver, ("name", "params", "solve_seconds", "optimal", "gap"), f"{where}: solver")
        predicted = _object(validate.require(data, "predicted", where), f"{where}: predicted")
        validate.reject_unknown(predicted, _PREDICTED_FIELDS, f"{where}: predicted")
        params = solver.get("params", {})
        if not isinstance(params, dict):
            raise MemschedError(f"{where}: solver.params must be an object")
        optimal = solver.get("optimal", False)
        if not isinstance(optimal, bool):
            raise MemschedError(f"{where}: solver.optimal must be true or false")
        plan = cls(
            kind=kind,
            problem_name=validate.text(validate.require(problem, "name", f"{where}: problem"),
                                       f"{where}: problem.name"),
            fingerprint=validate.text(validate.require(problem, "fingerprint", f"{where}: problem"),
                                      f"{where}: problem.fingerprint"),
            solver=validate.text(validate.require(solver, "name", f"{where}: solver"), f"{where}: solver.name"),
            params=params,
            solve_seconds=validate.non_negative_seconds(solver.get("solve_seconds", 0.0),
                                                        f"{where}: solver.solve_seconds"),
            optimal=optimal,
            gap=_gap(solver.get("gap"), f"{where}: solver.gap"),
            budget_bytes=validate.non_negative_bytes(validate.require(data, "budget_bytes", where),
                                                     f"{where}: budget_bytes"),
            predicted=Predicted(
                peak_bytes=validate.non_negative_bytes(validate.require(predicted, "peak_bytes", f"{where}: predicted"),
                                                       f"{where}: predicted.peak_bytes"),
                time=validate.non_negative_seconds(validate.require(predicted, "time", f"{where}: predicted"),
                                                   f"{where}: predicted.time"),
                baseline_time=validate.non_negative_seconds(
                    validate.require(predicted, "baseline_time", f"{where}: predicted"),
                    f"{where}: predicted.baseline_time"),
            ),
            schedule=() if kind == "pipeline" else (
                _graph_schedule_from_list if kind == "graph" else _schedule_from_list)(
                validate.require(data, "schedule", where), f"{where}: schedule"),
            pipeline=pipeline if kind == "pipeline" else None,
            transfer=None if data.get("transfer") is None else Transfer.from_dict(data["transfer"],
                                                                                  f"{where}: transfer"),
            measured_on=None if problem.get("measured_on") is None else MeasuredOn.from_dict(
                problem["measured_on"], f"{where}: problem.measured_on"),
            update=update,
            host_stages=host_stages,
            accumulate=accumulate,
            sizing=sizing,
        )
        if kind == "chain":
            check(plan.setup, Run(transfers=plan.moves_data), where=where)
        _check_itself(plan, data, where)
        return plan


def plan_check(fields: dict) -> str:
    """``sha256:HEX`` of a plan's JSON fields (all but ``check``) as canonical JSON (keys sorted, no spaces): what
    :meth:`Plan.to_dict` writes as ``check``, so that a plan edited or damaged since is found on load."""
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def check_plan_itself(plan: Plan, where: str = "plan") -> None:
    """Refuse in one line a plan that contradicts itself: a budget of no bytes, or a predicted peak above its budget
    (no solver writes that: the plan was edited)."""
    if plan.budget_bytes < 1:
        raise MemschedError(f"{where}: budget_bytes is {plan.budget_bytes}: a plan's budget is at least 1 byte; "
                            "solve again with the budget you mean")
    if plan.predicted.peak_bytes > plan.budget_bytes:
        raise MemschedError(f"{where}: predicted.peak_bytes {plan.predicted.peak_bytes} is above budget_bytes "
                            f"{plan.budget_bytes}: no solver writes that (the plan was edited); solve again for the "
                            "budget you mean")


def _check_itself(plan: Plan, data: dict, where: str) -> None:
    """:func:`check_plan_itself`, then: refuse contents that are not those the plan's ``check`` was written for
    (edited by hand, damaged). A plan without a ``check`` (written before memsched recorded one, or an edit taken
    as its author's) is checked field by field only."""
    check_plan_itself(plan, where)
    recorded = data.get("check")
    if recorded is not None and recorded != plan_check({key: value for key, value in data.items() if key != "check"}):
        raise MemschedError(f"{where}: its contents are not those its check was written for (edited by hand or "
                            "damaged: budget, update, accumulate, setup or schedule changed); solve again, or drop "
                            "'check' to take the edit as yours (checked field by field only)")


def _sizing(raw, where: str) -> dict:
    """A plan's ``setup`` object: every field of :meth:`TrainingSetup.sizing`, valid as a setup's."""
    raw = _object(raw, where)
    fields = tuple(TrainingSetup().sizing())
    validate.reject_unknown(raw, fields, where)
    missing = [field for field in fields if field not in raw]
    if missing:
        raise MemschedError(f"{where} lacks {', '.join(missing)}: a plan's setup holds all of {', '.join(fields)} "
                            "(or is left out for the default, adam fp32 on one device); solve again")
    try:
        TrainingSetup(**raw)
    except MemschedError as exc:
        raise MemschedError(f"{where}: {exc}") from None
    return dict(raw)


def _pipeline_from_dict(raw, where: str) -> Pipeline:
    """Validate a pipeline object: field types, devices contiguous from stage 0, each op on its device's stages."""
    raw = _object(raw, where)
    validate.reject_unknown(raw, _PIPELINE_FIELDS, where)
    name = validate.require(raw, "schedule", where)
    if name not in PIPELINE_SCHEDULES:
        raise MemschedError(f"{where}.schedule must be one of {', '.join(PIPELINE_SCHEDULES)}, got {name!r}")
    micro = check_micro_batches(validate.require(raw, "micro_batches", where), f"{where}.micro_batches")
    bandwidth = raw.get("bandwidth")
    if bandwidth is not None:
        bandwidth = validate.bandwidth(bandwidth, f"{where}.bandwidth", other="null for free transfers")
    latency = validate.non_negative_seconds(raw.get("latency", 0.0), f"{where}.latency")
    setup = _object(validate.require(raw, "setup", where), f"{where}.setup")
    try:
        TrainingSetup(**setup)
    except TypeError as exc:
        raise MemschedError(f"{where}.setup: {exc}; expected fields optimizer, precision, zero, dp") from None
    except MemschedError as exc:
        raise MemschedError(f"{where}.setup: {exc}") from None
    devices_raw = validate.require(raw, "devices", where)
    if not isinstance(devices_raw, list) or not devices_raw:
        raise MemschedError(f"{where}.devices must be a non-empty list of device objects")
    devices, start = [], 0
    for s, item in enumerate(devices_raw):
        here = f"{where}.devices[{s}]"
        item = _object(item, here)
        validate.reject_unknown(item, _DEVICE_FIELDS, here)
        first, last = _index(item, "first", here), _index(item, "last", here)
        if first != start or last <= first:
            raise MemschedError(f"{here}: stages [{first}, {last}) must be a non-empty range starting at {start} "
                                "(devices hold contiguous stages, in order, from stage 0)")
        schedule = _schedule_from_list(validate.require(item, "schedule", here), f"{here}.schedule")
        for k, op in enumerate(schedule):
            if op.kind in TRANSFER_OPS:
                raise MemschedError(f"{here}.schedule[{k}]: {op.kind} is not supported in a pipeline plan")
            if op.stage is not None and not first <= op.stage < last:
                raise MemschedError(f"{here}.schedule[{k}] ({op}): stage {op.stage} is not on this device "
                                    f"(stages {first} to {last - 1})")
        devices.append(PipelineDevice(
            first=first, last=last, schedule=schedule,
            peak_bytes=validate.non_negative_bytes(validate.require(item, "peak_bytes", here), f"{here}.peak_bytes"),
            time=validate.non_negative_seconds(validate.require(item, "time", here), f"{here}.time")))
        start = last
    if name == "1f1b" and micro < len(devices):
        raise MemschedError(f"{where}: 1F1B needs at least as many micro-batches as devices ({micro} < "
                            f"{len(devices)}); solve again with more micro-batches or the gpipe schedule")
    shared = shared_from_list(raw.get("shared"), f"{where}.shared", start)
    return Pipeline(schedule=name, micro_batches=micro, bandwidth=None if bandwidth is None else float(bandwidth),
                    latency=float(latency), setup=dict(setup), devices=tuple(devices), shared=shared)


def check_micro_batches(value, where: str) -> int:
    """A pipeline step's micro-batches: a whole number from 1 to :data:`MAX_MICRO_BATCHES`, else one line."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_MICRO_BATCHES:
        shown = value if not isinstance(value, int) or value.bit_length() <= 64 else \
            f"about 2**{value.bit_length() - 1}"
        raise MemschedError(f"{where} must be a whole number from 1 to {MAX_MICRO_BATCHES} (2**20), got {shown!r}; "
                            "each micro-batch is at least one sample of the batch and a forward and a backward on "
                            "every device: no real step has more")
    return value


def _gap(value, where: str):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise MemschedError(f"{where} must be a fraction >= 0 (0.01 for 1%) or null, got {value!r}")
    return float(value)


def _object(value, where: str) -> dict:
    if not isinstance(value, dict):
        raise MemschedError(f"{where} must be a JSON object")
    return value


def _operations(raw, where: str, example: str):
    """``(where[k], item)`` for each operation object of a schedule list; a non-list or non-object is refused."""
    if not isinstance(raw, list) or not raw:
        raise MemschedError(f"{where} must be a non-empty list of operations")
    for index, item in enumerate(raw):
        here = f"{where}[{index}]"
        if not isinstance(item, dict):
            raise MemschedError(f"{here} must be an object like {example}")
        yield here, item


def _index(item: dict, key: str, here: str) -> int:
    value = validate.require(item, key, here)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise MemschedError(f"{here}: {key} must be a non-negative integer, got {value!r}")
    if value >= validate.MAX_INDEX:
        raise MemschedError(f"{here}: {key} must be below {validate.MAX_INDEX} (the most stages or nodes a problem "
                            f"has), got {value}")
    return value


def _schedule_from_list(raw, where: str) -> tuple:
    ops = []
    for here, item in _operations(raw, where, '{"op": "B", "stage": 3}'):
        validate.reject_unknown(item, ("op", "stage", "what", "option"), here)
        kind = validate.require(item, "op", here)
        if kind not in OPS:
            raise MemschedError(f"{here}: unknown op {kind!r}; expected one of {', '.join(OPS)}")
        if kind in TRANSFER_OPS:
            what = validate.require(item, "what", here)
            if what not in ITEMS:
                raise MemschedError(f"{here}: what must be one of {', '.join(ITEMS)} (what {kind} moves), got {what!r}")
            ops.append(Op(kind, _index(item, "stage", here), what))
            continue
        if "what" in item:
            raise MemschedError(f"{here}: only {', '.join(TRANSFER_OPS)} take 'what'")
        if "option" in item and kind != "F_all":
            raise MemschedError(f"{here}: only F_all takes 'option' (the stage option it runs with)")
        if kind == "Loss":
            if item.get("stage") is not None:
                raise MemschedError(f"{here}: Loss takes no stage")
            ops.append(Op("Loss"))
            continue
        option = _index(item, "option", here) if "option" in item else None
        ops.append(Op(kind, _index(item, "stage", here), option=option))
    return tuple(ops)


def _graph_schedule_from_list(raw, where: str) -> tuple:
    ops = []
    for here, item in _operations(raw, where, '{"op": "compute", "node": 3}'):
        kind = validate.require(item, "op", here)
        if kind not in GRAPH_OPS:
            raise MemschedError(f"{here}: unknown op {kind!r} in a plan of kind 'graph'; "
                                f"expected one of {', '.join(GRAPH_OPS)}")
        validate.reject_unknown(item, ("op", "node"), here)
        ops.append(GraphOp(kind, _index(item, "node", here)))
    return tuple(ops)


def check_plan_matches(plan: Plan, problem, where: str = "plan", kind: str = None) -> None:
    """Refuse to use ``plan`` on a problem (a :class:`planner.chain.Chain` or :class:`planner.graph.Graph`)
    other than the one it was solved for, or of another kind: ``kind`` when given, else any kind for that
    problem (``chain`` or ``pipeline`` for a chain, ``graph`` for a graph). ``where`` names the plan."""
    kinds = (kind,) if kind else ("graph",) if isinstance(problem, Graph) else ("chain", "pipeline")
    if plan.kind not in kinds:
        other = {"graph": "graph (memsched.graph/1)", "pipeline": "pipeline of a chain (memsched.chain/1)"}.get(
            plan.kind, "chain (memsched.chain/1)")
        raise MemschedError(f"{where} is a plan of kind '{plan.kind}', for a {other}, not for a {kinds[0]}; "
                            f"give the {plan.kind} it was solved for, or solve this {kinds[0]}")
    noun = "graph" if plan.kind == "graph" else "chain"
    actual = problem.fingerprint()
    if plan.fingerprint != actual:
        raise MemschedError(
            f"{where} was solved for {noun} '{plan.problem_name}' ({plan.fingerprint[:19]}…), "
            f"not for {noun} '{problem.name}' ({actual[:19]}…); solve again for this {noun}"
        )


def load_plan(path) -> Plan:
    """Read and validate a ``memsched.plan/1`` file, field by field; whether its schedules can run is
    :func:`planner.simulate.check_plan_schedules`' question (the command line asks it of every plan it reads)."""
    return Plan.from_dict(read_json(path), where=str(path))


def save_plan(plan: Plan, path) -> None:
    """Write ``plan`` atomically as ``memsched.plan/1``."""
    write_json_atomic(path, plan.to_dict())
