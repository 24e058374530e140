"""The ``memsched`` command line, its commands demo, profile, solve, show, pareto, train, memory and partition.

Argument parsing and printing only: the work is done by planner/, solvers/ and profiles/, the text by
planner/render.py and the PNGs by planner/plot.py. The imports inside the command functions keep torch out of
the torch-free commands. An expected error (:class:`planner.errors.MemschedError`) is printed as one line,
``memsched: error: <message>``, with exit status 2; so are usage errors. Ctrl-C prints ``memsched: interrupted``
and exits with status 130.
"""

import argparse
import os
import sys

import planner.render as render
import planner.render_memory as render_memory
import planner.validate as validate
import solvers
from planner import check_plan_matches, check_plan_schedules, load_chain, load_plan, save_chain, save_plan, simulate
from planner.devices import DEVICES
from planner.errors import MemschedError
from planner.graph import GRAPH_FORMAT, load_graph, save_graph
from planner.jsonio import output_path, read_json
from planner.plot import plot_pareto, plot_timeline
from planner.setup import Run, TrainingSetup, check
from planner.setup.flags import FIELD_FLAGS, SIZING_FLAGS, setup_from_flags
from planner.setup.training import OPTIMIZERS, PRECISIONS
from planner.transfer import channel_from
from planner.units import parse_bandwidth, parse_budget
from planner.updates import UPDATES
from profiles.device_plan import memory_report, target_device  # torch-free (it loads the estimate for a SPEC)
from profiles.options import DEFAULT_OPTIONS  # torch-free
from solvers import GRAPH_SOLVER_NAMES, solve_graph, store_all_graph_peak
from solvers.budgets import solve_for_budget, solved_lines, sweep, whole_step_floors
from solvers.partition import partition

MAX_POINTS = 1000  # pareto budgets: each is three solves
MAX_RUNS = 100_000  # profiling runs per stage, training steps
MAX_COMPUTATIONS = 100  # moccasin's model grows with it; 2 or 3 is the usual


def main(argv=None) -> int:
    """Run the command line on ``argv`` (default: ``sys.argv[1:]``); return the exit status."""
    try:
        try:
            args = _parser().parse_args(argv)
        except SystemExit as exc:  # argparse has printed the usage error (status 2) or the help (status 0)
            return exc.code
        try:
            _check_numbers(args)  # refused before any work, as are the outputs
            for given in (getattr(args, name, None) for name in ("output", "plot")):
                if given:
                    output_path(given)
            COMMANDS[args.name](args)
        except MemschedError as exc:
            print("memsched: error: " + " ".join(str(exc).splitlines()), file=sys.stderr)
            return 2
    except KeyboardInterrupt:  # Ctrl-C: the solvers stop within a second (solvers.limits.run_interruptibly)
        print("memsched: interrupted", file=sys.stderr)
        if argv is None:  # the program itself (not a caller's main([...])): exit now, not after freeing every
            # object of a large model one by one, nor after a native solver that has not stopped yet
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass
            os._exit(130)
        return 130
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse, printing a usage error as one line (``memsched: error: ...``, status 2) like every other error."""

    def error(self, message):
        print(f"memsched: error: {' '.join(message.split())} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def _at_least(minimum: int, maximum: int = None):
    """A whole-number argument from ``minimum`` (to ``maximum``: beyond it the command would not finish)."""
    def count(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text[:40]!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum}, got {value}")
        return value

    return count


def _check_numbers(args) -> None:
    """Refuse, in one line, a number option that no run can honour: NaN, infinite, negative, or beyond what a
    device means (a time limit past a year never runs out; see planner.validate)."""
    for flag in _given(args, "--time-limit", "--progress-timeout", "--latency"):
        check = validate.non_negative_seconds if flag == "--latency" else validate.positive_seconds
        check(getattr(args, flag[2:].replace("-", "_")), flag)
    if getattr(args, "throughput", None) is not None:
        validate.throughput(args.throughput, "--throughput")
    for flag in _given(args, "--lr", "--max-grad-norm"):
        validate.positive_number(getattr(args, flag[2:].replace("-", "_")), flag)


def _add_channel_arguments(parser, purpose: str) -> None:
    """``--bandwidth`` (both directions unless ``--h2d-bandwidth``) and ``--latency``: a copy channel."""
    parser.add_argument("--bandwidth", metavar="RATE", help=f"{purpose}: device-to-host bandwidth, e.g. 16GB/s "
                                                             "(and host-to-device, unless --h2d-bandwidth)")
    parser.add_argument("--h2d-bandwidth", metavar="RATE", help="host-to-device bandwidth (default: --bandwidth)")
    parser.add_argument("--latency", type=float, metavar="SECONDS", help="fixed seconds per transfer (default: 0)")


def _add_setup_arguments(parser, training: bool = False) -> None:
    """``--device-memory`` and the training setup (planner/setup/) that ``--budget auto`` and ``memory`` read, None
    when not given (an unused flag is refused). ``training``: train's (Adam in fp32; with --dp on FSDP2)."""
    parser.add_argument("--device-memory", metavar="BYTES",
                        help="memory of one device (80GiB, 40GB, bytes): --budget auto is what it leaves once "
                             "parameters, gradients and optimizer state are counted")
    parser.add_argument("--update", choices=UPDATES + ("auto",), default="after",
                        help="optimizer update after the backward, in it per stage (in-backward), or so on the host; "
                             "auto: the fastest of them that fits --device-memory")
    if not training:
        parser.add_argument("--optimizer", metavar="NAME",
                            help=f"optimizer whose state is resident: {', '.join(OPTIMIZERS)} (default: adam)")
        parser.add_argument("--precision", metavar="NAME",
                            help=f"{', '.join(PRECISIONS)}; bf16, fp16: mixed precision with an fp32 master copy "
                                 "(default: fp32)")
    parser.add_argument("--zero", type=int, metavar="STAGE",
                        help="ZeRO stage 0-3 over the --dp ranks: 1 shards optimizer state and master copy, "
                             "2 also gradients, 3 also parameters (default: 0; train --dp: 1-3, default 3)")
    parser.add_argument("--dp", type=int, metavar="N", help="data-parallel ranks (default: 1; train: a process and "
                                                            "a part of the batch each, ZeRO 2-3 on FSDP2)")


