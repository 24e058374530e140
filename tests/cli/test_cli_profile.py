"""``memsched profile``, run in-process through cli.main: built-in models and user factories into chains the
planner reads, estimates that match measurements to the byte, and every bad input refused with one line."""

import json
import subprocess
import sys

import pytest
import torch

import cli
from checks import one_error_line
from paths import FIXTURES, ROOT
from planner import load_chain

FIXTURE = FIXTURES / "masked_model.py"
QUICK = ["--warmup", "0", "--repeats", "1"]
MLP = "mlp:layers=3,width=32,batch=8"
GPT = "gpt-tiny:layers=1,d=32,heads=2,seq=8,vocab=64,batch=2"
SIZE_FIELDS = ("out_bytes", "saved_bytes", "fwd_tmp_bytes", "bwd_tmp_bytes", "param_bytes")

# User factories that go wrong in every way the profiler has to report (written into a temporary file).
FACTORIES = '''
import torch
from torch import nn


def raises():
    raise ValueError("the factory broke\\non two lines")


def single_module():
    return nn.Linear(4, 4)


def four_tuple():
    return [nn.Linear(4, 4)], (torch.randn(2, 4),), None, 1


def wrong_width():
    return [("first", nn.Linear(4, 8)), ("second", nn.Linear(5, 3))], (torch.randn(2, 4),)


def non_scalar_loss():
    return nn.Sequential(nn.Linear(4, 4)), (torch.randn(2, 4),), lambda out: out * 2


def no_batch():
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU()), torch.randn(2, 4)


def plain_module_as_stages():
    return nn.Linear(4, 4), torch.randn(2, 4)
'''


@pytest.fixture(scope="module")
def factories(tmp_path_factory):
    folder = tmp_path_factory.mktemp("factories")
    (folder / "factories.py").write_text(FACTORIES)
    (folder / "broken_import.py").write_text("import torch\nraise RuntimeError('broken at import')\n")
    return folder


def profile(capsys, spec, out, *options):
    """Run ``memsched profile``; return (exit status, stdout, stderr)."""
    status = cli.main(["profile", str(spec), "-o", str(out), *QUICK, *options])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def sizes(chain):
    """Every byte count of a chain: input, loss transient, and per stage (name, sizes...)."""
    return (chain.input_bytes, chain.loss.tmp_bytes,
            [(s.name, *(getattr(s, field) for field in SIZE_FIELDS)) for s in chain.stages])


def test_profile_writes_a_chain_that_solve_accepts(tmp_path, capsys):
    out = tmp_path / "chain.json"
    status, stdout, stderr = profile(capsys, MLP, out)
    assert status == 0, stderr
    chain = load_chain(out)
    assert [s.name for s in chain.stages] == ["layer0", "layer1", "layer2"]
    assert chain.name == "mlp" and chain.device == "cpu"
    assert chain.input_bytes == 8 * 32 * 4
    assert all(s.out_bytes == 8 * 32 * 4 and s.param_bytes == (32 * 32 + 32) * 4 for s in chain.stages)
    assert all(s.fwd_time > 0 and s.bwd_time > 0 for s in chain.stages)
    header = stdout.splitlines()[0]
    for column in ("stage", "fwd ms", "bwd ms", "out", "saved", "fwd tmp", "bwd tmp", "params"):
        assert column in header
    assert [line.split()[0] for line in stdout.splitlines()[1:5]] == ["layer0", "layer1", "layer2", "loss"]
    assert f"chain written to {out}" in stdout

    # 50% of the three-layer chain is below its minimum feasible budget (tiny activations, a loss transient as large):
    # solve a longer, narrow one (its minimum is about 37% of its store-all peak).
    long = tmp_path / "long.json"
    assert profile(capsys, "mlp:layers=16,width=8,batch=64", long)[0] == 0
    assert cli.main(["solve", str(long), "--budget", "50%", "-o", str(tmp_path / "plan.json")]) == 0
    assert "plan written to" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("spec, throughput", [(MLP, ["--throughput", "1e9"]), (GPT, []), (FIXTURE, [])],
                         ids=["mlp", "gpt-tiny", "masked-factory"])
