"""Malformed input, for every command that reads it (issue 13): one line ``memsched: error: ...``, exit 2, no
traceback, and nothing run or written.

The table crosses each kind of bad file (not UTF-8, nested 10 000 deep, a 5000-digit number, a device...) with
every command that reads that kind of file, then each absurd but parseable field of each format (chain, plan,
offload plan, pipeline plan, graph) with its readers, hand-edited schedules, and unbounded or meaningless
command-line numbers. The commands run in-process through ``cli.main``; a few run as the real program, to show
that no traceback reaches a user and that what used to hang now answers.
"""

import copy
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

import cli
import solvers
from checks import one_error_line
from paths import ROOT
from planner import Chain, MemschedError, simulate
from planner.graph import Graph
from planner.ops import Op
from planner.setup import TrainingSetup
from planner.simulate import check_plan_schedules, check_schedule
from planner.simulate.replay import ScheduleError
from planner.transfer import Transfer
from profiles.synthetic import random_chain
from solvers import solve_graph
from solvers.minimum import minimum_budget
from solvers.partition import partition

SPEC = "mlp:layers=3,width=16,batch=4"  # three stages, as the documents below

CHAIN = {
    "format": "memsched.chain/1", "name": "tiny", "device": "cpu", "input_bytes": 1000,
    "stages": [{"name": name, "fwd_time": 0.01, "bwd_time": 0.02, "out_bytes": 2000, "saved_bytes": 5000,
                "fwd_tmp_bytes": 100, "bwd_tmp_bytes": 200, "param_bytes": 300} for name in ("a", "b", "c")],
    "loss": {"bwd_time": 0.001, "tmp_bytes": 10},
}
GRAPH = {
    "format": "memsched.graph/1", "name": "g", "device": "cpu", "source": "synthetic", "fixed_bytes": 64,
    "nodes": [{"name": "fwd", "time": 0.01, "out_bytes": 100, "deps": []},
              {"name": "loss", "time": 0.001, "out_bytes": 4, "deps": [0], "keep": True},
              {"name": "bwd", "time": 0.02, "out_bytes": 100, "deps": [0, 1], "backward": True, "keep": True}],
}
# An offload schedule of the three stages: ā_1 copied out during F_all 1 and back for B 1.
OFFLOAD_SCHEDULE = (Op("F_all", 0), Op("Offload", 0, "saved"), Op("F_all", 1), Op("Release", 0, "saved"),
                    Op("F_all", 2), Op("Loss"), Op("B", 2), Op("Prefetch", 0, "saved"), Op("B", 1), Op("B", 0))


@pytest.fixture(scope="module")
def docs():
    """The valid documents every bad one is edited from: chain, graph, and plans of each kind."""
    chain = Chain.from_dict(CHAIN)
    plan = solvers.solve(chain, 10**6, "store_all")
    offload = dataclasses.replace(plan, solver="hand", schedule=OFFLOAD_SCHEDULE, transfer=Transfer(1e9, 1e9))
    simulate(chain, offload)  # valid as it stands
    graph = Graph.from_dict(GRAPH)
    plans = {"plan": plan, "offload_plan": offload, "pipeline_plan": partition(chain, 2, 2**30, 2),
             "graph_plan": solve_graph(graph, 10**6, "store_all")}
    # without their check: each bad one below is an edit taken as its author's, checked field by field
    return {"chain": CHAIN, "graph": GRAPH, **{name: _unchecked(plan.to_dict()) for name, plan in plans.items()}}


def _unchecked(plan: dict) -> dict:
    return {key: value for key, value in plan.items() if key != "check"}


@pytest.fixture(scope="module")
def good(docs, tmp_path_factory):
    """The valid documents as files (paths as strings)."""
    folder = tmp_path_factory.mktemp("good")
    for name, doc in docs.items():
        (folder / f"{name}.json").write_text(json.dumps(doc))
    return {name: str(folder / f"{name}.json") for name in docs}