def _given(args, *flags) -> list:
    """Those of the options ``flags`` given on the command line (whose value is not None), in that order."""
    return [flag for flag in flags if getattr(args, flag[2:].replace("-", "_"), None) is not None]


def _setup(args, pipeline: bool = False, sharded: bool = False) -> TrainingSetup:
    """The one :class:`planner.setup.TrainingSetup` the flags give (``--update auto`` searches updates from it), its
    combinations with the run the flags ask for (``pipeline``: by a pipeline plan; ``sharded``: ``--dp``) checked."""
    setup = setup_from_flags({field: getattr(args, flag[2:].replace("-", "_"), None)
                              for field, flag in FIELD_FLAGS.items()})
    check(setup, Run(transfers=getattr(args, "solver", None) in solvers.OFFLOAD_SOLVERS, pipeline=pipeline,
                     compile=getattr(args, "compile", False), graph=bool(getattr(args, "graph", False)),
                     clipping=getattr(args, "max_grad_norm", None) is not None, sharded=sharded))
    return setup


def _solved(args, chain) -> tuple:
    """``(plan, how)`` by :func:`solvers.budgets.solve_for_budget`, the setup flags refused but with --budget auto."""
    setup = _setup(args)  # ZeRO over ranks shapes the step (planner/sharding.py): not only --budget auto's
    given = [flag for flag in _given(args, "--device-memory", *SIZING_FLAGS)
             if not (setup.sharded and flag in ("--zero", "--dp"))]
    if args.budget != "auto" and given:
        raise MemschedError(f"{given[0]} sizes the memory besides activations for --budget auto: "
                            "give --budget auto with it, or drop it")
    auto = args.budget == "auto" and args.device_memory is not None
    memory = parse_budget(args.device_memory, what="--device-memory") if auto else None
    params = dict(_offload_params(args, chain, args.solver),
                  **{name: getattr(args, name) for name in ("slots", "segments", "snapshots") if hasattr(args, name)})
    return solve_for_budget(chain, args.budget, args.solver, setup, memory, args.update == "auto", **params)