def test_estimate_sizes_equal_the_measured_ones_to_the_byte(tmp_path, capsys, spec, throughput):
    measured, estimated = tmp_path / "measured.json", tmp_path / "estimated.json"
    assert profile(capsys, spec, measured)[0] == 0
    status, stdout, stderr = profile(capsys, spec, estimated, "--estimate", *throughput)
    assert status == 0, stderr
    assert f"chain written to {estimated}" in stdout
    measured, estimated = load_chain(measured), load_chain(estimated)
    assert sizes(estimated) == sizes(measured)
    assert "estimated at" in estimated.device and "FLOP/s" in estimated.device
    if throughput:
        assert "1e+09" in estimated.device
    assert sum(s.fwd_time for s in estimated.stages) > 0  # FLOPs / throughput (an embedding lookup counts none)


def test_throughput_scales_estimated_times(tmp_path, capsys):
    slow, fast = tmp_path / "slow.json", tmp_path / "fast.json"
    assert profile(capsys, MLP, slow, "--estimate", "--throughput", "1e9")[0] == 0
    assert profile(capsys, MLP, fast, "--estimate")[0] == 0  # the default, 1e12 FLOP/s
    slow, fast = load_chain(slow), load_chain(fast)
    for a, b in zip(slow.stages, fast.stages):
        assert a.fwd_time == pytest.approx(1000 * b.fwd_time) and a.bwd_time == pytest.approx(1000 * b.bwd_time)


@pytest.mark.parametrize("spec", ["tests/fixtures/masked_model.py:build", "tests/fixtures/masked_model.py"],
                         ids=["file:build", "file-default-build"])
def test_user_factory_file(tmp_path, capsys, monkeypatch, spec):
    monkeypatch.chdir(ROOT)  # the SPEC as a user types it, relative to the repository
    out = tmp_path / "chain.json"
    status, stdout, stderr = profile(capsys, spec, out)
    assert status == 0, stderr
    chain = load_chain(out)
    assert chain.name == "masked_model"
    assert [s.name for s in chain.stages] == ["embed", "block0", "block1", "head"]
    # inputs (ids int64, mask bool) at the factory's default batch of 4, sequence 16, width 32
    assert chain.input_bytes == 4 * 16 * 8 + 4 * 16
    assert chain.stages[0].out_bytes == 4 * 16 * 32 * 4


def test_batch_is_passed_to_the_user_factory(tmp_path, capsys):
    out = tmp_path / "chain.json"
    status, _, stderr = profile(capsys, FIXTURE, out, "--batch", "2")
    assert status == 0, stderr
    chain = load_chain(out)
    assert chain.input_bytes == 2 * 16 * 8 + 2 * 16
    assert chain.stages[0].out_bytes == 2 * 16 * 32 * 4


@pytest.mark.parametrize("spec, model_batch", [(MLP, 8), (GPT, 2)], ids=["mlp", "gpt-tiny"])
def test_batch_scales_a_built_in_model(tmp_path, capsys, spec, model_batch):
    base, doubled = tmp_path / "base.json", tmp_path / "doubled.json"
    assert profile(capsys, spec, base)[0] == 0
    assert profile(capsys, spec, doubled, "--batch", str(2 * model_batch))[0] == 0  # --batch overrides batch=
    base, doubled = load_chain(base), load_chain(doubled)
    assert [s.name for s in base.stages] == [s.name for s in doubled.stages]
    for a, b in zip(base.stages, doubled.stages):
        assert b.out_bytes == 2 * a.out_bytes
        assert b.param_bytes == a.param_bytes
    assert doubled.input_bytes == 2 * base.input_bytes


