"""The ``memsched`` command line: ``demo``, ``profile``, ``solve``, ``show``, ``pareto``, ``train`` and ``memory``.

Argument parsing and printing only: the work is done by planner/ and
solvers/, the text by planner/render.py and the PNGs by planner/plot.py.
An expected error (:class:`planner.errors.MemschedError`) is printed as one
line, ``memsched: error: <message>``, with exit status 2; so are usage errors.
Ctrl-C prints ``memsched: interrupted`` and exits with status 130.
"""

import argparse
import os
import sys

import solvers
from planner import check_plan_matches, load_chain, load_plan, render, save_chain, save_plan, simulate
import planner.validate as validate
from planner.errors import MemschedError
from planner.graph import GRAPH_FORMAT, Graph, save_graph
from planner.simulate.graph import simulate_graph
from planner.jsonio import output_path, read_json
from planner.plan import check_graph_plan_matches
from solvers.graph import GRAPH_SOLVER_NAMES, solve_graph, store_all_graph_peak
from planner.plot import plot_pareto, plot_timeline
from planner.units import format_bytes, parse_budget
from solvers.minimum import minimum_budget

PARETO_SOLVERS = ("rotor", "sqrt", "store_all")
MAX_POINTS = 1000  # pareto budgets: each is three solves
MAX_RUNS = 100_000  # profiling runs per stage, training steps
MAX_COMPUTATIONS = 100  # moccasin's model grows with it; 2 or 3 is the usual
MIN_THROUGHPUT, MAX_THROUGHPUT = 1e3, 1e21  # FLOP/s that --estimate may assume (a zettaflop is beyond any device)
OFFLOAD_CURVES = ("pofo", "offload_greedy")  # pofo's table alone (not re-timed) and the greedy on store-all: fast


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
            args.command(args)
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
    for flag, field in (("--time-limit", "time_limit"), ("--progress-timeout", "progress_timeout")):
        value = getattr(args, field, None)
        if value is not None:
            validate.positive_seconds(value, flag)
    if getattr(args, "latency", None) is not None:
        validate.non_negative_seconds(args.latency, "--latency")
    throughput = getattr(args, "throughput", None)
    if throughput is not None and not MIN_THROUGHPUT <= throughput <= MAX_THROUGHPUT:
        raise MemschedError(f"--throughput must be a positive number of FLOP/s from {MIN_THROUGHPUT:g} to "
                            f"{MAX_THROUGHPUT:g}, got {throughput}")
    lr = getattr(args, "lr", None)
    if lr is not None and not 0 < lr < float("inf"):
        raise MemschedError(f"--lr must be a positive, finite learning rate, got {lr}")


def _add_channel_arguments(parser, purpose: str) -> None:
    """``--bandwidth`` (both directions unless ``--h2d-bandwidth``) and ``--latency``: a copy channel."""
    parser.add_argument("--bandwidth", metavar="RATE", help=f"{purpose}: device-to-host bandwidth, e.g. 16GB/s "
                                                             "(and host-to-device, unless --h2d-bandwidth)")
    parser.add_argument("--h2d-bandwidth", metavar="RATE", help="host-to-device bandwidth (default: --bandwidth)")
    parser.add_argument("--latency", type=float, metavar="SECONDS", help="fixed seconds per transfer (default: 0)")


def _add_setup_arguments(parser, device_memory_only: bool = False) -> None:
    """``--device-memory`` and the training setup (planner/training_setup.py) that ``--budget auto`` and ``memory``
    read; the defaults are filled in by :func:`_setup` (None here, so that an unused flag can be refused)."""
    from planner.training_setup import OPTIMIZERS, PRECISIONS

    parser.add_argument("--device-memory", metavar="BYTES",
                        help="memory of one device (80GiB, 40GB, bytes): --budget auto is what it leaves once "
                             "parameters, gradients and optimizer state are counted")
    if device_memory_only:
        return
    parser.add_argument("--optimizer", metavar="NAME",
                        help=f"optimizer whose state is resident: {', '.join(OPTIMIZERS)} (default: adam)")
    parser.add_argument("--precision", metavar="NAME",
                        help=f"{', '.join(PRECISIONS)}; bf16, fp16: mixed precision with an fp32 master copy "
                             "(default: fp32)")
    parser.add_argument("--zero", type=int, metavar="STAGE",
                        help="ZeRO stage 0-3 over the --dp ranks: 1 shards optimizer state and master copy, "
                             "2 also gradients, 3 also parameters (default: 0)")
    parser.add_argument("--dp", type=int, metavar="N", help="data-parallel ranks (default: 1)")


_SETUP_FLAGS = (("--optimizer", "optimizer"), ("--precision", "precision"), ("--zero", "zero"), ("--dp", "dp"))


def _setup(args):
    """The :class:`planner.training_setup.TrainingSetup` the arguments give (defaults: adam, fp32, ZeRO 0, 1 rank)."""
    from planner.training_setup import TrainingSetup

    given = {field: getattr(args, field, None) for _, field in _SETUP_FLAGS}
    return TrainingSetup(**{field: value for field, value in given.items() if value is not None})