def _channel(args, chain=None, needed_by: str = None):
    """The copy channel the arguments give, else ``chain``'s, else None (refused if ``needed_by`` names a user)."""
    return channel_from(args.bandwidth, args.h2d_bandwidth, args.latency, chain and chain.transfer, needed_by)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="memsched", description="Plan memory-bounded training of a chain of stages.")
    commands = parser.add_subparsers(dest="name", required=True, metavar="COMMAND")

    profile = commands.add_parser("profile", help="measure a model into a chain problem", description="Measure a "
                                  "model, stage by stage, into a chain problem (memsched.chain/1).")
    profile.add_argument("spec", metavar="SPEC",
                         help="a built-in model (mlp, gpt-tiny, resnet-tiny; options as gpt-tiny:layers=12,d=512) "
                              "or path/to/file.py:factory")
    profile.add_argument("-o", "--output", required=True, metavar="CHAIN.json", help="write the chain here")
    profile.add_argument("--batch", type=_at_least(1), metavar="N", help="batch size")
    profile.add_argument("--device", choices=("cpu", "cuda"), help="measure on this device (default: the model's)")
    profile.add_argument("--estimate", action="store_true",
                         help="allocate nothing: exact sizes from fake tensors, times from FLOPs / --throughput")
    profile.add_argument("--throughput", type=float, metavar="FLOP/s",
                         help="device throughput assumed by --estimate (default: 1e12)")
    profile.add_argument("--device-spec", metavar="NAME|FILE", help=f"--estimate for a device: {', '.join(DEVICES)} "
                         "or a memsched.device/1 file (in its allocator's blocks, at its peak FLOP/s)")
    profile.add_argument("--graph", action="store_true",
                         help="profile the whole training step as a graph (memsched.graph/1) instead of a chain")
    profile.add_argument("--nodes", type=_at_least(2, validate.MAX_INDEX), default=200, metavar="N",
                         help="--graph: coarsen the captured step to at most N nodes (default: 200)")
    _add_channel_arguments(profile, "record this copy channel in the chain (on CUDA it is measured unless given)")
    profile.add_argument("--warmup", type=_at_least(0, MAX_RUNS), default=2, metavar="N",
                         help="untimed runs per stage (default: 2)")
    profile.add_argument("--repeats", type=_at_least(1, MAX_RUNS), default=5, metavar="N",
                         help="timed runs per stage, median kept (default: 5)")
    profile.add_argument("--options", type=_at_least(0, MAX_RUNS), default=DEFAULT_OPTIONS, metavar="N",
                         help=f"ways to run each distinct stage keeping less, measured (default: {DEFAULT_OPTIONS})")

    train = commands.add_parser("train", help="train a model by a plan, measured against the prediction",
                                description="Profile (unless --chain), solve (unless --plan), and train a model by the "
                                            "plan, printing measured against predicted peak and time per step.")
    train.add_argument("spec", metavar="SPEC", help="a built-in model or path/to/file.py:factory, as for profile")
    train.add_argument("--budget", metavar="B", help="memory budget as for solve (needed unless --plan is given); "
                                                     "auto: what --device-memory leaves beside the fp32 parameters, "
                                                     "gradients and Adam state this command trains with")
    _add_setup_arguments(train, training=True)
    train.add_argument("--solver", default="auto", metavar="NAME", help="solver (default: auto)")
    train.add_argument("--plan", metavar="PLAN.json", help="train by this plan instead of solving")
    train.add_argument("--chain", metavar="CHAIN.json", help="use this profile instead of profiling")
    train.add_argument("--graph", nargs="?", const=True, metavar="GRAPH.json",
                       help="train by a graph plan (checkmate, moccasin, checkmate-lp) with the graph executor: "
                            "profile the step as a graph, or use this graph profile")
    train.add_argument("--nodes", type=_at_least(2, validate.MAX_INDEX), default=200, metavar="N",
                       help="--graph: coarsen the captured step to at most N nodes (default: 200)")
    train.add_argument("--time-limit", type=float, metavar="SECONDS", help="--graph: solver time limit")
    _add_channel_arguments(train, "offload solvers (pofo, offload...) and --offload-weights: the copy channel "
                                  "(default: the chain's)")
    train.add_argument("--offload-weights", metavar="all|I,J,...",
                       help="keep these stages' parameters on the host (as for solve)")
    train.add_argument("--compile", action="store_true", help="run the plan (and the plain step) through torch.compile")
    train.add_argument("--steps", type=_at_least(1, MAX_RUNS), default=5, metavar="N",
                       help="training steps (default: 5)")
    train.add_argument("--batch", type=_at_least(1), metavar="N", help="batch size")
    train.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="train on this device (default: cpu)")
    train.add_argument("--lr", type=float, default=1e-3, help="learning rate of the Adam optimizer (default: 1e-3)")
    train.add_argument("--max-grad-norm", type=float, metavar="NORM", help="clip the gradients' global norm to NORM")
    train.add_argument("--accumulate", type=_at_least(1, MAX_RUNS), default=1, metavar="K",
                       help="add K micro-batches' gradients before each optimizer step, planned for (default: 1)")
    train.add_argument("--progress-timeout", type=float, metavar="SECONDS",
                       help="--plan pipeline.json, --dp: stop the run when no step has finished for this long (each "
                            "rank's setup milestones count; under torchrun: how long a collective waits; default: 300)")

    demo = commands.add_parser("demo", help="profile, solve, show and train the built-in gpt-tiny at half its memory",
                               description="On the built-in gpt-tiny: profile it, solve at 50%% of the store-all peak "
                                           "with rotor, show the schedule and memory timeline, train a few steps and "
                                           "compare predicted with measured.")
    demo.add_argument("--plot", metavar="timeline.png", help="also save the memory timeline as a PNG")
    demo.add_argument("--steps", type=_at_least(1, MAX_RUNS), default=3, metavar="N",
                      help="training steps (default: 3)")

    solve = commands.add_parser("solve", help="find a schedule that fits a memory budget",
                                description="Find the fastest schedule of a chain or a graph within a memory budget.")
    solve.add_argument("chain", metavar="PROBLEM.json",
                       help="chain (memsched.chain/1) or graph (memsched.graph/1) problem")
    solve.add_argument("--budget", required=True, metavar="B",
                       help="memory budget: bytes (123456789), a unit (4GiB, 512MB), a percentage of the "
                            "store-all peak (50%%), or auto: what --device-memory leaves beside parameters, "
                            "gradients and optimizer state (chains)")
    _add_setup_arguments(solve)
    solve.add_argument("--solver", default="auto", metavar="NAME",
                       help=f"one of {', '.join(solvers.SOLVER_NAMES)} for a chain, "
                            f"{', '.join(GRAPH_SOLVER_NAMES)} for a graph (default: auto)")
    solve.add_argument("--time-limit", type=float, metavar="SECONDS",
                       help="graph solvers and offload: stop the search after this long and keep the best schedule "
                            "found")
    solve.add_argument("--max-computations", type=_at_least(1, MAX_COMPUTATIONS), metavar="N",
                       help="moccasin: computations allowed per node (default: 2)")
    solve.add_argument("--first-order", metavar="free|index",
                       help="moccasin: first computations in any order (free, default) or in index order "
                            "(index: Checkmate's order, much faster to prove)")
    solve.add_argument("--backend", choices=("highs", "cbc"),
                       help="checkmate, checkmate-lp: MILP solver (default: highs; cbc solves checkmate-lp's LPs "
                            "with CLP, far faster on large graphs)")
    solve.add_argument("--gap", type=float, metavar="G",
                       help="checkmate: stop once the schedule is within G (0.01 = 1%%) of the solver's bound "
                            "(default 0: proven optimal)")
    _add_channel_arguments(solve, "pofo, the offload solvers and --offload-weights: the copy channel (default: the "
                                  "chain's)")
    solve.add_argument("--offload-weights", metavar="all|I,J,...",
                       help="keep these stages' parameters on the host, brought in around each of their operations "
                            "(their gradients go to the host after their backward), with any solver")
    solve.add_argument("--schedule", choices=("store_all", "rotor"),
                       help="offload, offload_greedy, offload_all: the compute schedule whose activations are "
                            "offloaded (default: store_all)")
    solve.add_argument("--slots", type=_at_least(1), metavar="N", help="rotor, pofo: memory discretisation slots")
    solve.add_argument("--segments", type=_at_least(1, validate.MAX_INDEX), metavar="N",
                       help="sqrt: number of segments")
    solve.add_argument("--snapshots", type=_at_least(1, validate.MAX_INDEX), metavar="N",
                       help="revolve: snapshot slots")
    solve.add_argument("-o", "--output", metavar="PLAN.json", help="write the plan here (memsched.plan/1)")

    show = commands.add_parser("show", help="print a plan, and its memory timeline given the chain or graph",
                               description="Print a plan; with --chain (or --graph), re-simulate it and draw its "
                                           "memory timeline.")
    show.add_argument("plan", metavar="PLAN.json", help="plan (memsched.plan/1)")
    show.add_argument("--chain", metavar="CHAIN.json", help="the chain the plan was solved for")
    show.add_argument("--graph", metavar="GRAPH.json", help="the graph a graph plan was solved for")
    show.add_argument("--plot", metavar="timeline.png", help="save the memory timeline as a PNG (needs --chain)")

    pareto = commands.add_parser("pareto", help="overhead against budget for rotor, sqrt and store_all",
                                 description="Step-time overhead against memory budget, from the minimum feasible "
                                             "budget to the store-all peak, for rotor, sqrt and store_all.")
    pareto.add_argument("chain", metavar="CHAIN.json", help="chain problem (memsched.chain/1)")
    pareto.add_argument("--points", type=_at_least(2, MAX_POINTS), default=12, metavar="N",
                        help="number of evenly spaced budgets (default: 12)")
    pareto.add_argument("--slots", type=_at_least(1), metavar="N", help="rotor: memory discretisation slots")
    _add_channel_arguments(pareto, "add pofo's and offload_greedy's curves over this copy channel (default: the "
                                   "chain's, if it has one)")
    pareto.add_argument("--plot", metavar="pareto.png", help="save overhead against budget as a PNG")

    plan = commands.add_parser("plan", aliases=["memory"], help="what fits a device: memory, floor, batch, speed",
                               description="Per-device bytes of parameters, gradients, master copy and optimizer "
                                           "state, the budget --device-memory leaves for the step and what sets its "
                                           "floor; with --device-spec, estimated for that device: fits or not, peak, "
                                           "step time and samples per second, at --batch N or the fastest (auto).")
    plan.add_argument("model", metavar="SPEC|CHAIN.json",
                      help="a built-in model or path/to/file.py:factory (built on fake tensors: nothing is "
                           "allocated), or a chain profile (parameters: from its param_bytes)")
    plan.add_argument("--batch", type=lambda text: text if text == "auto" else _at_least(1)(text), metavar="N|auto",
                      help="SPEC: batch size; auto (with --device-spec): of 1, 2, 4..., the most samples/s")
    plan.add_argument("--device-spec", metavar="NAME|FILE", help=f"SPEC: the target device: {', '.join(DEVICES)}, "
                                                                 "cpu (this one, measured) or a memsched.device/1 file")
    plan.add_argument("--global-batch", type=_at_least(1), metavar="N", help="--device-spec: samples per optimizer "
                                                                             "step, micro-batches accumulated")
    plan.add_argument("--budget", default="auto", metavar="auto|B",
                      help="--device-spec: the step's budget: auto (what the device leaves) or bytes (4GiB), or %%")
    _add_setup_arguments(plan)

    partition = commands.add_parser("partition", help="split a chain across pipeline devices (1F1B or GPipe)",
                                    description="The fastest contiguous split of a chain onto --devices pipeline "
                                                "devices of --device-memory each, with each device's checkpoint "
                                                "schedule, for --micro-batches per iteration (plan kind pipeline).")
    partition.add_argument("chain", metavar="CHAIN.json", help="chain problem profiled at the micro-batch size")
    partition.add_argument("--devices", type=_at_least(1), required=True, metavar="P", help="pipeline devices")
    partition.add_argument("--micro-batches", type=_at_least(1), required=True, metavar="M",
                           help="micro-batches per iteration")
    partition.add_argument("--pipeline-schedule", choices=("1f1b", "gpipe"), default="1f1b",
                           help="1F1B holds P - s micro-batches on device s, GPipe all M (default: 1f1b)")
    partition.add_argument("--bandwidth", metavar="RATE",
                           help="device-to-device bandwidth for the boundary activations and gradients (default: free)")
    partition.add_argument("--latency", type=float, metavar="SECONDS", help="fixed seconds per transfer (default: 0)")
    partition.add_argument("--slots", type=_at_least(1), metavar="N", help="rotor: memory discretisation slots")
    _add_setup_arguments(partition)
    partition.add_argument("-o", "--output", metavar="PLAN.json", help="write the plan here (memsched.plan/1)")
    return parser