BAD_INPUTS = [
    ("unknown-model", "resnet-huge", [], ["unknown model 'resnet-huge'", "mlp, gpt-tiny, resnet-tiny"]),
    ("bad-value", "mlp:layers=abc", [], ["layers", "'abc'", "valid options"]),
    ("unknown-option", "mlp:depth=3", [], ["unknown option 'depth'", "layers=32"]),
    ("missing-file", "{tmp}/nowhere.py:build", [], ["nowhere.py", "no such file"]),
    ("import-fails", "{factories}/broken_import.py", [], ["broken_import.py", "importing it failed",
                                                          "RuntimeError", "broken at import"]),
    ("no-such-function", "{factories}/factories.py:missing", [], ["no function 'missing'"]),
    ("no-default-build", "{factories}/factories.py", [], ["no function 'build'"]),
    ("factory-raises", "{factories}/factories.py:raises", [], ["building the model failed", "ValueError",
                                                               "the factory broke on two lines"]),
    ("single-module", "{factories}/factories.py:single_module", [], ["(stages, example_inputs)", "Linear"]),
    ("four-tuple", "{factories}/factories.py:four_tuple", [], ["(stages, example_inputs)", "length 4"]),
    ("stage-fails", "{factories}/factories.py:wrong_width", [], ["stage 1 (second)", "RuntimeError", "mat1"]),
    ("non-scalar-loss", "{factories}/factories.py:non_scalar_loss", [], ["loss function", "scalar"]),
    ("batch-not-accepted", "{factories}/factories.py:no_batch", ["--batch", "2"], ["no_batch", "'batch'", "--batch"]),
    ("throughput-alone", MLP, ["--throughput", "1e9"], ["--throughput", "--estimate"]),
    ("throughput-negative", MLP, ["--estimate", "--throughput", "-1"], ["--throughput", "positive"]),
]


@pytest.mark.parametrize("spec, options, expected", [case[1:] for case in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_one_error_line(tmp_path, capsys, factories, spec, options, expected):
    out = tmp_path / "chain.json"
    spec = spec.format(tmp=tmp_path, factories=factories)
    line = one_error_line(*profile(capsys, spec, out, *options))
    assert not out.exists()
    for text in expected:
        assert text in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_cuda_without_cuda_is_one_error_line(tmp_path, capsys):
    out = tmp_path / "chain.json"
    line = one_error_line(*profile(capsys, MLP, out, "--device", "cuda"))
    assert not out.exists()
    assert "CUDA is not available" in line


# Found while writing these tests, fixed since: each was a traceback.


def test_a_plain_module_is_a_model_whose_stages_are_discovered(tmp_path, capsys, factories):
    out = tmp_path / "chain.json"  # once an error line, when a factory had to return stages
    status, stdout, _ = profile(capsys, f"{factories}/factories.py:plain_module_as_stages", out)
    assert status == 0 and "1 stages discovered" in stdout and len(load_chain(out).stages) == 1, stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_estimate_on_cuda_without_cuda_is_one_error_line(tmp_path, capsys):
    out = tmp_path / "chain.json"
    one_error_line(*profile(capsys, MLP, out, "--estimate", "--device", "cuda"))
    assert not out.exists()


def test_estimate_stage_failure_is_one_error_line(tmp_path, factories):
    # In a process of its own: torch's log handler keeps whichever stderr it first saw, so capsys may miss it.
    out = tmp_path / "chain.json"
    argv = ["profile", f"{factories}/factories.py:wrong_width", "-o", str(out), "--estimate", *QUICK]
    done = subprocess.run([sys.executable, "-c", "import sys, cli; sys.exit(cli.main(sys.argv[1:]))", *argv],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    line = one_error_line(done.returncode, done.stdout, done.stderr)
    assert not out.exists()
    assert "stage 1 (second)" in line


def test_chain_file_is_plain_json_with_the_model_name(tmp_path, capsys):
    out = tmp_path / "chain.json"
    assert profile(capsys, GPT, out)[0] == 0
    data = json.loads(out.read_text())
    assert data["format"] == "memsched.chain/1" and data["name"] == "gpt-tiny"
    assert [s["name"] for s in data["stages"]] == ["embed", "block0", "head"]