def _auto_budget(args, chain):
    """``(budget, how)`` for ``--budget auto``; ``(None, None)`` for another budget (then refusing the setup flags)."""
    from planner.training_setup import activation_budget, chain_gradient_bytes, parameters_of

    given = [flag for flag, field in (("--device-memory", "device_memory"),) + _SETUP_FLAGS
             if getattr(args, field, None) is not None]
    if args.budget != "auto":
        if given:
            raise MemschedError(f"{given[0]} sizes the memory besides activations for --budget auto: "
                                "give --budget auto with it, or drop it")
        return None, None
    if args.device_memory is None:
        raise MemschedError("--budget auto is what a device's memory leaves for the step: give --device-memory "
                            "(e.g. 80GiB)")
    device_memory = parse_budget(args.device_memory, what="--device-memory")
    setup = _setup(args)
    budget = activation_budget(chain, setup, device_memory)
    parameters = parameters_of(chain)
    resident = setup.resident_bytes(parameters)
    how = (f"device {render.describe_bytes(device_memory)} - resident {render.describe_bytes(resident)} "
           f"for {parameters} parameters ({setup.describe()})")
    extra = budget - (device_memory - resident)
    if extra:
        how += f" - {-extra} bytes of gradients beyond the chain's"
    if setup.gradient_bytes(parameters) < chain_gradient_bytes(chain):
        how += (f"; the chain counts its fp32 gradients ({format_bytes(chain_gradient_bytes(chain))}), the setup's "
                f"are {format_bytes(setup.gradient_bytes(parameters))}")
    return budget, how


def _channel(args, chain=None):
    """The copy channel the arguments give, else ``chain``'s (None when neither has one)."""
    from planner.transfer import Transfer, parse_bandwidth

    if args.bandwidth is None:
        if args.h2d_bandwidth is not None or args.latency is not None:
            raise MemschedError("--h2d-bandwidth and --latency describe a channel: give its --bandwidth too")
        return chain.transfer if chain is not None else None
    d2h = parse_bandwidth(args.bandwidth)
    h2d = d2h if args.h2d_bandwidth is None else parse_bandwidth(args.h2d_bandwidth, "--h2d-bandwidth")
    return Transfer(d2h_bandwidth=d2h, h2d_bandwidth=h2d, latency=_latency(args))


