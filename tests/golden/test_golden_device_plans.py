"""Golden device plans: ``memsched plan SPEC --device-spec NAME`` for two specs (a micro-batch given, and
``--batch auto`` under another setup) and ``fit(..., device_spec=, batch="auto")``, compared with what they printed
and planned when this file was written (this folder, made by ``PYTHONPATH=tests python
tests/golden/test_golden_device_plans.py``),
so that redesigning how a job is put together (issue 39's ``Job``) cannot change a figure unnoticed. Everything
compared is estimated on fake tensors (the built-in ``gpt-tiny``, the tests' tiny Hugging Face GPT-2): sizes exact,
times from the specs' rates, nothing measured, so it is the same on any machine.
"""

import json
import pathlib
import sys

import pytest

import cli
from paths import load_fixture
from planner import fit

GOLDEN = pathlib.Path(__file__).parent
SPEC = "gpt-tiny:layers=4,d=64,heads=2,seq=32,vocab=128"
CASES = {
    "h100-batch8": ["plan", SPEC, "--device-spec", "h100-80gb", "--batch", "8"],
    "h100-auto": ["plan", SPEC, "--device-spec", "h100-80gb", "--batch", "auto", "--global-batch", "256"],
    "l4-auto-bf16-adamw": ["plan", SPEC, "--device-spec", "l4", "--batch", "auto", "--precision", "bf16",
                           "--optimizer", "adamw", "--global-batch", "64"],
}


def printed(case: str, capsys) -> str:
    """What ``memsched`` prints for ``case``."""
    capsys.readouterr()
    assert cli.main(CASES[case]) == 0
    return capsys.readouterr().out


def fitted_plan() -> dict:
    """``fit`` of the tests' Hugging Face GPT-2 (tests/fixtures/hf_gpt2.py) for an A100 40GB at ``batch="auto"``
    within a global batch of 16 (the search stops there: each size is an estimate), one candidate per stage (and
    the selective-checkpoint policies beside it):
    its searched table and its plan, less the solver's seconds."""
    model, batch = load_fixture("hf_gpt2").build()
    fitted = fit(model, batch, "auto", device_spec="a100-40gb", batch="auto", global_batch=16, progress=False,
                 stage_options=1)
    plan = fitted.plan.to_dict()
    del plan["solver"]["solve_seconds"], plan["check"]
    searched = [[c.batch, c.accumulate, c.peak, c.seconds] for c in fitted.searched]
    return {"micro_batch": fitted.micro_batch, "searched": searched, "plan": plan}


@pytest.mark.parametrize("case", sorted(CASES))
def test_memsched_plan_prints_the_golden_table(case, capsys):
    assert printed(case, capsys) == (GOLDEN / f"{case}.txt").read_text()


def test_fit_for_a_device_plans_the_golden_plan():
    assert json.loads(json.dumps(fitted_plan())) == json.loads((GOLDEN / "fit-a100-auto.json").read_text())


if __name__ == "__main__":  # regenerate (only for a deliberate change, stated in its commit)
    import contextlib
    import io

    for name in (sys.argv[1:] or CASES):
        with contextlib.redirect_stdout(io.StringIO()) as text:
            cli.main(CASES[name])
        (GOLDEN / f"{name}.txt").write_text(text.getvalue())
    (GOLDEN / "fit-a100-auto.json").write_text(json.dumps(fitted_plan(), indent=1) + "\n")