def _profile(args) -> None:
    from profiles.chain_profiler import profile_chain  # torch loads only for the commands that need it
    from profiles.spec import load_model

    for flag in _given(args, "--throughput", "--device-spec") if not args.estimate else ():
        raise MemschedError(f"{flag} is what --estimate assumes of the device: give it with --estimate")
    # A graph estimate builds the model for real (its parameters and inputs) and traces the step on fake
    # tensors: a model built under fake tensors leaves fake constants (targets) that the capture refuses.
    for flag in _given(args, "--bandwidth", "--device-spec") if args.graph else ():
        raise MemschedError(f"{flag} is for chain profiles; a graph profile has no copy channel nor device spec")
    channel, target = _channel(args), args.device_spec and target_device(args.device_spec)  # "cpu": measured
    model, _ = load_model(args.spec, batch=args.batch, estimate=args.estimate and not args.graph)
    if args.graph:
        from profiles.training import profiled_for_training  # the training runtime: not for a chain profile

        graph = profiled_for_training(model, args.device, args.nodes, estimate=args.estimate,
                                      throughput=args.throughput, warmup=args.warmup, repeats=args.repeats)
        save_graph(graph, args.output)
        print("\n".join(render.graph_summary(graph, store_all_graph_peak(graph)) + [f"graph written to {args.output}"]))
        return
    bar = render.ProgressLine(len(model.stages) + 1, sys.stderr)
    try:
        chain = profile_chain(model.stages, model.example_inputs, loss_fn=model.loss_fn, device=args.device,
                              warmup=args.warmup, repeats=args.repeats, name=model.name, estimate=args.estimate,
                              throughput=args.throughput, progress=bar, transfer=channel, options=args.options,
                              say=bar.say, device_spec=target)
    finally:  # done, or an error or Ctrl-C mid-bar
        bar.end()
    save_chain(chain, args.output)
    print("\n".join([*model.report] + render.chain_table(chain) + [f"chain written to {args.output}"]))


