"""Which parts of a training setup, and of the way a plan runs, mix: every refusal once (no torch).

A plan is solved for a :class:`planner.setup.training.TrainingSetup` and run in a :class:`Run` (how the step is
executed: transfers, torch.compile, a pipeline, a sharded step, the graph executor, stage options, clipping; and
how it is planned: for a target device, under autocast, its micro-batch searched, a global batch).
:data:`RULES` lists each pair of features that cannot be combined and why, :data:`NEEDS` each feature that needs
another; :func:`check` refuses the first pair present (or need missing), in one line that names both as the user
gave them (:data:`FLAGS`: the command line's flags or :func:`profiles.fit.fit`'s keywords) and asks to drop one
(or give the other). The solver, the executor, ``fit`` and the command line all call :func:`check`, so a
combination is refused with the same words wherever it is met.
"""

from dataclasses import dataclass

from planner.errors import MemschedError


@dataclass(frozen=True)
class Run:
    """How a plan runs, beside its setup: what :func:`check` reads of it."""

    transfers: bool = False  # offloading or weights on the host: a schedule with transfers
    compile: bool = False  # stage calls through torch.compile
    pipeline: bool = False  # a pipeline plan on PyTorch's pipelining engine
    sharded: bool = False  # a sharded data-parallel step (train --dp; a setup of ZeRO 1-3 over 2+ ranks is one too)
    graph: bool = False  # the joint graph, solved by a graph solver and run by the graph executor
    options: bool = False  # stages run with one of their options (selective recomputation inside a stage)
    clipping: bool = False  # the gradients' global norm clipped before the optimizer steps
    target: bool = False  # planned for a device spec: profiled on fake tensors, times estimated
    autocast: bool = False  # the step captured and run under autocast
    batch_search: bool = False  # the micro-batch searched (batch auto): the one that trains fastest on the target
    global_batch: bool = False  # samples per optimizer step given: the micro-batches accumulated follow from it


# feature -> whether a setup and a run have it
_PRESENT = {
    "accumulate": lambda setup, run: setup.accumulate > 1,
    "update": lambda setup, run: setup.update != "after",
    "transfers": lambda setup, run: run.transfers or setup.host_weights is not None,
    "compile": lambda setup, run: run.compile,
    "pipeline": lambda setup, run: run.pipeline,
    "sharded": lambda setup, run: run.sharded or setup.sharded,
    "graph": lambda setup, run: run.graph,
    "options": lambda setup, run: run.options,
    "clipping": lambda setup, run: run.clipping,
    "target": lambda setup, run: run.target,
    "autocast": lambda setup, run: run.autocast,
    "batch_search": lambda setup, run: run.batch_search,
    "global_batch": lambda setup, run: run.global_batch,
}

# feature -> how the command line and fit() spell it ({accumulate}, {update}: the setup's values)
FLAGS = {
    "cli": {
        "accumulate": "--accumulate {accumulate}",
        "update": "--update {update}",
        "transfers": "offloading (--solver offload, pofo; --offload-weights)",
        "compile": "--compile",
        "pipeline": "a pipeline plan",
        "sharded": "--dp (a sharded step)",
        "graph": "--graph",
        "options": "stage options (--solver hierarchical)",
        "clipping": "--max-grad-norm",
        "target": "--device-spec",
        "autocast": "--autocast",
        "batch_search": "--batch auto",
        "global_batch": "--global-batch",
    },
    "fit": {
        "accumulate": "accumulate={accumulate}",
        "update": "update={update!r}",
        "transfers": "offloading (solver='offload', 'pofo'; weights=)",
        "compile": "compile=True",
        "pipeline": "a pipeline plan",
        "sharded": "a sharded step",
        "graph": "graph=True",
        "options": "stage options",
        "clipping": "clipping the gradients",
        "target": "device_spec=",
        "autocast": "autocast",
        "batch_search": "batch='auto'",
        "global_batch": "global_batch=",
    },
}


