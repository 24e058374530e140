"""Whole-step benchmark: the least memory of a training step with Adam, by when the optimizer updates.

    python bench/whole_step.py [MODEL ...] [--steps N] [--bandwidth RATE]

For each model (default: ``gpt2``, Hugging Face's GPT-2 with tied embeddings cut by discovery; ``resnet-like``,
resnet-tiny as wide as ResNet-18's deep layers at a small image, where weights weigh as much as activations;
``resnet-tiny``, activations first), profiled once with its stage options, in one run and per update
(planner/updates.py):

* ``after``: today's step, ``optimizer.step()`` after the backward: gradients live to the end of the step;
* ``in-backward``: each stage's parameters updated, and its gradients freed, right after its backward;
* ``on-host``: the same with gradients, optimizer state and update on the host (ZeRO-Offload), over
  ``--bandwidth`` (a CPU has no device-host channel: the copies are memcpy here, their predicted time that of
  the channel given).

Each row: the floor (resident parameters and optimizer state on the device plus the least step budget, the
hierarchical solver's), how much lower than today's, the measured whole-step peak (the live-memory tracker's
step peak plus the measured storages of parameters and device optimizer state) over the predicted floor, and
the step time (forward, backward and update) over the unmodified step's at full memory, medians of ``--steps``
steps measured alternately with it (profiles/training.py); for the updates in the backward, also at the whole-step
memory of today's floor (their plan within it less their resident state: less recomputation).
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from planner.setup.training import TrainingSetup, parameters_of  # noqa: E402
from planner.transfer import Transfer  # noqa: E402
from planner.units import parse_bandwidth  # noqa: E402
from planner.updates import UPDATES  # noqa: E402
from profiles.chain_profiler import profile_chain  # noqa: E402
from profiles.options import DEFAULT_OPTIONS  # noqa: E402
from profiles.training import train_chain_plan  # noqa: E402
from profiles.zoo import MODELS  # noqa: E402
from solvers import solve  # noqa: E402
from solvers.budgets import whole_step_floors  # noqa: E402

MIB = 2**20
SPECS = {"resnet-like": dict(channels=128, size=16, batch=4), "resnet-tiny": {}}


def staged(name):
    """The staged model ``name`` names (see the module's docstring): GPT-2 as bench/compile_budget.py cuts it."""
    if name == "gpt2":
        from compile_budget import staged as budget_bench_model  # bench/ is the script's folder

        return budget_bench_model("gpt2")
    return MODELS["resnet-tiny"](**SPECS[name])


def rows(name: str, steps: int, channel: Transfer) -> list:
    model = staged(name)
    chain = profile_chain(model.stages, model.example_inputs, loss_fn=model.loss_fn, name=name,
                          options=DEFAULT_OPTIONS, transfer=channel)
    parameters = parameters_of(chain)
    floors = {floor.update: floor for floor in whole_step_floors(chain, TrainingSetup("adam"))}
    today = floors["after"].total
    lines = [f"{name}: {parameters} parameters, Adam fp32; {len(chain.stages)} stages"]
    for update in UPDATES:
        floor = floors[update]
        measured, ratio, plan = measure(model, chain, floor.step, update, steps)
        line = (f"  {update:<12} floor {floor.total / MIB:8.2f} MiB ({1 - floor.total / today:6.1%} lower; resident "
                f"{floor.resident / MIB:6.2f} + step {floor.step / MIB:6.2f}), measured/predicted peak "
                f"{measured / (plan.predicted.peak_bytes + floor.resident):.4f}, step time {ratio:.3f} "
                f"(predicted overhead {plan.predicted.overhead:+.1%})")
        if update != "after":  # the same whole-step memory as today's floor: less recomputation
            _, same, plan = measure(model, chain, today - floor.resident, update, steps)
            line += f"; at today's floor {same:.3f} ({plan.predicted.overhead:+.1%})"
        lines.append(line)
    return lines


def measure(model, chain, budget: int, update: str, steps: int) -> tuple:
    """``(measured whole-step peak, step time over the unmodified step's, plan)`` of the hierarchical plan of
    ``chain`` within ``budget`` for ``update``."""
    plan = solve(chain, budget, "hierarchical", TrainingSetup(update=update))
    compared = train_chain_plan(model, plan, chain, steps, whole_step=True)
    measured = max(m.peak_bytes for m in compared.planned) + compared.resident_bytes
    seconds = [statistics.median(m.seconds for m in measures) for measures in (compared.planned, compared.plain)]
    return measured, seconds[0] / seconds[1], plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", metavar="MODEL", help="gpt2, resnet-like, resnet-tiny (default: all)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--bandwidth", default="12GB/s", help="the device-host channel on-host is planned over")
    args = parser.parse_args()
    bandwidth = parse_bandwidth(args.bandwidth)
    channel = Transfer(d2h_bandwidth=bandwidth, h2d_bandwidth=bandwidth, latency=1e-5)
    print(f"{torch.get_num_threads()} threads; on-host over {args.bandwidth}, 10 us per copy")
    for name in args.models or ["gpt2", *SPECS]:
        print("\n".join(rows(name, args.steps, channel)))


if __name__ == "__main__":
    main()
