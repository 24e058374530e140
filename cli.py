"""The ``memsched`` command line, its commands demo, profile, solve, show, pareto, train, memory and partition.

Argument parsing and printing only: the work is done by planner/, solvers/ and profiles/, the text by
planner/render.py and the PNGs by planner/plot.py. The imports inside the command functions keep torch out of
the torch-free commands. An expected error (:class:`planner.errors.MemschedError`) is printed as one line,
``memsched: error: <message>``, with exit status 2; so are usage errors. Ctrl-C prints ``memsched: interrupted``
and exits with status 130.
"""

import os
import sys

import planner.render as render
import planner.render_memory as render_memory
import planner.validate as validate
import solvers
from cli_arguments import parser
from planner import check_plan_matches, check_plan_schedules, load_chain, load_plan, save_chain, save_plan, simulate
from planner.errors import MemschedError
from planner.graph import GRAPH_FORMAT, load_graph, save_graph
from planner.interrupts import interrupts_delivered
from planner.jsonio import output_path, read_json
from planner.plot import plot_pareto, plot_timeline
from planner.setup import Run, TrainingSetup, check
from planner.setup.flags import FIELD_FLAGS, SIZING_FLAGS, setup_from_flags
from planner.transfer import channel_from
from planner.units import parse_bandwidth, parse_budget
from profiles.device_plan import memory_report, target_device  # torch-free (it loads the estimate for a SPEC)
from solvers import solve_graph, store_all_graph_peak
from solvers.budgets import solve_for_budget, solved_lines, sweep, whole_step_floors
from solvers.partition import partition


def main(argv=None) -> int:
    """Run the command line on ``argv`` (default: ``sys.argv[1:]``); return the exit status."""
    try:
        try:
            args = parser().parse_args(argv)
        except SystemExit as exc:  # argparse has printed the usage error (status 2) or the help (status 0)
            return exc.code
        try:
            _check_numbers(args)  # refused before any work, as are the outputs
            for given in (getattr(args, name, None) for name in ("output", "plot")):
                if given:
                    output_path(given)
            with interrupts_delivered():  # a Ctrl-C inside a finalizer is not lost (planner/interrupts.py)
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


def _profile(args) -> None:
    from profiles.chain_profiler import profile_chain  # torch loads only for the commands that need it
    from profiles.spec import load_model

    for flag in _given(args, "--throughput", "--device-spec") if not args.estimate else ():
        raise MemschedError(f"{flag} is what --estimate assumes of the device: give it with --estimate")
    # A graph estimate builds the model for real (its parameters and inputs) and traces the step on fake
    # tensors: a model built under fake tensors leaves fake constants (targets) that the capture refuses.
    check(TrainingSetup(), Run(graph=args.graph, target=args.device_spec is not None, autocast=bool(args.autocast)))
    if args.graph and args.bandwidth is not None:
        raise MemschedError("--bandwidth is for chain profiles; a graph profile has no copy channel")
    channel, target = _channel(args), args.device_spec and target_device(args.device_spec)  # "cpu": measured
    model, _ = load_model(args.spec, batch=args.batch, estimate=args.estimate and not args.graph,
                          autocast=args.autocast, device_spec=target or None)
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
                                   args.budget, args.autocast)))


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
