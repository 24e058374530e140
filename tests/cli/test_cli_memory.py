"""`memsched memory` and `--budget auto`: the per-device breakdown, the budget it leaves, and one-line errors."""

import pytest

import cli
import solvers
from checks import one_error_line, run
from paths import EXAMPLE
from planner import load_chain, load_plan, save_chain
from planner.setup.account import activation_budget
from planner.setup.training import TrainingSetup, parameters_of
from planner.sharding import rank_residents
from profiles.synthetic import random_chain

SMALL = "gpt-tiny:layers=1,d=32,heads=2,seq=16,vocab=64,batch=4"



def row(out, label):
    """The numbers of a breakdown row: (bytes per parameter, bytes)."""
    line = next(line for line in out.splitlines() if line.startswith(label))
    fields = line[len(label):].split()
    return (float(fields[0]), int(fields[1])) if label not in ("resident", "with gradients") else int(fields[0])


def test_memory_of_a_chain_profile(capsys):
    status, out, err = run(capsys, "memory", EXAMPLE, "--optimizer", "adam", "--precision", "bf16", "--zero", "1",
                           "--device-memory", "2GiB")
    assert status == 0, err
    chain = load_chain(EXAMPLE)
    parameters = parameters_of(chain)
    assert f"{parameters} trainable parameters" in out
    setup = TrainingSetup("adam", "bf16", 1, 1)  # (ZeRO over one rank: nothing sharded)
    sizes = setup.breakdown(parameters)
    assert row(out, "parameters") == (2, sizes["params"])
    assert row(out, "gradients") == (2, sizes["grads"])
    assert row(out, "fp32 master copy") == (4, sizes["master"])
    assert row(out, "optimizer state") == (8, sizes["optimizer"])
    assert row(out, "resident") == setup.resident_bytes(parameters) == sizes["params"] + sizes["master"] + \
        sizes["optimizer"]
    assert row(out, "with gradients") == setup.resident_bytes(parameters) + sizes["grads"]
    budget = activation_budget(chain, setup, 2 * 2**30)
    assert budget == 2 * 2**30 - setup.resident_bytes(parameters)
    assert f"budget     {budget} bytes" in out
    assert "fits without recomputation" in out
    # Sharded over 8 ranks, a chain needs its parameters' rows (this one predates them): refused in one line.
    line = one_error_line(*run(capsys, "memory", EXAMPLE, "--zero", "2", "--dp", "8", "--device-memory", "2GiB"))
    assert "records no parameter layout" in line and "profile the model again" in line


def test_memory_of_a_builtin_spec_counts_its_module_parameters(capsys):
    import torch

    from planner.execute.records import parameter_layout
    from planner.execute.stages import named_stages
    from profiles.spec import load_model

    model, _ = load_model(SMALL)
    parameters = sum({id(p): p.numel() for _, module in model.stages if isinstance(module, torch.nn.Module)
                      for p in module.parameters() if p.requires_grad}.values())
    status, out, err = run(capsys, "memory", SMALL, "--optimizer", "adam", "--precision", "bf16", "--zero", "2",
                           "--dp", "8", "--device-memory", "80GiB")
    assert status == 0, err
    assert f"gpt-tiny: {parameters} trainable parameters (counted from its modules)" in out
    # sharded: the largest rank's padded shards of the live parameters, their master copy and Adam state (ZeRO 2 on
    # FSDP2 keeps shards between steps and all-gathers the whole parameters inside the step's budget)
    rows = parameter_layout(named_stages(model.stages))
    resident = max(rank_residents(2, 8, rows, TrainingSetup("adam", "bf16", 2, 8).per_parameter_byte()))
    assert row(out, "resident") == resident
    assert f"budget     {80 * 2**30 - resident} bytes" in out
    # Without --device-memory: the breakdown alone (the model is not profiled).
    status, out, err = run(capsys, "memory", SMALL)
    assert status == 0, err
    assert row(out, "resident") == 12 * parameters and "give --device-memory" in out and "budget     " not in out


def test_solve_budget_auto_solves_within_what_the_device_leaves(capsys, tmp_path):
    out_plan = tmp_path / "plan.json"
    status, out, err = run(capsys, "solve", EXAMPLE, "--budget", "auto", "--device-memory", "700MiB",
                           "--precision", "bf16", "-o", out_plan)
    assert status == 0, err
    chain = load_chain(EXAMPLE)
    setup = TrainingSetup("adam", "bf16")
    budget = activation_budget(chain, setup, 700 * 2**20)
    assert budget == 700 * 2**20 - setup.resident_bytes(parameters_of(chain))
    assert out.splitlines()[0].startswith("budget auto: device 734003200 bytes")
    assert f"resident {setup.resident_bytes(parameters_of(chain))} bytes" in out
    plan = load_plan(out_plan)
    assert plan.budget_bytes == budget and plan.predicted.peak_bytes <= budget
    # The defaults: fp32 Adam on one device (12 bytes per parameter resident).
    status, out, err = run(capsys, "solve", EXAMPLE, "--budget", "auto", "--device-memory", "1GiB")
    assert status == 0, err
    assert f"budget     {activation_budget(chain, TrainingSetup(), 2**30)} bytes" in out


