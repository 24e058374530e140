"""The ``memsched`` command line's grammar: its commands, their flags and each flag's range (cli.py runs them).

Every number a flag takes is bounded where the command would not finish beyond it (:func:`at_least`); a usage
error is one line (:class:`Parser`), as every other error of the command line.
"""

import argparse
import sys

import planner.validate as validate
import solvers
from planner.devices import DEVICES
from planner.setup.training import OPTIMIZERS, PRECISIONS
from planner.updates import UPDATES
from profiles.options import DEFAULT_OPTIONS  # torch-free
from solvers import GRAPH_SOLVER_NAMES

MAX_POINTS = 1000  # pareto budgets: each is three solves
MAX_RUNS = validate.MAX_RUNS  # profiling runs per stage, training steps
MAX_COMPUTATIONS = 100  # moccasin's model grows with it; 2 or 3 is the usual


class Parser(argparse.ArgumentParser):
    """argparse, printing a usage error as one line (``memsched: error: ...``, status 2) like every other error."""

    def error(self, message):
        print(f"memsched: error: {' '.join(message.split())} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def at_least(minimum: int, maximum: int = None):
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


def add_channel_arguments(parser, purpose: str) -> None:
    """``--bandwidth`` (both directions unless ``--h2d-bandwidth``) and ``--latency``: a copy channel."""
    parser.add_argument("--bandwidth", metavar="RATE", help=f"{purpose}: device-to-host bandwidth, e.g. 16GB/s "
                                                             "(and host-to-device, unless --h2d-bandwidth)")
    parser.add_argument("--h2d-bandwidth", metavar="RATE", help="host-to-device bandwidth (default: --bandwidth)")
    parser.add_argument("--latency", type=float, metavar="SECONDS", help="fixed seconds per transfer (default: 0)")


def add_autocast_argument(parser) -> None:
    parser.add_argument("--autocast", choices=("bf16", "fp16"), help="a whole model's step under torch.autocast of "
                        "this dtype, as its device casts (a CUDA --device-spec: CUDA's op lists)")


def add_setup_arguments(parser, training: bool = False) -> None:
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
                            help=f"{', '.join(PRECISIONS)}; bf16, fp16: mixed precision with an fp32 master copy; "
                                 "pure-bf16: bf16 parameters and optimizer state, none (default: fp32)")
    parser.add_argument("--zero", type=int, metavar="STAGE",
                        help="ZeRO stage 0-3 over the --dp ranks: 1 shards optimizer state and master copy, "
                             "2 also gradients, 3 also parameters (default: 0; train --dp: 1-3, default 3)")
    parser.add_argument("--dp", type=int, metavar="N", help="data-parallel ranks (default: 1; train: a process and "
                                                            "a part of the batch each, ZeRO 2-3 on FSDP2)")