def _latency(args) -> float:
    """``--latency`` in seconds (0 when not given; checked by :func:`_check_numbers`)."""
    return args.latency or 0.0


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="memsched", description="Plan memory-bounded training of a chain of stages.")
    commands = parser.add_subparsers(dest="name", required=True, metavar="COMMAND")

    profile = commands.add_parser("profile", help="measure a model into a chain problem",
                                  description="Measure a model, stage by stage, into a chain problem (memsched.chain/1).")
    profile.add_argument("spec", metavar="SPEC",
                         help="a built-in model (mlp, gpt-tiny, resnet-tiny; options as gpt-tiny:layers=12,d=512) "
                              "or path/to/file.py:factory")
    profile.add_argument("-o", "--output", required=True, metavar="CHAIN.json", help="write the chain here")
    profile.add_argument("--batch", type=_at_least(1), metavar="N", help="batch size")
    profile.add_argument("--device", choices=("cpu", "cuda"), help="measure on this device (default: where the model is)")
    profile.add_argument("--estimate", action="store_true",
                         help="allocate nothing: exact sizes from fake tensors, times from FLOPs / --throughput")
    profile.add_argument("--throughput", type=float, metavar="FLOP/s",
                         help="device throughput assumed by --estimate (default: 1e12)")
    profile.add_argument("--graph", action="store_true",
                         help="profile the whole training step as a graph (memsched.graph/1) instead of a chain")
    profile.add_argument("--nodes", type=_at_least(2, validate.MAX_INDEX), default=200, metavar="N",
                         help="--graph: coarsen the captured step to at most N nodes (default: 200)")
    _add_channel_arguments(profile, "record this copy channel in the chain (on CUDA it is measured unless given)")
    profile.add_argument("--warmup", type=_at_least(0, MAX_RUNS), default=2, metavar="N", help="untimed runs per stage (default: 2)")
    profile.add_argument("--repeats", type=_at_least(1, MAX_RUNS), default=5, metavar="N",
                         help="timed runs per stage, median kept (default: 5)")
    profile.set_defaults(command=_profile)

    train = commands.add_parser("train", help="train a model by a plan, measured against the prediction",
                                description="Profile (unless --chain), solve (unless --plan), and train a model by the "
                                            "plan, printing measured against predicted peak and time per step.")
    train.add_argument("spec", metavar="SPEC", help="a built-in model or path/to/file.py:factory, as for profile")
    train.add_argument("--budget", metavar="B", help="memory budget as for solve (needed unless --plan is given); "
                                                     "auto: what --device-memory leaves beside the fp32 parameters, "
                                                     "gradients and Adam state this command trains with")
    _add_setup_arguments(train, device_memory_only=True)
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
    train.add_argument("--steps", type=_at_least(1, MAX_RUNS), default=5, metavar="N", help="training steps (default: 5)")
    train.add_argument("--batch", type=_at_least(1), metavar="N", help="batch size")
    train.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="train on this device (default: cpu)")
    train.add_argument("--lr", type=float, default=1e-3, help="learning rate of the Adam optimizer (default: 1e-3)")
    train.add_argument("--progress-timeout", type=float, metavar="SECONDS",
                       help="--plan pipeline.json: stop the run when no step has finished for this long (each "
                            "rank's setup milestones count as progress; default: 300)")
    train.set_defaults(command=_train)

    demo = commands.add_parser("demo", help="profile, solve, show and train the built-in gpt-tiny at half its memory",
                               description="On the built-in gpt-tiny: profile it, solve at 50%% of the store-all peak "
                                           "with rotor, show the schedule and memory timeline, train a few steps and "
                                           "compare predicted with measured.")
    demo.add_argument("--plot", metavar="timeline.png", help="also save the memory timeline as a PNG")
    demo.add_argument("--steps", type=_at_least(1, MAX_RUNS), default=3, metavar="N", help="training steps (default: 3)")
    demo.set_defaults(command=_demo)

    solve = commands.add_parser("solve", help="find a schedule that fits a memory budget",
                                description="Find the fastest schedule of a chain or a graph within a memory budget.")
    solve.add_argument("chain", metavar="PROBLEM.json", help="chain (memsched.chain/1) or graph (memsched.graph/1) problem")
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
    solve.add_argument("--segments", type=_at_least(1, validate.MAX_INDEX), metavar="N", help="sqrt: number of segments")
    solve.add_argument("--snapshots", type=_at_least(1, validate.MAX_INDEX), metavar="N", help="revolve: snapshot slots")
    solve.add_argument("-o", "--output", metavar="PLAN.json", help="write the plan here (memsched.plan/1)")
    solve.set_defaults(command=_solve)

    show = commands.add_parser("show", help="print a plan, and its memory timeline given the chain or graph",
                               description="Print a plan; with --chain (or --graph), re-simulate it and draw its "
                                           "memory timeline.")
    show.add_argument("plan", metavar="PLAN.json", help="plan (memsched.plan/1)")
    show.add_argument("--chain", metavar="CHAIN.json", help="the chain the plan was solved for")
    show.add_argument("--graph", metavar="GRAPH.json", help="the graph a graph plan was solved for")
    show.add_argument("--plot", metavar="timeline.png", help="save the memory timeline as a PNG (needs --chain)")
    show.set_defaults(command=_show)

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
    pareto.set_defaults(command=_pareto)

    memory = commands.add_parser("memory", help="per-device memory of parameters, gradients and optimizer state",
                                 description="Per-device bytes of parameters, gradients, master copy and optimizer "
                                             "state for an optimizer, a precision and a ZeRO stage, and the budget "
                                             "that --device-memory leaves for the step (activations).")
    memory.add_argument("model", metavar="SPEC|CHAIN.json",
                        help="a built-in model or path/to/file.py:factory (built on fake tensors: nothing is "
                             "allocated), or a chain profile (parameters: its param_bytes / 4)")
    memory.add_argument("--batch", type=_at_least(1), metavar="N", help="SPEC: batch size")
    _add_setup_arguments(memory)
    memory.set_defaults(command=_memory)

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
                           help="device-to-device bandwidth for the boundary activations and gradients (default: "
                                "free)")
    partition.add_argument("--latency", type=float, metavar="SECONDS", help="fixed seconds per transfer (default: 0)")
    partition.add_argument("--slots", type=_at_least(1), metavar="N", help="rotor: memory discretisation slots")
    _add_setup_arguments(partition)
    partition.add_argument("-o", "--output", metavar="PLAN.json", help="write the plan here (memsched.plan/1)")
    partition.set_defaults(command=_partition)
    return parser


def _profile(args) -> None:
    from profiles.chain_profiler import profile_chain  # torch loads only for the commands that need it
    from profiles.spec import load_model

    if args.throughput is not None and not args.estimate:
        raise MemschedError("--throughput is the FLOP/s assumed by --estimate: give it with --estimate")
    # A graph estimate builds the model for real (its parameters and inputs) and traces the step on fake
    # tensors: a model built under fake tensors leaves fake constants (targets) that the capture refuses.
    channel = _channel(args)
    if args.graph and channel is not None:
        raise MemschedError("--bandwidth is for chain profiles (offload plans); a graph profile has no copy channel")
    model, _ = load_model(args.spec, batch=args.batch, estimate=args.estimate and not args.graph)
    if args.graph:
        _profile_graph(args, model)
        return
    total = len(model.stages) + 1
    bar = []  # the stage whose bar is on stderr, its line not ended

    def progress(done, label):
        if sys.stderr.isatty() or total > 20:
            end = "\n" if done + 1 == total else ""
            print("\r" + render.progress_bar(done + 1, total, label), end=end, file=sys.stderr, flush=True)
            bar[:] = [] if end else [done]

    try:
        chain = profile_chain(model.stages, model.example_inputs, loss_fn=model.loss_fn, device=args.device,
                              warmup=args.warmup, repeats=args.repeats, name=model.name, estimate=args.estimate,
                              throughput=args.throughput, progress=progress, transfer=channel)
    except BaseException:  # an error or Ctrl-C mid-bar: the bar's line ended, so that the message has its own
        if bar:
            print(file=sys.stderr, flush=True)
        raise
    save_chain(chain, args.output)
    print("\n".join(render.chain_table(chain) + [f"chain written to {args.output}"]))


