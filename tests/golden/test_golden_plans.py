"""Golden plans: ``memsched solve`` under each training setup, compared with the plan JSON it wrote at commit
c24f920 (this folder, made by ``python tests/golden/test_golden_plans.py``), so that moving where the setup is lowered
cannot change a plan. Only the solver's wall-clock seconds, and the plan's check that covers them, are left out of
the comparison.

The chain (tests/golden/chain.json) is Hugging-Face-free and deterministic: ``memsched profile
gpt-tiny:layers=4,d=64,heads=2,seq=32,vocab=128,batch=4 --estimate`` (sizes from fake tensors, times from FLOPs),
with stage options, and a tied parameter (16 KiB read by stages 0 and 5) added by hand. The ZeRO plans are
solved on chain-layout.json, the same chain with a parameter layout (a sharded step needs one), and were
rewritten when the sharded step became a lowering of the chain (before, ZeRO 2 and 3 only shrank the resident
state, the step was the unsharded chain's: no all-gathers counted).
"""

import json
import pathlib
import sys

import pytest

import cli

GOLDEN = pathlib.Path(__file__).parent
CHAIN = GOLDEN / "chain.json"
# The same chain with its parameters' rows (rows of 256 bytes; the tied parameter shared), which a sharded step
# needs: the ZeRO plans below were written on it when the sharded step became a lowering (they changed then).
LAID_OUT = GOLDEN / "chain-layout.json"


def device(memory: str) -> list:
    return ["--budget", "auto", "--device-memory", memory]


CHANNEL = ["--bandwidth", "1GB/s"]

CASES = {
    "after": ["--budget", "60%"],
    "after-rotor": ["--budget", "60%", "--solver", "rotor"],
    "in-backward": ["--budget", "60%", "--update", "in-backward"],
    "on-host": ["--budget", "60%", "--update", "on-host", *CHANNEL],
    "update-auto": [*device("3.6MiB"), "--update", "auto", *CHANNEL],  # in-backward
    "update-auto-host-stages": [*device("2.8MiB"), "--update", "auto", *CHANNEL],  # on-host, 2 of 6 stages
    "host-weights": ["--budget", "80%", "--offload-weights", "1,3", *CHANNEL],
    "device-fp32": device("4.5MiB"),
    "bf16": [*device("4.6MiB"), "--precision", "bf16"],
    "zero2-dp2": [*device("3.6MiB"), "--zero", "2", "--dp", "2"],
    "zero3-dp2": [*device("3.2MiB"), "--zero", "3", "--dp", "2", "--optimizer", "adamw"],
    "pofo": ["--budget", "70%", "--solver", "pofo", *CHANNEL],
}


def solved(case: str, directory: pathlib.Path) -> dict:
    """The plan ``memsched solve`` writes for ``case``, less the solver's seconds."""
    output = directory / f"{case}.json"
    chain = LAID_OUT if case.startswith("zero") else CHAIN
    assert cli.main(["solve", str(chain), *CASES[case], "-o", str(output)]) == 0
    plan = json.loads(output.read_text())
    del plan["solver"]["solve_seconds"], plan["check"]  # the check covers the seconds: it differs with them
    return plan


# What a plan records of its setup's sizing since the setup became one value (planner/setup/), an additive key
# written only when it is not the default's: the rest of each plan is the golden one.
SIZING = {"bf16": {"optimizer": "adam", "precision": "bf16", "zero": 0, "dp": 1},
          "zero2-dp2": {"optimizer": "adam", "precision": "fp32", "zero": 2, "dp": 2},
          "zero3-dp2": {"optimizer": "adamw", "precision": "fp32", "zero": 3, "dp": 2}}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_plan_is_the_golden_one(case, tmp_path, capsys):
    golden = json.loads((GOLDEN / f"{case}.plan.json").read_text())
    plan = solved(case, tmp_path)
    assert plan.pop("setup", None) == SIZING.get(case)
    assert plan == golden


if __name__ == "__main__":  # regenerate (only for a deliberate change, stated in its commit)
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        for name in (sys.argv[1:] or CASES):
            plan = solved(name, pathlib.Path(scratch))
            plan.pop("setup", None)  # checked against SIZING
            (GOLDEN / f"{name}.plan.json").write_text(json.dumps(plan, indent=1) + "\n")