def _train(args) -> None:
    from planner.execute.stages import checked_device
    from planner.execute.torchrun import check_torchrun_world
    from profiles.spec import load_model
    from profiles.training import check_measured_on, train_chain_plan, train_pipeline
    from profiles.training import profiled_for_training as _profiled

    checked_device(args.device)
    if args.dp is not None or args.zero is not None:
        return _train_sharded(args)
    if args.progress_timeout is not None and (args.graph or not args.plan):
        raise MemschedError("--progress-timeout bounds a pipeline run: give it with --plan pipeline.json")
    if not args.graph and args.plan and (args.device_memory is not None or args.budget == "auto"
                                         or args.update != "after" or args.accumulate != 1):
        raise MemschedError("--budget auto, --device-memory, --update and --accumulate are for solving: drop them "
                            "with --plan (a plan records its update and its micro-batches)")
    _setup(args, pipeline=bool(args.plan) and load_plan(args.plan).kind == "pipeline")  # what does not mix, first
    if not (args.plan and load_plan(args.plan).kind == "pipeline"):  # (a pipeline run checks its devices' count)
        check_torchrun_world(1, "train without --dp or a pipeline plan", "give --dp {world} or a pipeline --plan")
    model, _ = load_model(args.spec, batch=args.batch)
    if args.graph:
        return _train_graph(args, model)
    if args.time_limit is not None:
        raise MemschedError("--time-limit is for graph solvers: give it with --graph")
    if args.plan:
        plan = load_plan(args.plan)
        check_plan_schedules(plan, args.plan)
        chain = load_chain(args.chain) if args.chain else None
        if plan.kind == "pipeline":
            sys.stdout.write("".join(f"{line}\n" for line in train_pipeline(  # none on a torchrun rank but the first
                args.spec, args.batch, plan, args.steps, args.device, args.lr, chain, args.progress_timeout)))
            return
        if args.progress_timeout is not None:
            raise MemschedError(f"--progress-timeout bounds a pipeline run; {args.plan} is a plan of kind {plan.kind}: "
                                "drop --progress-timeout")
        if plan.kind == "graph":
            raise MemschedError(f"{args.plan} is a graph plan: train by it with --graph GRAPH.json (its graph profile)")
        if chain is not None:
            check_plan_matches(plan, chain, args.plan, kind="chain")
    elif not args.budget:
        raise MemschedError("train needs --budget (or a ready --plan)")
    else:
        chain = load_chain(args.chain) if args.chain else _profiled(model, args.device)
    if args.chain or args.plan:  # a profile measured on other parameters or inputs is refused before any work
        source = f"chain {args.chain}" if args.chain else f"plan {args.plan}"
        note = check_measured_on(model, plan if chain is None else chain, source)
        if note:
            print(note)
    if not args.plan:
        plan, how = _solved(args, chain)
        print("\n".join(solved_lines(plan, args.solver, chain, how)))
    comparison = train_chain_plan(model, plan, chain, args.steps, args.device, args.lr, compile=args.compile,
                                  max_grad_norm=args.max_grad_norm)
    print("\n".join(render.training_table(plan, comparison)))