def _profile_graph(args, model) -> None:
    from profiles.graph_profiler import profile_graph

    print(f"capturing and profiling {model.name}'s training step as a graph of at most {args.nodes} nodes...",
          file=sys.stderr, flush=True)
    graph = profile_graph(model.stages, model.example_inputs, model.loss_fn, nodes=args.nodes, estimate=args.estimate,
                          throughput=args.throughput, device=args.device, warmup=args.warmup, repeats=args.repeats,
                          name=model.name)
    save_graph(graph, args.output)
    print("\n".join(render.graph_summary(graph, store_all_graph_peak(graph)) + [f"graph written to {args.output}"]))


def _train(args) -> None:
    from profiles.chain_profiler import checked_device
    from profiles.spec import load_model

    checked_device(args.device)
    if args.progress_timeout is not None and (args.graph or not args.plan):
        raise MemschedError("--progress-timeout bounds a pipeline run: give it with --plan pipeline.json")
    model, _ = load_model(args.spec, batch=args.batch)
    if args.graph:
        _train_graph(args, model)
        return
    if args.time_limit is not None:
        raise MemschedError("--time-limit is for graph solvers: give it with --graph")
    if args.plan and (args.device_memory is not None or args.budget == "auto"):
        raise MemschedError("--budget auto and --device-memory size a budget to solve for: drop them with --plan")
    if args.plan:
        plan = load_plan(args.plan)
        chain = load_chain(args.chain) if args.chain else None
        if plan.kind == "pipeline":
            _train_pipeline(args, plan, chain)
            return
        if args.progress_timeout is not None:
            raise MemschedError(f"--progress-timeout bounds a pipeline run; {args.plan} is a plan of kind {plan.kind}: "
                                "drop --progress-timeout")
        if plan.kind == "graph":
            raise MemschedError(f"{args.plan} is a graph plan: train by it with --graph GRAPH.json (its graph profile)")
        if chain is not None:
            check_plan_matches(plan, chain, plan_where=args.plan)
        _check_measured_on(args, model, chain if chain is not None else plan)
    else:
        if not args.budget:
            raise MemschedError("train needs --budget (or a ready --plan)")
        chain = load_chain(args.chain) if args.chain else _profile_quietly(model, args.device)
        if args.chain:
            _check_measured_on(args, model, chain)
        budget, how = _auto_budget(args, chain)
        if budget is None:
            budget = parse_budget(args.budget, solvers.store_all_peak(chain))
        plan = solvers.solve(chain, budget, args.solver, **_offload_params(args, chain, args.solver))
        print("\n".join(([f"budget auto: {how}"] if how else []) +
                        render.solve_summary(plan, args.solver, simulate(chain, plan) if plan.moves_data else None)))
    _train_chain(model, plan, chain, args.steps, args.device, args.lr)


def _check_measured_on(args, model, problem) -> None:
    """Refuse a --chain (or, without it, --plan) measured on other parameters or inputs than ``model``'s, before
    any work; a note when it records none (a file from an older memsched)."""
    source = f"chain {args.chain}" if args.chain else f"plan {args.plan}"
    if problem.measured_on is None:
        print(f"note: the {source} records no input or parameter shapes (an older file): not checked against "
              f"{model.name}")
        return
    problem.measured_on.check_stages(_named(model.stages), source)
    batch = problem.measured_on.recorded_batch(model.example_inputs)
    problem.measured_on.check_inputs(model.example_inputs, source,
                                     None if batch is None else f"profile again at this batch or pass --batch {batch}")


def _train_pipeline(args, plan, chain) -> None:
    """``train SPEC --plan pipeline.json``: one process per device (planner/execute/pipeline.py); per rank, the last
    step's measured peak against the plan's device peak minus its resident state."""
    import functools

    from planner.execute.pipeline import DEFAULT_PROGRESS_TIMEOUT, run_pipeline, summary_lines
    from profiles.memory import memory_meter
    from profiles.spec import built_model

    pipe = plan.pipeline
    timeout = DEFAULT_PROGRESS_TIMEOUT if args.progress_timeout is None else args.progress_timeout
    results = run_pipeline(functools.partial(built_model, args.spec, batch=args.batch), plan, args.steps,
                           meter=memory_meter, device=args.device, lr=args.lr, chain=chain, progress_timeout=timeout)
    print("\n".join([f"pipeline: {len(pipe.devices)} devices, {pipe.schedule}, {pipe.micro_batches} micro-batches, "
                     f"{args.steps} steps on {args.device}"] + summary_lines(results)))


