"""Sharded data-parallel benchmark: the least memory per rank of FSDP2 over 2 ranks against one device's.

    python bench/data_parallel.py [MODEL ...] [--steps N]

For each model (default: ``gpt2``, the Hugging Face GPT-2 of examples/gpt2_factory.py, tied embeddings kept whole;
``resnet-like``, resnet-tiny as wide as ResNet-18's deep layers at a small image), in one run:

* ``one device``: the whole batch on one device with Adam, updating after the backward (today's floor) or in
  it (planner/updates.py): resident parameters and state plus the least step budget (hierarchical solver);
* ``ZeRO 1``, ``ZeRO 2``, ``ZeRO 3``: each of 2 ranks with half the batch, on ``ZeroRedundancyOptimizer`` (1) or
  ``fully_shard`` (planner/sharding.py): the largest rank's resident parameters and state, ZeRO 2's whole
  parameters, plus its step storing every activation (plain ZeRO / FSDP2 with each stage a unit, what a user runs
  without memsched) or within its least budget (memsched's floor); each trained there on 2 processes (gloo),
  with the measured peak of each rank over the prediction, and the seconds of a rank's step against one device's
  planned step at its own floor (the same whole batch in one process) and against the store-all step's.
"""

import argparse
import functools
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import solvers  # noqa: E402
from planner.execute.data_parallel import run_data_parallel  # noqa: E402
from planner.setup import lower  # noqa: E402
from planner.setup.training import TrainingSetup, resident_on_device  # noqa: E402
from profiles.chain_profiler import profile_chain  # noqa: E402
from profiles.memory import memory_meter  # noqa: E402
from profiles.options import DEFAULT_OPTIONS  # noqa: E402
from profiles.spec import built_model  # noqa: E402
from profiles.training import train_chain_plan  # noqa: E402
from solvers.budgets import least_budget, whole_step_floors  # noqa: E402

MIB = 2**20
MODELS = {"gpt2": "examples/gpt2_factory.py:build", "resnet-like": "resnet-tiny:channels=128,size=16"}
BATCH = 8


def rows(name: str, steps: int) -> list:
    spec = MODELS[name]
    whole = built_model(spec, batch=BATCH)
    chain = profile_chain(whole.stages, whole.example_inputs, loss_fn=whole.loss_fn, name=name,
                          options=DEFAULT_OPTIONS)
    floors = {floor.update: floor for floor in whole_step_floors(chain, TrainingSetup("adam"))}
    today = floors["after"]
    plan = solvers.solve(chain, today.step, "hierarchical")
    single = statistics.median(m.seconds for m in train_chain_plan(whole, plan, chain, steps).planned)
    lines = [f"{name}: batch {BATCH}, Adam fp32",
             f"  one device   after        floor {today.total / MIB:8.2f} MiB, step {single:.4f} s",
             f"  one device   in-backward  floor {floors['in-backward'].total / MIB:8.2f} MiB "
             f"({1 - floors['in-backward'].total / today.total:6.1%} lower)"]
    del whole
    part = built_model(spec, batch=BATCH, part=(0, 2))
    rank_chain = profile_chain(part.stages, part.example_inputs, loss_fn=part.loss_fn, name=name, options=0)
    for zero in (1, 2, 3):
        setup = TrainingSetup(zero=zero, dp=2)
        resident, lowered = resident_on_device(rank_chain, setup), lower(rank_chain, setup)  # one rank's step
        plain = None
        for what, step in (("store-all", solvers.store_all_peak(lowered.chain) + lowered.held_bytes),
                           ("least", least_budget(rank_chain, setup, "rotor"))):
            plan = solvers.solve(rank_chain, step, "rotor", setup)
            predicted = plan.predicted.peak_bytes
            results = run_data_parallel(functools.partial(built_model, spec, batch=BATCH), plan, zero, 2, steps,
                                        meter=memory_meter, predicted=predicted, chain=rank_chain)
            floor = resident + step
            worst = max(abs(r.measured / predicted - 1) for r in results)
            seconds = statistics.median(s for r in results for s in r.seconds[1:] or r.seconds)
            plain = plain or seconds
            lines.append(f"  2 ranks      ZeRO {zero} {what:<9} {floor / MIB:8.2f} MiB per rank "
                         f"({1 - floor / today.total:6.1%} lower; resident {resident / MIB:6.2f} + step "
                         f"{step / MIB:6.2f}), measured/predicted peak within {worst:.4%}, "
                         f"step {seconds:.4f} s ({seconds / single:.2f}x one device's, {seconds / plain:.2f}x "
                         "store-all's)")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", metavar="MODEL", help="gpt2, resnet-like (default: both)")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    for name in args.models or list(MODELS):
        print("\n".join(rows(name, args.steps)))


if __name__ == "__main__":
    main()