def _demo(args) -> None:
    from profiles.demo import demo_lines

    for block in demo_lines(args.steps, args.plot):
        print(block)


def _train_sharded(args) -> None:
    """``train --dp N``: one rank's sharded step, solved here or by ``--plan``, trained on N processes."""
    from profiles.sharded_training import train_data_parallel

    _setup(args, sharded=True)  # a sharded step's refusals (planner/setup/rules.py), --graph's among them
    unused = _given(args, "--chain", "--max-grad-norm", *(("--budget", "--device-memory") if args.plan else ()))
    if unused or args.dp is None or not (args.budget or args.plan):
        fix = f"drop {unused[0]}" if unused else "give --dp and --budget"
        raise MemschedError("train --dp N [--zero 1|2|3] (--budget B | --plan P.json) trains one rank's step eagerly, "
                            f"updating after the backward: {fix}")
    sys.stdout.write("".join(f"{line}\n" for line in train_data_parallel(  # none on a torchrun rank but the first
        args.spec, args.batch, args.dp, 3 if args.zero is None else args.zero, args.budget,
        plan=load_plan(args.plan) if args.plan else None,
        device_memory=args.device_memory, solver=args.solver, steps=args.steps, device=args.device, lr=args.lr,
        progress_timeout=args.progress_timeout or 300.0)))