def _demo(args) -> None:
    from profiles.spec import load_model

    model, _ = load_model("gpt-tiny")
    print("memsched demo: the built-in gpt-tiny, trained at half the memory of storing every activation\n")
    chain = _profile_quietly(model, "cpu")
    print("\n".join(render.chain_table(chain)) + "\n")
    budget = parse_budget("50%", solvers.store_all_peak(chain))
    plan = solvers.solve(chain, budget, "rotor")
    print("\n".join(render.solve_summary(plan, "rotor")))
    print("schedule:\n  " + "\n  ".join(render.compact_schedule(plan.schedule, width=76).splitlines()) + "\n")
    result = simulate(chain, plan)
    print("\n".join(render.ascii_timeline(result, plan.budget_bytes)) + "\n")
    if args.plot:
        plot_timeline(result, plan.budget_bytes, args.plot, f"{plan.problem_name}: {plan.solver} plan")
        print(f"timeline plot written to {args.plot}\n")
    _train_chain(model, plan, chain, args.steps, "cpu", 1e-3)


def _profile_quietly(model, device):
    from profiles.chain_profiler import profile_chain

    print(f"profiling {model.name} on {device} ({len(model.stages)} stages)...", file=sys.stderr, flush=True)
    return profile_chain(model.stages, model.example_inputs, loss_fn=model.loss_fn, device=device, name=model.name)


def _train_graph(args, model) -> None:
    """``train --graph``: a graph plan (solved here, or ``--plan``) run by the graph executor."""
    from planner.graph import load_graph
    from planner.execute.graph import GraphExecutor
    from profiles.graph_profiler import profile_graph

    if args.chain:
        raise MemschedError("--chain is a chain profile; with --graph give a graph profile as --graph GRAPH.json")
    _refuse_auto_for_graphs(args)
    if args.device != "cpu":
        model.stages = [(name, module.to(args.device)) for name, module in _named(model.stages)]
        model.example_inputs = _moved(model.example_inputs, args.device)
    if isinstance(args.graph, str):
        graph = load_graph(args.graph)
    else:
        print(f"capturing and profiling {model.name}'s training step as a graph of at most {args.nodes} nodes...",
              file=sys.stderr, flush=True)
        graph = profile_graph(model.stages, model.example_inputs, model.loss_fn, nodes=args.nodes, device=args.device,
                              name=model.name)
    if args.plan:
        plan = load_plan(args.plan)
        check_graph_plan_matches(plan, graph, plan_where=args.plan)
    else:
        if not args.budget:
            raise MemschedError("train needs --budget (or a ready --plan)")
        plan = solve_graph(graph, parse_budget(args.budget, store_all_graph_peak(graph)), args.solver,
                           time_limit=args.time_limit)
        print("\n".join(_graph_summary(plan, args.solver)))
    executor = GraphExecutor(model, plan, graph)
    _train_and_report(model, plan, executor.step, _named(model.stages), model.example_inputs, graph.fixed_bytes,
                      args.steps, args.device, args.lr)


def _named(stages):
    from planner.execute.stages import named_stages

    return named_stages(stages)


def _moved(inputs, device):
    import torch

    return tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in inputs)


def _train_chain(model, plan, chain, steps, device, lr) -> None:
    """Train by a chain ``plan`` with :func:`planner.execute.chain.apply_plan`."""
    from planner.execute.chain import apply_plan
    from profiles.training import autograd_step, input_bytes
    from profiles.chain_profiler import default_loss

    stages = [(name, module.to(device)) for name, module in _named(model.stages)]
    inputs = _moved(model.example_inputs, device)
    planned = apply_plan(stages, plan, chain)
    step = autograd_step(planned, model.loss_fn or default_loss, inputs)
    _train_and_report(model, plan, step, stages, inputs, input_bytes(inputs), steps, device, lr)


def _train_and_report(model, plan, planned_step, stages, inputs, resident_bytes, steps, device, lr) -> None:
    """Train by ``planned_step`` and, for reference, the unmodified model on ``inputs``, their steps alternating;
    print measured against predicted.

    ``resident_bytes`` is what the plan's prediction counts as already allocated (the inputs for a chain,
    ``fixed_bytes`` for a graph): both runs' peaks are counted on that basis.
    """
    import torch

    from profiles.training import autograd_step, measure_alternately, plain_forward
    from profiles.chain_profiler import default_loss

    loss_fn = model.loss_fn or default_loss
    parameters = list({id(p): p for _, module in stages if isinstance(module, torch.nn.Module)
                       for p in module.parameters() if p.requires_grad}.values())
    optimizer = torch.optim.Adam(parameters, lr=lr)
    for parameter in parameters:  # optimizer state exists before the first measured window, as in steady state
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    plain_step = autograd_step(lambda *xs: plain_forward(stages, xs), loss_fn, inputs)
    measured, plain = measure_alternately(planned_step, plain_step, parameters, optimizer, steps, device,
                                          resident_bytes)
    print("\n".join(render.training_table(plan, measured, plain)))


def _is_graph_file(path) -> bool:
    """True when the file's format tag says ``memsched.graph/1`` (a chain, or anything else, is read as a chain)."""
    return read_json(path).get("format") == GRAPH_FORMAT