@pytest.mark.parametrize("argv, words", [
    (["--budget", "auto"], ["--device-memory"]),
    (["--budget", "50%", "--device-memory", "1GiB"], ["--device-memory", "--budget auto"]),
    (["--budget", "50%", "--zero", "2"], ["--zero", "--budget auto"]),
    (["--budget", "auto", "--device-memory", "1GiB", "--optimizer", "lamb"], ["optimizer", "adam8bit"]),
    (["--budget", "auto", "--device-memory", "1GiB", "--precision", "int8"], ["precision", "bf16"]),
    (["--budget", "auto", "--device-memory", "1GiB", "--zero", "4"], ["zero", "0, 1, 2 or 3"]),
    (["--budget", "auto", "--device-memory", "1GiB", "--dp", "0"], ["dp", "from 1 to 262144"]),
    (["--budget", "auto", "--device-memory", "lots"], ["--device-memory", "'lots'"]),
    (["--budget", "auto", "--device-memory", "200MiB"], ["no memory left", "225557772", "209715200"]),
    (["--budget", "auto", "--device-memory", "300MiB"], ["--budget auto leaves", "minimum feasible 211937666"]),
])
def test_budget_auto_errors_are_one_line(capsys, argv, words):
    line = one_error_line(*run(capsys, "solve", EXAMPLE, *argv))
    assert all(word in line for word in words), line


def test_memory_errors_are_one_line(capsys, tmp_path):
    line = one_error_line(*run(capsys, "memory", EXAMPLE, "--zero", "5"))
    assert "zero" in line
    line = one_error_line(*run(capsys, "memory", EXAMPLE, "--device-memory", "100MiB"))
    assert "no memory left" in line
    line = one_error_line(*run(capsys, "memory", str(tmp_path / "missing.json")))
    assert "missing.json" in line


def test_budget_auto_is_for_chains_and_not_with_a_ready_plan(capsys, tmp_path):
    chain = random_chain(4, seed=1, tmp=True, params=True)
    save_chain(chain, tmp_path / "chain.json")
    status, _, err = run(capsys, "solve", tmp_path / "chain.json", "--budget", "auto", "--device-memory", "1GiB",
                         "--solver", "rotor", "-o", tmp_path / "plan.json")
    assert status == 0, err
    line = one_error_line(*run(capsys, "train", SMALL, "--plan", tmp_path / "plan.json", "--budget", "auto",
                               "--device-memory", "1GiB"))
    assert "--plan" in line
    assert solvers.store_all_peak(chain) > 0


def test_budget_auto_is_refused_for_graphs(capsys, tmp_path):
    from planner.graph import save_graph
    from profiles.synthetic import random_graph

    save_graph(random_graph(5, 14, shape="transformer", scale_bytes=10**6), tmp_path / "graph.json")
    line = one_error_line(*run(capsys, "solve", tmp_path / "graph.json", "--budget", "auto", "--device-memory", "1GiB"))
    assert "--budget auto is for chain problems" in line
    line = one_error_line(*run(capsys, "solve", tmp_path / "graph.json", "--budget", "50%", "--zero", "1"))
    assert "--zero" in line


def test_train_budget_auto(capsys, tmp_path):
    """train --budget auto: Adam in fp32 on one device (what train runs), from --device-memory."""
    chain_path = tmp_path / "small.chain.json"
    assert cli.main(["profile", SMALL, "--estimate", "-o", str(chain_path)]) == 0
    chain = load_chain(chain_path)
    capsys.readouterr()
    budget = activation_budget(chain, TrainingSetup(), 2**30)
    status, out, err = run(capsys, "train", SMALL, "--chain", chain_path, "--budget", "auto", "--device-memory", "1GiB",
                           "--steps", "1")
    assert status == 0, err
    assert out.startswith("budget auto: device 1073741824 bytes") and f"budget     {budget} bytes" in out
    status, out, err = run(capsys, "train", SMALL, "--chain", chain_path, "--budget", "auto", "--device-memory",
                           "1GiB", "--optimizer", "sgd")
    assert status == 2 and "unrecognized arguments: --optimizer sgd" in err  # train runs fp32 Adam
    status, out, err = run(capsys, "train", SMALL, "--chain", chain_path, "--budget", "auto", "--device-memory",
                           "1GiB", "--zero", "2")
    assert status == 2 and "one rank's step" in err and "drop --chain" in err  # --zero: over --dp ranks