def _train_graph(args, model) -> None:
    """``train --graph``: a graph plan (solved here, or ``--plan``) run by the graph executor."""
    from profiles.training import on_device, train_graph_plan
    from profiles.training import profiled_for_training as _profiled

    if args.chain:
        raise MemschedError("--chain is for chain plans; with --graph give a graph profile as --graph GRAPH.json")
    _refuse_auto_for_graphs(args)
    if args.device != "cpu":
        model.stages, model.example_inputs = on_device(model.stages, model.example_inputs, args.device)
    graph = load_graph(args.graph) if isinstance(args.graph, str) else _profiled(model, args.device, args.nodes)
    if args.plan:
        plan = load_plan(args.plan)
        check_plan_schedules(plan, args.plan)
        check_plan_matches(plan, graph, args.plan)
    else:
        if not args.budget:
            raise MemschedError("train needs --budget (or a ready --plan)")
        plan = solve_graph(graph, parse_budget(args.budget, store_all_graph_peak(graph)), args.solver,
                           time_limit=args.time_limit)
        print("\n".join(render.graph_solve_summary(plan, args.solver)))
    comparison = train_graph_plan(model, plan, graph, args.steps, args.device, args.lr)
    print("\n".join(render.training_table(plan, comparison)))


def _solve(args) -> None:
    if read_json(args.chain).get("format") == GRAPH_FORMAT:  # a chain, or anything else, is read as a chain
        _solve_graph(args)
        return
    if _given(args, "--max-computations", "--backend", "--gap", "--first-order"):
        raise MemschedError("--max-computations, --first-order, --backend and --gap are for graph problems "
                            "(memsched.graph/1); the chain solvers are exact and fast")
    chain = load_chain(args.chain)
    plan, how = _solved(args, chain)
    floors = render_memory.floor_lines(whole_step_floors(chain, _setup(args))) if how else []
    _print_saved(solved_lines(plan, args.solver, chain, how) + floors, plan, args.output)


def _offload_params(args, chain, solver: str) -> dict:
    """``transfer``, ``schedule`` and ``time_limit`` for pofo and the offload solvers (refused for the others),
    and the channel for ``--offload-weights`` (any solver) and the update on the host."""
    weights, schedule = getattr(args, "offload_weights", None), getattr(args, "schedule", None)
    if args.update in ("on-host", "auto") and solver not in solvers.OFFLOAD_SOLVERS and weights is None:
        return {"transfer": _channel(args, chain, "--update on-host" if args.update == "on-host" else None)}
    if solver in solvers.OFFLOAD_SOLVERS:
        return {"transfer": _channel(args, chain, solver), "schedule": schedule, "time_limit": args.time_limit}
    if weights is not None:
        if schedule is not None or args.time_limit is not None:
            raise MemschedError(f"--schedule and --time-limit are for pofo and the offload solvers, not for {solver}")
        return {"transfer": _channel(args, chain, "--offload-weights")}
    given = _given(args, "--bandwidth", "--h2d-bandwidth", "--latency", "--schedule", "--time-limit")
    if given:
        raise MemschedError(f"{given[0]} is for pofo and the offload solvers ({', '.join(solvers.OFFLOAD_SOLVERS)}), "
                            f"not for {solver}")
    return {}


def _refuse_auto_for_graphs(args) -> None:
    given = _given(args, "--device-memory", *SIZING_FLAGS) + (["--update"] if args.update != "after" else [])
    if args.budget == "auto" or given:
        raise MemschedError(f"{'--budget auto' if args.budget == 'auto' else given[0]} is for chain problems; a graph "
                            "counts its parameters in fixed_bytes: give the graph's budget in bytes or as a percentage")