def parser() -> argparse.ArgumentParser:
    parser = Parser(prog="memsched", description="Plan memory-bounded training of a chain of stages.")
    commands = parser.add_subparsers(dest="name", required=True, metavar="COMMAND")

    profile = commands.add_parser("profile", help="measure a model into a chain problem", description="Measure a "
                                  "model, stage by stage, into a chain problem (memsched.chain/1).")
    profile.add_argument("spec", metavar="SPEC",
                         help="a built-in model (mlp, gpt-tiny, resnet-tiny; options as gpt-tiny:layers=12,d=512) "
                              "or path/to/file.py:factory")
    profile.add_argument("-o", "--output", required=True, metavar="CHAIN.json", help="write the chain here")
    profile.add_argument("--batch", type=at_least(1), metavar="N", help="batch size")
    profile.add_argument("--device", choices=("cpu", "cuda"), help="measure on this device (default: the model's)")
    profile.add_argument("--estimate", action="store_true",
                         help="allocate nothing: exact sizes from fake tensors, times from FLOPs / --throughput")
    profile.add_argument("--throughput", type=float, metavar="FLOP/s",
                         help="device throughput assumed by --estimate (default: 1e12)")
    profile.add_argument("--device-spec", metavar="NAME|FILE", help=f"--estimate for a device: {', '.join(DEVICES)} "
                         "or a memsched.device/1 file (in its allocator's blocks, at its peak FLOP/s)")
    add_autocast_argument(profile)
    profile.add_argument("--graph", action="store_true",
                         help="profile the whole training step as a graph (memsched.graph/1) instead of a chain")
    profile.add_argument("--nodes", type=at_least(2, validate.MAX_INDEX), default=200, metavar="N",
                         help="--graph: coarsen the captured step to at most N nodes (default: 200)")
    add_channel_arguments(profile, "record this copy channel in the chain (on CUDA it is measured unless given)")
    profile.add_argument("--warmup", type=at_least(0, MAX_RUNS), default=2, metavar="N",
                         help="untimed runs per stage (default: 2)")
    profile.add_argument("--repeats", type=at_least(1, MAX_RUNS), default=5, metavar="N",
                         help="timed runs per stage, median kept (default: 5)")
    profile.add_argument("--options", type=at_least(0, MAX_RUNS), default=DEFAULT_OPTIONS, metavar="N",
                         help=f"ways to run each distinct stage keeping less, measured (default: {DEFAULT_OPTIONS})")

    train = commands.add_parser("train", help="train a model by a plan, measured against the prediction",
                                description="Profile (unless --chain), solve (unless --plan), and train a model by the "
                                            "plan, printing measured against predicted peak and time per step.")
    train.add_argument("spec", metavar="SPEC", help="a built-in model or path/to/file.py:factory, as for profile")
    train.add_argument("--budget", metavar="B", help="memory budget as for solve (needed unless --plan is given); "
                                                     "auto: what --device-memory leaves beside the fp32 parameters, "
                                                     "gradients and Adam state this command trains with")
    add_setup_arguments(train, training=True)
    train.add_argument("--solver", default="auto", metavar="NAME", help="solver (default: auto)")
    train.add_argument("--plan", metavar="PLAN.json", help="train by this plan instead of solving")
    train.add_argument("--chain", metavar="CHAIN.json", help="use this profile instead of profiling")
    train.add_argument("--graph", nargs="?", const=True, metavar="GRAPH.json",
                       help="train by a graph plan (checkmate, moccasin, checkmate-lp) with the graph executor: "
                            "profile the step as a graph, or use this graph profile")
    train.add_argument("--nodes", type=at_least(2, validate.MAX_INDEX), default=200, metavar="N",
                       help="--graph: coarsen the captured step to at most N nodes (default: 200)")
    train.add_argument("--time-limit", type=float, metavar="SECONDS", help="--graph: solver time limit")
    add_channel_arguments(train, "offload solvers (pofo, offload...) and --offload-weights: the copy channel "
                                  "(default: the chain's)")
    train.add_argument("--offload-weights", metavar="all|I,J,...",
                       help="keep these stages' parameters on the host (as for solve)")
    train.add_argument("--compile", action="store_true", help="run the plan (and the plain step) through torch.compile")
    train.add_argument("--steps", type=at_least(1, MAX_RUNS), default=5, metavar="N",
                       help="training steps (default: 5)")
    train.add_argument("--batch", type=at_least(1), metavar="N", help="batch size")
    train.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="train on this device (default: cpu)")
    train.add_argument("--lr", type=float, default=1e-3, help="learning rate of the Adam optimizer (default: 1e-3)")
    train.add_argument("--max-grad-norm", type=float, metavar="NORM", help="clip the gradients' global norm to NORM")
    train.add_argument("--accumulate", type=at_least(1, MAX_RUNS), default=1, metavar="K",
                       help="add K micro-batches' gradients before each optimizer step, planned for (default: 1)")
    train.add_argument("--progress-timeout", type=float, metavar="SECONDS",
                       help="--plan pipeline.json, --dp: stop the run when no step has finished for this long (each "
                            "rank's setup milestones count; under torchrun: how long a collective waits; default: 300)")

    demo = commands.add_parser("demo", help="profile, solve, show and train the built-in gpt-tiny at half its memory",
                               description="On the built-in gpt-tiny: profile it, solve at 50%% of the store-all peak "
                                           "with rotor, show the schedule and memory timeline, train a few steps and "
                                           "compare predicted with measured.")
    demo.add_argument("--plot", metavar="timeline.png", help="also save the memory timeline as a PNG")
    demo.add_argument("--steps", type=at_least(1, MAX_RUNS), default=3, metavar="N",
                      help="training steps (default: 3)")

    solve = commands.add_parser("solve", help="find a schedule that fits a memory budget",
                                description="Find the fastest schedule of a chain or a graph within a memory budget.")
    solve.add_argument("chain", metavar="PROBLEM.json",
                       help="chain (memsched.chain/1) or graph (memsched.graph/1) problem")
    solve.add_argument("--budget", required=True, metavar="B",
                       help="memory budget: bytes (123456789), a unit (4GiB, 512MB), a percentage of the "
                            "store-all peak (50%%), or auto: what --device-memory leaves beside parameters, "
                            "gradients and optimizer state (chains)")
    add_setup_arguments(solve)
    solve.add_argument("--solver", default="auto", metavar="NAME",
                       help=f"one of {', '.join(solvers.SOLVER_NAMES)} for a chain, "
                            f"{', '.join(GRAPH_SOLVER_NAMES)} for a graph (default: auto)")
    solve.add_argument("--time-limit", type=float, metavar="SECONDS",
                       help="graph solvers and offload: stop the search after this long and keep the best schedule "
                            "found")
    solve.add_argument("--max-computations", type=at_least(1, MAX_COMPUTATIONS), metavar="N",
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
    add_channel_arguments(solve, "pofo, the offload solvers and --offload-weights: the copy channel (default: the "
                                  "chain's)")
    solve.add_argument("--offload-weights", metavar="all|I,J,...",
                       help="keep these stages' parameters on the host, brought in around each of their operations "
                            "(their gradients go to the host after their backward), with any solver")
    solve.add_argument("--schedule", choices=("store_all", "rotor"),
                       help="offload, offload_greedy, offload_all: the compute schedule whose activations are "
                            "offloaded (default: store_all)")
    solve.add_argument("--slots", type=at_least(1), metavar="N", help="rotor, pofo: memory discretisation slots")
    solve.add_argument("--segments", type=at_least(1, validate.MAX_INDEX), metavar="N",
                       help="sqrt: number of segments")
    solve.add_argument("--snapshots", type=at_least(1, validate.MAX_INDEX), metavar="N",
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
    pareto.add_argument("--points", type=at_least(2, MAX_POINTS), default=12, metavar="N",
                        help="number of evenly spaced budgets (default: 12)")
    pareto.add_argument("--slots", type=at_least(1), metavar="N", help="rotor: memory discretisation slots")
    add_channel_arguments(pareto, "add pofo's and offload_greedy's curves over this copy channel (default: the "
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
    plan.add_argument("--batch", type=lambda text: text if text == "auto" else at_least(1)(text), metavar="N|auto",
                      help="SPEC: batch size; auto (with --device-spec): of 1, 2, 4..., the most samples/s")
    plan.add_argument("--device-spec", metavar="NAME|FILE", help=f"SPEC: the target device: {', '.join(DEVICES)}, "
                                                                 "cpu (this one, measured) or a memsched.device/1 file")
    plan.add_argument("--global-batch", type=at_least(1), metavar="N", help="--device-spec: samples per optimizer "
                                                                             "step, micro-batches accumulated")
    plan.add_argument("--budget", default="auto", metavar="auto|B",
                      help="--device-spec: the step's budget: auto (what the device leaves) or bytes (4GiB), or %%")
    add_autocast_argument(plan)
    add_setup_arguments(plan)

    partition = commands.add_parser("partition", help="split a chain across pipeline devices (1F1B or GPipe)",
                                    description="The fastest contiguous split of a chain onto --devices pipeline "
                                                "devices of --device-memory each, with each device's checkpoint "
                                                "schedule, for --micro-batches per iteration (plan kind pipeline).")
    partition.add_argument("chain", metavar="CHAIN.json", help="chain problem profiled at the micro-batch size")
    partition.add_argument("--devices", type=at_least(1), required=True, metavar="P", help="pipeline devices")
    partition.add_argument("--micro-batches", type=at_least(1), required=True, metavar="M",
                           help="micro-batches per iteration")
    partition.add_argument("--pipeline-schedule", choices=("1f1b", "gpipe"), default="1f1b",
                           help="1F1B holds P - s micro-batches on device s, GPipe all M (default: 1f1b)")
    partition.add_argument("--bandwidth", metavar="RATE",
                           help="device-to-device bandwidth for the boundary activations and gradients (default: free)")
    partition.add_argument("--latency", type=float, metavar="SECONDS", help="fixed seconds per transfer (default: 0)")
    partition.add_argument("--slots", type=at_least(1), metavar="N", help="rotor: memory discretisation slots")
    add_setup_arguments(partition)
    partition.add_argument("-o", "--output", metavar="PLAN.json", help="write the plan here (memsched.plan/1)")
    return parser