def _solve(args) -> None:
    if _is_graph_file(args.chain):
        _solve_graph(args)
        return
    if args.max_computations is not None or args.backend is not None or args.gap is not None or \
            args.first_order is not None:
        raise MemschedError("--max-computations, --first-order, --backend and --gap are for graph problems "
                            "(memsched.graph/1); the chain solvers are exact and fast")
    chain = load_chain(args.chain)
    budget, how = _auto_budget(args, chain)
    if budget is None:
        budget = parse_budget(args.budget, solvers.store_all_peak(chain))
    try:
        plan = solvers.solve(chain, budget, args.solver, slots=args.slots, segments=args.segments,
                             snapshots=args.snapshots, **_offload_params(args, chain, args.solver))
    except MemschedError:
        if how and budget < minimum_budget(chain):
            raise MemschedError(f"--budget auto leaves {render.describe_bytes(budget)}, below the minimum feasible "
                                f"{render.describe_bytes(minimum_budget(chain))} for chain {chain.name!r} ({how}): "
                                "use a device with more memory, more ranks or a higher ZeRO stage") from None
        raise
    lines = ([f"budget auto: {how}"] if how else []) + render.solve_summary(plan, args.solver,
                                                         simulate(chain, plan) if plan.moves_data else None)
    if args.output:
        save_plan(plan, args.output)
        lines.append(f"plan written to {args.output}")
    print("\n".join(lines))


def _offload_params(args, chain, solver: str) -> dict:
    """``transfer``, ``schedule`` and ``time_limit`` for pofo and the offload solvers (refused for the others),
    and ``weights`` with the channel for ``--offload-weights`` (any solver)."""
    weights = getattr(args, "offload_weights", None)
    if weights is not None and solver not in solvers.OFFLOAD_SOLVERS:
        if getattr(args, "schedule", None) is not None or args.time_limit is not None:
            raise MemschedError(f"--schedule and --time-limit are for pofo and the offload solvers, not for {solver}")
        return {"weights": weights, "transfer": _required_channel(args, chain, "--offload-weights")}
    if solver not in solvers.OFFLOAD_SOLVERS:
        given = [flag for flag, value in (("--bandwidth", args.bandwidth), ("--h2d-bandwidth", args.h2d_bandwidth),
                                          ("--latency", args.latency), ("--schedule", getattr(args, "schedule", None)),
                                          ("--time-limit", args.time_limit)) if value is not None]
        if given:
            raise MemschedError(f"{given[0]} is for pofo and the offload solvers ({', '.join(solvers.OFFLOAD_SOLVERS)}), "
                                f"not for {solver}")
        return {}
    channel = _required_channel(args, chain, solver)
    return {"transfer": channel, "schedule": getattr(args, "schedule", None), "time_limit": args.time_limit,
            "weights": weights}


def _required_channel(args, chain, what: str):
    channel = _channel(args, chain)
    if channel is None:
        raise MemschedError(f"{what} moves data to host memory and needs the copy channel: give --bandwidth "
                            "(e.g. 16GB/s), or profile the chain on CUDA, which measures it")
    return channel


def _refuse_auto_for_graphs(args) -> None:
    given = [flag for flag, field in (("--device-memory", "device_memory"),) + _SETUP_FLAGS
             if getattr(args, field, None) is not None]
    if args.budget == "auto" or given:
        raise MemschedError(f"{'--budget auto' if args.budget == 'auto' else given[0]} is for chain problems; a graph "
                            "counts its parameters in fixed_bytes: give the graph's budget in bytes or as a percentage")


def _solve_graph(args) -> None:
    _refuse_auto_for_graphs(args)
    if args.slots is not None or args.segments is not None or args.snapshots is not None:
        raise MemschedError("--slots, --segments and --snapshots are for chain solvers; a graph takes "
                            "--time-limit, --max-computations and --first-order (moccasin), --backend and --gap "
                            "(checkmate)")
    if args.gap is not None and not 0 <= args.gap < 1:
        raise MemschedError(f"--gap must be a fraction between 0 and 1 (0.01 = 1%), got {args.gap}")
    graph = Graph.from_dict(read_json(args.chain), where=args.chain)
    budget = parse_budget(args.budget, store_all_graph_peak(graph))
    plan = solve_graph(graph, budget, args.solver, time_limit=args.time_limit,
                       max_computations=args.max_computations, first_order=args.first_order, backend=args.backend,
                       gap=args.gap)
    lines = _graph_summary(plan, args.solver)
    if args.output:
        save_plan(plan, args.output)
        lines.append(f"plan written to {args.output}")
    print("\n".join(lines))


def _optimality(plan) -> str:
    if plan.optimal:
        return "yes"
    return "no" if plan.gap is None else f"no (gap {render.format_percent(plan.gap)} to the solver's bound)"


def _graph_summary(plan, requested: str) -> list:
    """Lines describing a fresh graph plan, as :func:`planner.render.solve_summary` does for chains."""
    lines = render.solve_summary(plan, requested)
    lines[0] = f"graph      {plan.problem_name}"
    lines[6] = f"recomputed {plan.recomputed_forwards} computations"
    lines[7] = f"solved in  {render.format_seconds(plan.solve_seconds)}, optimal: {_optimality(plan)}"
    return lines