def _solve_graph(args) -> None:
    _refuse_auto_for_graphs(args)
    if _given(args, "--slots", "--segments", "--snapshots"):
        raise MemschedError("--slots, --segments and --snapshots are for chain solvers; a graph takes "
                            "--time-limit, --max-computations and --first-order (moccasin), --backend and --gap "
                            "(checkmate)")
    if args.gap is not None and not 0 <= args.gap < 1:
        raise MemschedError(f"--gap must be a fraction between 0 and 1 (0.01 = 1%), got {args.gap}")
    graph = load_graph(args.chain)
    plan = solve_graph(graph, parse_budget(args.budget, store_all_graph_peak(graph)), args.solver,
                       time_limit=args.time_limit, max_computations=args.max_computations,
                       first_order=args.first_order, backend=args.backend, gap=args.gap)
    _print_saved(render.graph_solve_summary(plan, args.solver), plan, args.output)


def _print_saved(lines, plan, output) -> None:
    """Print ``lines``; with an ``output`` path, after writing ``plan`` there and saying so."""
    if output:
        save_plan(plan, output)
    print("\n".join(lines + ([f"plan written to {output}"] if output else [])))


def _show(args) -> None:
    plan = load_plan(args.plan)
    check_plan_schedules(plan, args.plan)
    graph = plan.kind == "graph" or args.graph  # a chain plan given --graph is refused by check_plan_matches
    if graph and args.chain:
        raise MemschedError(f"{args.plan} is a graph plan: give its graph with --graph GRAPH.json, not --chain")
    if args.plot and plan.kind == "pipeline" and not graph:
        raise MemschedError("--plot draws one device's memory timeline; a pipeline plan has one per device: show "
                            "it without --plot")
    path, what = (args.graph, "graph") if graph else (args.chain, "chain")
    if args.plot and not path:
        raise MemschedError(f"--plot draws the memory timeline, which needs the {what}: add --{what} "
                            f"{what.upper()}.json")
    if not path:
        print("\n".join(render.shown_plan_lines(plan)))
        return
    problem = (load_graph if graph else load_chain)(path)
    check_plan_matches(plan, problem, args.plan)
    result = simulate(problem, plan)
    lines = render.shown_plan_lines(plan, problem, result)
    if args.plot:
        plot_timeline(result, plan.budget_bytes, args.plot, f"{plan.problem_name}: {plan.solver} plan",
                      render.graph_op_categories(plan.schedule, problem) if graph else None)
        lines.append(f"timeline plot written to {args.plot}")
    print("\n".join(lines))


def _pareto(args) -> None:
    chain = load_chain(args.chain)
    channel = _channel(args, chain)
    swept = sweep(chain, args.points, args.slots, channel, where=args.chain)
    lines = render.pareto_report(chain, swept, channel)
    if args.plot:
        plot_pareto(swept.rows, swept.solvers, args.plot, f"{chain.name}: overhead against budget")
        lines.append(f"pareto plot written to {args.plot}")
    print("\n".join(lines))


def _memory(args) -> None:
    """``plan|memory SPEC|CHAIN.json``: profiles/device_plan.py's report, from the flags."""
    memory = args.device_memory and parse_budget(args.device_memory, what="--device-memory")
    target = args.device_spec and target_device(args.device_spec, memory)  # "cpu": this one, measured
    print("\n".join(memory_report(args.model, _setup(args), memory, target, args.batch, args.global_batch,
                                   args.budget)))


def _partition(args) -> None:
    if args.device_memory is None:
        raise MemschedError("partition needs the memory of one device: give --device-memory (e.g. 80GiB)")
    chain = load_chain(args.chain)
    memory = parse_budget(args.device_memory, what="--device-memory")
    bandwidth = None if args.bandwidth is None else parse_bandwidth(args.bandwidth)
    plan = partition(chain, args.devices, memory, args.micro_batches, schedule=args.pipeline_schedule,
                     bandwidth=bandwidth, latency=args.latency or 0.0, setup=_setup(args),
                     **({} if args.slots is None else {"slots": args.slots}))
    _print_saved(render.pipeline_lines(plan, memory) + [""] + render.pipeline_memory_lines(simulate(chain, plan)),
                 plan, args.output)


COMMANDS = {"profile": _profile, "train": _train, "demo": _demo, "solve": _solve, "show": _show, "pareto": _pareto,
             "plan": _memory, "memory": _memory, "partition": _partition}  # what main runs for each command's name