# --- what reads each kind of file: argv for a bad file at ``path`` (the other files valid) ---------------------

READERS = {
    "chain": {
        "solve": lambda path, good: ["solve", path, "--budget", "1GiB"],
        "pareto": lambda path, good: ["pareto", path, "--points", "2"],
        "memory": lambda path, good: ["memory", path],
        "partition": lambda path, good: ["partition", path, "--devices", "2", "--micro-batches", "2",
                                         "--device-memory", "1GiB"],
        "show --chain": lambda path, good: ["show", good["plan"], "--chain", path],
        "train --chain": lambda path, good: ["train", SPEC, "--chain", path, "--budget", "1GiB", "--steps", "1"],
    },
    "plan": {
        "show": lambda path, good: ["show", path],
        "show --chain": lambda path, good: ["show", path, "--chain", good["chain"]],
        "train --plan": lambda path, good: ["train", SPEC, "--plan", path, "--steps", "1"],
    },
    "graph": {
        "solve": lambda path, good: ["solve", path, "--budget", "1GiB"],
        "show --graph": lambda path, good: ["show", good["graph_plan"], "--graph", path],
        "train --graph": lambda path, good: ["train", SPEC, "--graph", path, "--budget", "1GiB", "--steps", "1"],
    },
}

# --- files that are no memsched JSON at all: (id, content, fragment of the error) ------------------------------