def _graph_compact(schedule, width: int = 76) -> list:
    """A graph schedule as ranges: ``compute 0-5, free 2, compute 6, free 0-1, ...`` in lines of at most ``width``."""
    groups = []  # [kind, first node, last node]
    for op in schedule:
        if groups and groups[-1][0] == op.kind and op.node == groups[-1][2] + 1:
            groups[-1][2] = op.node
        else:
            groups.append([op.kind, op.node, op.node])
    lines, line = [], ""
    for kind, first, last in groups:
        item = f"{kind} {first}" if first == last else f"{kind} {first}-{last}"
        candidate = f"{line}, {item}" if line else item
        if line and len(candidate) + 1 > width:
            lines.append(line + ",")
            candidate = item
        line = candidate
    return lines + [line]


def _show(args) -> None:
    plan = load_plan(args.plan)
    if plan.kind == "graph" or args.graph:
        _show_graph(args, plan)
        return
    if plan.kind == "pipeline":
        _show_pipeline(args, plan)
        return
    if args.plot and not args.chain:
        raise MemschedError("--plot draws the memory timeline, which needs the chain: add --chain CHAIN.json")
    plan = load_plan(args.plan)
    lines = render.plan_header(plan) + ["  " + line for line in render.compact_schedule(plan.schedule, width=76).splitlines()]
    if args.chain:
        chain = load_chain(args.chain)
        check_plan_matches(plan, chain, plan_where=args.plan)
        result = simulate(chain, plan)
        lines += [""] + render.simulation_lines(plan, result) + render.transfer_lines(plan, result)[1:]
        lines += [""] + render.ascii_timeline(result, plan.budget_bytes)
        if args.plot:
            plot_timeline(result, plan.budget_bytes, args.plot, f"{plan.problem_name}: {plan.solver} plan")
            lines.append(f"timeline plot written to {args.plot}")
    print("\n".join(lines))


def _show_pipeline(args, plan) -> None:
    from planner.simulate.pipeline import simulate_pipeline
    from planner.plan import check_pipeline_plan_matches

    if args.plot:
        raise MemschedError("--plot draws one device's memory timeline; a pipeline plan has one per device: show "
                            "it without --plot")
    lines = render.pipeline_lines(plan)
    if args.chain:
        chain = load_chain(args.chain)
        check_pipeline_plan_matches(plan, chain, plan_where=args.plan)
        result = simulate_pipeline(chain, plan)
        lines += [""] + render.simulation_lines(plan, result) + [""] + render.pipeline_memory_lines(result)
    print("\n".join(lines))


def _show_graph(args, plan) -> None:
    if args.chain:
        raise MemschedError(f"{args.plan} is a graph plan: give its graph with --graph GRAPH.json, not --chain")
    if args.plot and not args.graph:
        raise MemschedError("--plot draws the memory timeline, which needs the graph: add --graph GRAPH.json")
    graph = Graph.from_dict(read_json(args.graph), where=args.graph) if args.graph else None
    if graph is not None:
        check_graph_plan_matches(plan, graph, plan_where=args.plan)
    lines = render.plan_header(plan)
    params = "".join(f", {key}={value}" for key, value in plan.params.items())
    lines[1] = f"solver     {plan.solver}{params} (optimal: {_optimality(plan)})"
    lines[-1] = f"schedule   {len(plan.schedule)} operations, {plan.recomputed_forwards} recomputations:"
    lines += ["  " + line for line in _graph_compact(plan.schedule)]
    if graph is not None:
        result = simulate_graph(graph, plan)
        categories = render.graph_op_categories(plan.schedule, graph)
        lines += [""] + render.simulation_lines(plan, result) + [""] + render.graph_timeline(result, plan, categories)
        if args.plot:
            plot_timeline(result, plan.budget_bytes, args.plot, f"{plan.problem_name}: {plan.solver} plan", categories)
            lines.append(f"timeline plot written to {args.plot}")
    print("\n".join(lines))


def _pareto(args) -> None:
    chain = load_chain(args.chain)
    channel = _channel(args, chain)
    names = PARETO_SOLVERS + (OFFLOAD_CURVES if channel is not None and channel.usable else ())
    low, high = minimum_budget(chain), solvers.store_all_peak(chain)
    if high == 0:
        raise MemschedError(f"{args.chain}: chain '{chain.name}' allocates nothing (every size is 0, so is its "
                            "store-all peak): there is no memory to trade for time; profile the model again")
    rows = []
    for k in range(args.points):
        budget = low + (high - low) * k // (args.points - 1)
        rows.append((budget, {name: _overhead(chain, budget, name, args.slots, channel) for name in names}))
    lines = [
        f"chain {chain.name}: step-time overhead over no recomputation ({render.format_seconds(chain.compute_time)})",
        f"budgets from the minimum feasible {render.describe_bytes(low)} to the store-all peak {render.describe_bytes(high)}",
        *render.transfer_lines_for_channel(channel, "pofo: its table, not re-timed; offload_greedy: on store-all"),
        "",
        *render.pareto_table(rows, names, high),
        "",
        "— : that solver has no schedule within the budget",
    ]
    if args.plot:
        plot_pareto(rows, names, args.plot, f"{chain.name}: overhead against budget")
        lines.append(f"pareto plot written to {args.plot}")
    print("\n".join(lines))


