"""`memsched train` and `memsched demo`: measured against predicted, and clear errors before any training."""

import pytest
import torch

from checks import one_error_line, run
from planner import load_chain, load_plan

SMALL = "gpt-tiny:layers=3,d=32,heads=2,seq=16,vocab=64,batch=4"



def measured_rows(out):
    """The per-step rows of the training table: (measured/predicted ratio, measured/budget ratio)."""
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit() and "MiB" in line or "KiB" in line]
    return [(float(row[-4]), float(row[-3])) for row in rows if len(row) >= 8 and row[0].isdigit()]


def test_demo_trains_gpt_tiny_at_half_its_memory(capsys, tmp_path):
    status, out, _ = run(capsys, "demo", "--steps", "2", "--plot", str(tmp_path / "demo.png"))
    assert status == 0
    assert "rotor" in out and "schedule:" in out and "budget" in out and "with the plan:" in out
    rows = measured_rows(out)
    assert len(rows) == 2
    assert all(abs(ratio - 1) <= 0.05 and within <= 1.05 for ratio, within in rows)
    assert (tmp_path / "demo.png").read_bytes().startswith(b"\x89PNG")


def test_train_profiles_solves_and_reports(capsys):
    status, out, _ = run(capsys, "train", SMALL, "--budget", "60%", "--steps", "2")
    assert status == 0
    rows = measured_rows(out)
    assert len(rows) == 2 and all(abs(ratio - 1) <= 0.05 for ratio, _ in rows)
    assert "unmodified model: peak" in out and "less memory" in out


def test_train_by_a_saved_plan_and_chain(capsys, tmp_path):
    chain, plan = tmp_path / "chain.json", tmp_path / "plan.json"
    assert run(capsys, "profile", SMALL, "-o", str(chain), "--warmup", "0", "--repeats", "1")[0] == 0
    assert run(capsys, "solve", str(chain), "--budget", "70%", "-o", str(plan))[0] == 0
    status, out, _ = run(capsys, "train", SMALL, "--plan", str(plan), "--chain", str(chain), "--steps", "1")
    assert status == 0
    assert load_plan(plan).fingerprint == load_chain(chain).fingerprint()
    assert len(measured_rows(out)) == 1


def test_errors_come_before_any_training(capsys, tmp_path):
    chain, plan, other = tmp_path / "chain.json", tmp_path / "plan.json", tmp_path / "other.json"
    run(capsys, "profile", SMALL, "-o", str(chain), "--warmup", "0", "--repeats", "1")
    run(capsys, "profile", "mlp:layers=4,width=16,batch=8", "-o", str(other), "--warmup", "0", "--repeats", "1")
    assert run(capsys, "solve", str(other), "--budget", "100%", "-o", str(plan))[0] == 0
    line = one_error_line(*run(capsys, "train", SMALL, "--plan", str(plan), "--chain", str(chain)))
    assert "solved for chain" in line
    line = one_error_line(*run(capsys, "train", SMALL, "--plan", str(plan)))
    assert "stages" in line
    line = one_error_line(*run(capsys, "train", SMALL, "--chain", str(chain), "--budget", "1%"))
    assert "below the minimum feasible" in line
    line = one_error_line(*run(capsys, "train", SMALL, "--chain", str(chain)))
    assert "--budget" in line
    broken = tmp_path / "broken.json"
    broken.write_text('{"format": "memsched.plan/9", "kind": "chain"}')
    line = one_error_line(*run(capsys, "train", SMALL, "--plan", str(broken)))
    assert "memsched.plan/1" in line
    if not torch.cuda.is_available():
        line = one_error_line(*run(capsys, "train", SMALL, "--chain", str(chain), "--budget", "90%",
                                   "--device", "cuda"))
        assert "CUDA is not available" in line


@pytest.mark.parametrize("argv", [["train"], ["train", SMALL, "--steps", "0"], ["demo", "--steps", "x"]])
def test_usage_errors(capsys, argv):
    assert run(capsys, *argv)[0] == 2