@dataclass(frozen=True)
class Rule:
    """``first`` and ``second`` (features of :data:`FLAGS`) do not mix, because of ``why``."""

    first: str
    second: str
    why: str


RULES = (
    Rule("accumulate", "update", "an update inside the backward frees the gradients that accumulation adds up"),
    Rule("accumulate", "transfers", "accumulating steps add each stage's gradients into .grad after the one "
                                    "before, which only eager plans without transfers do"),
    Rule("accumulate", "compile", "stages merged into one compiled call make their gradients together"),
    Rule("accumulate", "pipeline", "a pipeline's micro-batches are its own"),
    Rule("accumulate", "sharded", "a sharded step reduces each backward's gradients"),
    Rule("accumulate", "graph", "a graph plan's step starts without gradients"),
    Rule("update", "transfers", "the update inside the backward runs plans without transfers"),
    Rule("update", "compile", "the update inside the backward runs each stage's backward eagerly, on its own"),
    Rule("update", "sharded", "a sharded step updates after the backward"),
    Rule("update", "graph", "a graph plan updates after the backward"),
    Rule("update", "clipping", "clipping needs every gradient before any update"),
    Rule("compile", "transfers", "offloading runs eagerly"),
    Rule("compile", "sharded", "a sharded step runs eagerly"),
    Rule("compile", "graph", "the graph executor runs the joint graph node by node"),
    Rule("compile", "pipeline", "a pipeline plan runs on PyTorch's pipelining engine"),
    Rule("options", "transfers", "a schedule with transfers runs every stage whole"),
    Rule("options", "sharded", "a sharded step runs every stage whole"),
    Rule("transfers", "sharded", "a sharded step runs without transfers"),
    Rule("graph", "sharded", "a sharded step runs a chain plan on the stages"),
    Rule("target", "graph", "a device spec plans a chain of stages on fake tensors; the joint graph is profiled on "
                            "this device"),
    Rule("autocast", "graph", "the joint graph's run does not reproduce autocast's values and bytes (GPT-2 under "
                              "bf16: gradients off by bf16 rounding, 11% over its predicted peak)"),
    Rule("global_batch", "accumulate", "the global batch sets the micro-batches accumulated (global batch / "
                                       "micro-batch)"),
)


@dataclass(frozen=True)
class Need:
    """``feature`` (of :data:`FLAGS`) needs ``needed``, because of ``why``."""

    feature: str
    needed: str
    why: str


NEEDS = (
    Need("batch_search", "target", "the micro-batch that trains fastest is searched on a device's estimate (a name "
                                   "such as h100-80gb, or cpu: this machine measured)"),
)


def check(setup, run: Run = Run(), interface: str = "cli", where: str = None) -> None:
    """Refuse, in one :class:`MemschedError` line, the first rule of :data:`RULES` that ``setup`` (a
    :class:`planner.setup.training.TrainingSetup`) and ``run`` break, or the first of :data:`NEEDS` they lack,
    naming both features as ``interface`` (``"cli"`` or ``"fit"``) spells them; ``where`` (a plan file) prefixes
    the message."""
    prefix = f"{where}: " if where else ""
    for rule in RULES:
        if _PRESENT[rule.first](setup, run) and _PRESENT[rule.second](setup, run):
            first, second = (_spelled(feature, setup, interface) for feature in (rule.first, rule.second))
            raise MemschedError(f"{prefix}{first} does not mix with {second}: {rule.why}; drop one of them")
    for need in NEEDS:
        if _PRESENT[need.feature](setup, run) and not _PRESENT[need.needed](setup, run):
            feature, needed = (_spelled(name, setup, interface) for name in (need.feature, need.needed))
            raise MemschedError(f"{prefix}{feature} needs {needed}: {need.why}; give {needed}, or drop {feature}")


def _spelled(feature: str, setup, interface: str) -> str:
    return FLAGS[interface][feature].format(accumulate=setup.accumulate, update=setup.update)