def _overhead(chain, budget: int, solver: str, slots, channel=None):
    """The overhead fraction of ``solver``'s plan within ``budget`` bytes, or None when it has none."""
    params = {"slots": slots} if solver in ("rotor", "pofo") else {}
    if solver in OFFLOAD_CURVES:
        params["transfer"] = channel
    if solver == "pofo":
        params["time_limit"] = 0
    try:
        plan = solvers.solve(chain, budget, solver, **params)
    except MemschedError:
        return None
    return plan.predicted.overhead


def _memory(args) -> None:
    """``memory SPEC|CHAIN.json``: per-device bytes besides activations, and the step budget a device leaves."""
    from planner.training_setup import ITEMS, activation_budget, parameters_of

    setup = _setup(args)
    device_memory = None if args.device_memory is None else parse_budget(args.device_memory, what="--device-memory")
    if args.model.endswith(".json"):  # a SPEC names a .py file or a built-in model
        if args.batch is not None:
            raise MemschedError("--batch builds a SPEC; a chain profile has its batch already")
        chain = load_chain(args.model)
        parameters = parameters_of(chain)
        lines = [f"chain      {chain.name}: {parameters} trainable parameters (its param_bytes / 4: fp32 profile)"]
    else:
        chain, name, parameters = _estimated_chain(args.model, args.batch, device_memory is not None)
        lines = [f"model      {name}: {parameters} trainable parameters (counted from its modules)"]
    per_parameter, sizes = setup.per_parameter(), setup.breakdown(parameters)
    labels = {"params": "parameters", "grads": "gradients", "master": "fp32 master copy",
              "optimizer": "optimizer state"}
    lines += [f"setup      {setup.describe()}", "",
              f"{'per device':<18} {'bytes/param':>11} {'bytes':>16} {'':>11}"]
    for item in ITEMS:
        lines.append(f"{labels[item]:<18} {per_parameter[item]:>11.6g} {sizes[item]:>16} "
                     f"{format_bytes(sizes[item]):>11}")
    resident = setup.resident_bytes(parameters)
    total = resident + sizes["grads"]
    lines += [f"{'resident':<18} {'':>11} {resident:>16} {format_bytes(resident):>11}   "
              "parameters + master copy + optimizer state, before the step",
              f"{'with gradients':<18} {'':>11} {total:>16} {format_bytes(total):>11}   "
              "gradients are made by the step, inside its budget", ""]
    if device_memory is None:
        lines.append("give --device-memory (e.g. 80GiB) for the activation budget a device leaves")
    else:
        budget = activation_budget(chain, setup, device_memory)
        if parameters_of(chain) != parameters:
            lines.append(f"note       the estimated chain's param_bytes / 4 count {parameters_of(chain)} parameters "
                         "(not an fp32 model?): the budget below is computed from those")
        peak, least = solvers.store_all_peak(chain), minimum_budget(chain)
        lines += [f"device     {render.describe_bytes(device_memory)}",
                  f"budget     {render.describe_bytes(budget)} for the step: activations, temporaries and the "
                  "chain's parameter gradients (memsched solve --budget auto)",
                  f"step       store-all peak {render.describe_bytes(peak)}, least feasible "
                  f"{render.describe_bytes(least)}: " + (
                      "fits without recomputation" if peak <= budget else
                      "fits with recomputation" if least <= budget else "does not fit even with recomputation")]
    print("\n".join(lines))


def _estimated_chain(spec: str, batch, with_chain: bool):
    """``(chain, name, parameters)`` for a SPEC: the model built on fake tensors, its trainable parameters counted
    once each, and (``with_chain``, else None) its chain estimated (sizes exact, nothing allocated)."""
    import torch

    from profiles.chain_profiler import profile_chain
    from profiles.spec import load_model

    model, _ = load_model(spec, batch=batch, estimate=True)
    parameters = {id(p): p.numel() for _, module in _named(model.stages) if isinstance(module, torch.nn.Module)
                  for p in module.parameters() if p.requires_grad}
    chain = None if not with_chain else profile_chain(model.stages, model.example_inputs, loss_fn=model.loss_fn,
                                                      name=model.name, estimate=True, warmup=0, repeats=1)
    return chain, model.name, sum(parameters.values())


def _partition(args) -> None:
    from planner.simulate.pipeline import simulate_pipeline
    from planner.transfer import parse_bandwidth
    from solvers.partition import partition

    if args.device_memory is None:
        raise MemschedError("partition needs the memory of one device: give --device-memory (e.g. 80GiB)")
    latency = _latency(args)
    chain = load_chain(args.chain)
    memory = parse_budget(args.device_memory, what="--device-memory")
    bandwidth = None if args.bandwidth is None else parse_bandwidth(args.bandwidth)
    plan = partition(chain, args.devices, memory, args.micro_batches, schedule=args.pipeline_schedule,
                     bandwidth=bandwidth, latency=latency, setup=_setup(args),
                     **({} if args.slots is None else {"slots": args.slots}))
    lines = render.pipeline_lines(plan, memory) + [""] + render.pipeline_memory_lines(simulate_pipeline(chain, plan))
    if args.output:
        save_plan(plan, args.output)
        lines.append(f"plan written to {args.output}")
    print("\n".join(lines))