GARBAGE = [
    ("binary", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff", "not UTF-8"),
    ("utf-16", json.dumps(CHAIN).encode("utf-16"), "UTF-16"),
    ("nested-lists-10000-deep", "[" * 10_000 + "]" * 10_000, "nested too deep"),
    ("nested-objects-10000-deep", '{"a": ' * 10_000 + "1" + "}" * 10_000, "nested too deep"),
    ("nested-100-deep", '{"format": ' + "[" * 100 + "]" * 100 + "}", "nested more than 64"),
    ("5000-digit-integer", json.dumps(CHAIN).replace('"input_bytes": 1000', '"input_bytes": ' + "7" * 5000),
     "5000 digits"),
    ("empty", "", "not valid JSON"),
    ("device", "/dev/zero", "is a device"),
    ("folder", None, "cannot read"),
]


def _write(folder: Path, content) -> str:
    """A file ``bad.json`` holding ``content`` (a dict as JSON, text, bytes; a /dev path: a link to that device;
    None: a folder)."""
    path = folder / "bad.json"
    if content is None:
        path.mkdir()
    elif isinstance(content, str) and content.startswith("/dev/"):
        path.symlink_to(content)
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


# --- absurd but parseable fields: (kind read, id, base document, edit, fragment) --------------------------------

def _set(path: str, value):
    """An edit setting the field at ``path`` (``a.b.0.c``: keys and list indices) to ``value``."""
    def edit(doc):
        *parents, last = [int(key) if key.isdigit() else key for key in path.split(".")]
        for key in parents:
            doc = doc[key]
        doc[last] = value
    return edit


def _all(*edits):
    def edit(doc):
        for one in edits:
            one(doc)
    return edit


def _schedule(change):
    """An edit of a plan's schedule: ``change(list of op objects) -> list``."""
    def edit(doc):
        doc["schedule"] = change(doc["schedule"])
    return edit


def _without(kind, what=None):
    return _schedule(lambda ops: [op for op in ops if not (op["op"] == kind and op.get("what") == what)])


def _backwards(ops):
    return [k for k, op in enumerate(ops) if op["op"] == "B"]


FIELDS = [
    # chains
    ("chain", "input-bytes-beyond-int64", "chain", _set("input_bytes", 2**64), "input_bytes"),
    ("chain", "out-bytes-1e30", "chain", _set("stages.1.out_bytes", 1e30), "stages[1] (b).out_bytes"),
    ("chain", "fwd-time-1e30-seconds", "chain", _set("stages.0.fwd_time", 1e30), "fwd_time = 1e+30 seconds"),
    ("chain", "bwd-time-two-years", "chain", _set("stages.2.bwd_time", 2 * 365 * 86400.0), "more than a year"),
    ("chain", "loss-time-1e30", "chain", _set("loss.bwd_time", 1e30), "loss.bwd_time"),
    ("chain", "loss-tmp-bytes-2**61", "chain", _set("loss.tmp_bytes", 2**61), "loss.tmp_bytes"),
    ("chain", "sizes-add-up-beyond-1-EiB", "chain",
     _all(*(_set(f"stages.{i}.{field}", 2**59) for i in range(3) for field in ("out_bytes", "saved_bytes"))),
     "add up"),
    ("chain", "bandwidth-1e30", "chain", _set("transfer", {"d2h_bandwidth": 1e30, "h2d_bandwidth": 1e9}),
     "d2h_bandwidth"),
    ("chain", "bandwidth-below-1-byte-per-second", "chain",
     _set("transfer", {"d2h_bandwidth": 1e9, "h2d_bandwidth": 1e-300}), "h2d_bandwidth"),
    ("chain", "latency-1e30", "chain", _set("transfer", {"d2h_bandwidth": 1e9, "h2d_bandwidth": 1e9, "latency": 1e30}),
     "latency"),
    # chain plans
    ("plan", "budget-1e30-bytes", "plan", _set("budget_bytes", 1e30), "budget_bytes"),
    ("plan", "predicted-peak-beyond-int64", "plan", _set("predicted.peak_bytes", 2**64), "predicted.peak_bytes"),
    ("plan", "predicted-time-1e30", "plan", _set("predicted.time", 1e30), "predicted.time"),
    ("plan", "solve-seconds-infinite", "plan", _set("solver.solve_seconds", 1e999), "solver.solve_seconds"),
    ("plan", "stage-index-2**40", "plan", _set("schedule.0.stage", 2**40), "stage must be below"),
    ("plan", "backward-skipped", "plan",
     _schedule(lambda ops: [op for k, op in enumerate(ops) if k != _backwards(ops)[1]]),
     "schedule[5] (B 0): δ_1 is not in memory"),
    ("plan", "backward-doubled", "plan", _schedule(lambda ops: ops[:_backwards(ops)[1] + 1] + ops[_backwards(ops)[1]:]),
     "schedule[6] (B 1): the backward of stage 1 has already run"),
    ("plan", "no-loss", "plan", _without("Loss"), "schedule[3] (B 2): δ_3 is not in memory (run the loss first)"),
    ("plan", "only-loss", "plan", _schedule(lambda ops: [{"op": "Loss"}]), "runs no forward or backward"),
    ("plan", "backward-first", "plan", _schedule(lambda ops: [ops[_backwards(ops)[0]]] + ops),
     "schedule[0] (B 2): ā_3 is not in memory"),
    ("plan", "truncated", "plan", _schedule(lambda ops: ops[:-2]), "schedule ends before the backward of stage 1"),
    ("plan", "forward-after-its-backward", "plan", _schedule(lambda ops: ops + [{"op": "F_all", "stage": 0}]),
     "schedule[7] (F_all 0): the backward of stage 0 has already run"),
    # offload plans
    ("plan", "offload-release-without-offload", "offload_plan", _without("Offload", "saved"),
     "(Release 0 saved): saved 0 is not being offloaded"),
    ("plan", "offload-prefetch-without-release", "offload_plan", _without("Release", "saved"),
     "(Prefetch 0 saved): saved 0 is not on the host"),
    ("plan", "offload-read-while-on-host", "offload_plan", _without("Prefetch", "saved"),
     "(B 1): saved 0 is on the host"),
    ("plan", "offload-bandwidth-1e30", "offload_plan", _set("transfer.d2h_bandwidth", 1e30), "transfer.d2h_bandwidth"),
    # pipeline plans
    ("plan", "pipeline-bandwidth-0", "pipeline_plan", _set("pipeline.bandwidth", 0), "pipeline.bandwidth"),
    ("plan", "pipeline-latency-1e30", "pipeline_plan", _set("pipeline.latency", 1e30), "pipeline.latency"),
    ("plan", "pipeline-device-time-1e30", "pipeline_plan", _set("pipeline.devices.0.time", 1e30), "devices[0].time"),
    ("plan", "pipeline-device-peak-beyond-int64", "pipeline_plan", _set("pipeline.devices.1.peak_bytes", 2**64),
     "devices[1].peak_bytes"),
    ("plan", "pipeline-micro-batches-2**40", "pipeline_plan", _set("pipeline.micro_batches", 2**40), "micro_batches"),
    ("plan", "pipeline-device-backward-skipped", "pipeline_plan",
     lambda doc: doc["pipeline"]["devices"][1]["schedule"].pop(-1), "pipeline.devices[1]"),
    # graphs and graph plans
    ("graph", "fixed-bytes-beyond-int64", "graph", _set("fixed_bytes", 2**64), "fixed_bytes"),
    ("graph", "node-time-1e30", "graph", _set("nodes.0.time", 1e30), "nodes[0].time"),
    ("graph", "node-out-bytes-1e30", "graph", _set("nodes.1.out_bytes", 1e30), "nodes[1].out_bytes"),
    ("graph", "sizes-add-up-beyond-1-EiB", "graph",
     _all(*(_set(f"nodes.{i}.out_bytes", 2**59) for i in range(3))), "add up"),
    ("plan", "graph-plan-budget-1e30", "graph_plan", _set("budget_bytes", 1e30), "budget_bytes"),
    ("plan", "graph-plan-node-2**40", "graph_plan", _set("schedule.0.node", 2**40), "node must be below"),
]

ZERO_CHAIN = {**CHAIN, "input_bytes": 0, "loss": {"bwd_time": 0.0, "tmp_bytes": 0},
              "stages": [{"name": s["name"], "fwd_time": 0.01, "bwd_time": 0.02, "out_bytes": 0, "saved_bytes": 0}
                         for s in CHAIN["stages"]]}

# --- command-line numbers: (id, argv with {chain}, {plan}, {graph}... for the valid files, fragment) ---------------

ARGUMENTS = [
    ("solve-budget-1e999999", ["solve", "{chain}", "--budget", "1e999999"], "at most 1 EiB"),
    ("solve-budget-1e9999999-percent", ["solve", "{chain}", "--budget", "1e9999999%"], "at most 1 EiB"),
    ("solve-budget-nan", ["solve", "{chain}", "--budget", "nan"], "cannot read 'nan'"),
    ("solve-budget-negative", ["solve", "{chain}", "--budget=-5GiB"], "cannot read '-5GiB'"),
    ("solve-budget-inf", ["solve", "{chain}", "--budget", "inf"], "cannot read 'inf'"),
    ("solve-device-memory-1e999999", ["solve", "{chain}", "--budget", "auto", "--device-memory", "1e999999"],
     "--device-memory"),
    ("solve-moccasin-time-limit-inf", ["solve", "{graph}", "--budget", "100%", "--solver", "moccasin",
                                       "--time-limit", "inf"], "--time-limit must be a positive"),
    ("solve-checkmate-time-limit-two-years", ["solve", "{graph}", "--budget", "100%", "--solver", "checkmate",
                                              "--time-limit", "63072000"], "at most a year"),
    ("solve-pofo-time-limit-nan", ["solve", "{chain}", "--budget", "60%", "--solver", "pofo", "--bandwidth",
                                   "1GB/s", "--time-limit", "nan"], "--time-limit must be a positive"),
    ("solve-offload-time-limit-negative", ["solve", "{chain}", "--budget", "60%", "--solver", "offload",
                                           "--bandwidth", "1GB/s", "--time-limit", "-1"], "--time-limit"),
    ("solve-bandwidth-0", ["solve", "{chain}", "--budget", "60%", "--solver", "pofo", "--bandwidth", "0"],
     "moves nothing"),
    ("solve-bandwidth-nan", ["solve", "{chain}", "--budget", "60%", "--solver", "pofo", "--bandwidth", "nan"],
     "--bandwidth"),
    ("solve-bandwidth-1e999", ["solve", "{chain}", "--budget", "60%", "--solver", "pofo", "--bandwidth", "1e999GB/s"],
     "--bandwidth"),
    ("solve-h2d-bandwidth-tiny", ["solve", "{chain}", "--budget", "60%", "--solver", "pofo", "--bandwidth", "1GB/s",
                                  "--h2d-bandwidth", "1e-300"], "--h2d-bandwidth"),
    ("solve-latency-nan", ["solve", "{chain}", "--budget", "60%", "--solver", "pofo", "--bandwidth", "1GB/s",
                           "--latency", "nan"], "--latency"),
    ("solve-latency-inf", ["solve", "{chain}", "--budget", "60%", "--solver", "pofo", "--bandwidth", "1GB/s",
                           "--latency", "inf"], "--latency"),
    ("solve-latency-1e30", ["solve", "{chain}", "--budget", "60%", "--solver", "pofo", "--bandwidth", "1GB/s",
                            "--latency", "1e30"], "more than a year"),
    ("solve-slots-negative", ["solve", "{chain}", "--budget", "60%", "--slots", "-1"], "argument --slots"),
    ("solve-slots-5000-digits", ["solve", "{chain}", "--budget", "60%", "--slots", "9" * 5000], "whole number"),
    ("solve-segments-0", ["solve", "{chain}", "--budget", "60%", "--solver", "sqrt", "--segments", "0"],
     "argument --segments"),
    ("solve-max-computations-1e6", ["solve", "{graph}", "--budget", "100%", "--solver", "moccasin",
                                    "--max-computations", "1000000"], "at most 100"),
    ("solve-gap-nan", ["solve", "{graph}", "--budget", "100%", "--solver", "checkmate", "--gap", "nan"], "--gap"),
    ("pareto-points-1e7", ["pareto", "{chain}", "--points", "10000000"], "argument --points"),
    ("pareto-bandwidth-0", ["pareto", "{chain}", "--bandwidth", "0"], "--bandwidth"),
    ("pareto-latency-inf", ["pareto", "{chain}", "--bandwidth", "1GB/s", "--latency", "inf"], "--latency"),
    ("partition-latency-nan", ["partition", "{chain}", "--devices", "2", "--micro-batches", "2", "--device-memory",
                               "1GiB", "--latency", "nan"], "--latency"),
    ("partition-bandwidth-0", ["partition", "{chain}", "--devices", "2", "--micro-batches", "2", "--device-memory",
                               "1GiB", "--bandwidth", "0"], "--bandwidth"),
    ("partition-device-memory-1e999999", ["partition", "{chain}", "--devices", "2", "--micro-batches", "2",
                                          "--device-memory", "1e999999"], "--device-memory"),
    ("partition-devices-0", ["partition", "{chain}", "--devices", "0", "--micro-batches", "2", "--device-memory",
                             "1GiB"], "argument --devices"),
    ("memory-device-memory-1e999999", ["memory", "{chain}", "--device-memory", "1e999999"], "--device-memory"),
    ("memory-batch-0", ["memory", SPEC, "--batch", "0"], "argument --batch"),
    ("profile-throughput-nan", ["profile", SPEC, "--estimate", "--throughput", "nan", "-o", "{out}"],
     "--throughput"),
    ("profile-throughput-inf", ["profile", SPEC, "--estimate", "--throughput", "inf", "-o", "{out}"],
     "--throughput"),
    ("profile-warmup-negative", ["profile", SPEC, "--warmup", "-1", "-o", "{out}"], "argument --warmup"),
    ("profile-repeats-1e9", ["profile", SPEC, "--repeats", "1000000000", "-o", "{out}"], "argument --repeats"),
    ("profile-nodes-1", ["profile", SPEC, "--graph", "--nodes", "1", "-o", "{out}"], "argument --nodes"),
    ("profile-batch-negative", ["profile", SPEC, "--batch", "-1", "-o", "{out}"], "argument --batch"),
    ("profile-bandwidth-0", ["profile", SPEC, "--bandwidth", "0", "-o", "{out}"], "--bandwidth"),
    ("profile-latency-negative", ["profile", SPEC, "--bandwidth", "1GB/s", "--latency", "-1", "-o", "{out}"],
     "--latency"),
    ("train-steps-negative", ["train", SPEC, "--budget", "1GiB", "--steps", "-1"], "argument --steps"),
    ("train-steps-1e9", ["train", SPEC, "--budget", "1GiB", "--steps", "1000000000"], "argument --steps"),
    ("train-batch-0", ["train", SPEC, "--budget", "1GiB", "--batch", "0"], "argument --batch"),
    ("train-lr-nan", ["train", SPEC, "--budget", "1GiB", "--lr", "nan"], "--lr"),
    ("train-lr-negative", ["train", SPEC, "--budget", "1GiB", "--lr", "-1"], "--lr"),
    ("train-progress-timeout-inf", ["train", SPEC, "--plan", "{pipeline_plan}", "--progress-timeout", "inf"],
     "--progress-timeout"),
    ("train-progress-timeout-1e30", ["train", SPEC, "--plan", "{pipeline_plan}", "--progress-timeout", "1e30"],
     "--progress-timeout"),
    ("train-graph-time-limit-inf", ["train", SPEC, "--graph", "{graph}", "--budget", "100%", "--solver", "moccasin",
                                    "--time-limit", "inf"], "--time-limit"),
    ("train-budget-1e999999", ["train", SPEC, "--chain", "{chain}", "--budget", "1e999999"], "at most 1 EiB"),
    ("demo-steps-0", ["demo", "--steps", "0"], "argument --steps"),
]


def _cases():
    cases = []
    for garbage_id, content, fragment in GARBAGE:
        for kind, readers in READERS.items():
            for reader in readers:
                cases.append(pytest.param(kind, reader, content, fragment, id=f"{garbage_id}:{kind}:{reader}"))
    for kind, field_id, base, edit, fragment in FIELDS:
        for reader in READERS[kind]:
            cases.append(pytest.param(kind, reader, (base, edit), fragment, id=f"{field_id}:{reader}"))
    cases.append(pytest.param("chain", "pareto", ZERO_CHAIN, "allocates nothing", id="every-size-0:pareto"))
    return cases


@pytest.mark.parametrize("kind, reader, content, fragment", _cases())
def test_bad_file_is_one_error_line(docs, good, tmp_path, capsys, kind, reader, content, fragment):
    if isinstance(content, tuple):
        base, edit = content
        content = copy.deepcopy(docs[base])
        edit(content)
    argv = READERS[kind][reader](_write(tmp_path, content), good)
    line = one_error_line(cli.main(argv), *capsys.readouterr())
    assert fragment in line and "bad.json" in line, line


@pytest.mark.parametrize("argv, fragment",
                         [pytest.param(argv, fragment, id=case) for case, argv, fragment in ARGUMENTS])
def test_bad_argument_is_one_error_line(good, tmp_path, capsys, argv, fragment):
    out = tmp_path / "out.json"
    argv = [arg.format(out=out, **good) for arg in argv]
    line = one_error_line(cli.main(argv), *capsys.readouterr())
    assert fragment in line, line
    assert not out.exists()


def test_the_table_covers_at_least_60_inputs_and_every_reader():
    assert len(_cases()) + len(ARGUMENTS) >= 60
    kinds = {kind for kind, *_ in FIELDS}
    assert kinds == set(READERS)


# --- the real program: no traceback reaches the user, and what used to hang answers ---------------------------

PROGRAM = [
    ("binary-chain", lambda good, bad: ["solve", bad(b"\xff\x00\x89garbage"), "--budget", "1GiB"], "not UTF-8"),
    ("size-beyond-int64", lambda good, bad: ["solve", bad({**CHAIN, "input_bytes": 2**64}), "--budget", "1GiB",
                                             "--solver", "rotor"], "input_bytes"),
    ("budget-1e999999", lambda good, bad: ["solve", good["chain"], "--budget", "1e999999"], "at most 1 EiB"),
    ("moccasin-time-limit-inf", lambda good, bad: ["solve", good["graph"], "--budget", "100%", "--solver", "moccasin",
                                                   "--time-limit", "inf"], "--time-limit"),
]


@pytest.mark.parametrize("make_argv, fragment", [pytest.param(m, f, id=case) for case, m, f in PROGRAM])
def test_the_program_prints_one_line_and_no_traceback(good, tmp_path, make_argv, fragment):
    argv = make_argv(good, lambda content: _write(tmp_path, content))
    done = subprocess.run([sys.executable, "-c", "import sys, cli; sys.exit(cli.main())", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    one_error_line(done.returncode, done.stdout, done.stderr, fragment)
    assert done.stdout == ""


def test_the_program_refuses_a_corrupt_plan_before_training(docs, tmp_path):
    plan = copy.deepcopy(docs["plan"])
    plan["schedule"] = plan["schedule"][:-1]
    argv = ["train", SPEC, "--plan", _write(tmp_path, plan), "--steps", "1"]
    done = subprocess.run([sys.executable, "-c", "import sys, cli; sys.exit(cli.main())", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    one_error_line(done.returncode, done.stdout, done.stderr)
    assert done.stderr.splitlines() == [f"memsched: error: {tmp_path / 'bad.json'}: schedule ends before the "
                                        "backward of stage 0"]


# --- the schedule check refuses only what cannot run --------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3))
def test_every_solver_schedule_passes_the_check_without_the_chain(seed):
    chain = random_chain(6, seed, tmp=True, params=True, own_saved=seed == 1)
    channel = Transfer(2e8, 1e8, 1e-5)
    budget = (solvers.store_all_peak(chain) + minimum_budget(chain)) // 2
    checked = 0
    for name in solvers.SOLVER_NAMES:
        params = {"transfer": channel} if name in solvers.OFFLOAD_SOLVERS else {}
        if name in ("offload", "pofo"):
            params["time_limit"] = 2
        for weights in (None, [1, 3]):
            try:
                channel_given = {} if weights is None or params else {"transfer": channel}
                plan = solvers.solve(chain, budget if name != "store_all" else 10**12, name,
                                     TrainingSetup(host_weights=weights), **params, **channel_given)
            except MemschedError:  # no schedule of this solver within the budget
                continue
            check_schedule(plan.schedule, chain.length)
            check_plan_schedules(plan)
            checked += 1
    assert checked >= 12
    check_plan_schedules(partition(chain, 3, 10**12, 4))
    check_plan_schedules(partition(chain, 2, 10**12, 4, schedule="gpipe"))


def test_the_check_names_the_operation_and_the_rule():
    with pytest.raises(ScheduleError, match=r"^schedule\[3\] \(F_ck 0\): the backward of stage 0 has already run$"):
        check_schedule([Op("F_all", 0), Op("Loss"), Op("B", 0), Op("F_ck", 0)], 1)
    with pytest.raises(ScheduleError, match="runs no forward or backward"):
        check_schedule([Op("Loss")], 0)
