"""CUDA's autocast on this CPU (profiles/cuda_autocast.py): CUDA's op lists, as the installed torch declares them,
applied by CPU autocast within the block and undone after it; a step planned for a CUDA target under autocast
captured with CUDA's casts, a CPU target's with the CPU's; ``--autocast`` on the command line."""

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from checks import one_error_line, raises_one_line, run
from paths import FIXTURES, load_fixture
from planner import fit
from planner.devices import DeviceSpec
from profiles.cuda_autocast import CUDA_POLICIES, cuda_autocast

HEADER = Path(torch.__file__).parent / "include" / "ATen" / "autocast_mode.h"
MACROS = {"lower": "AT_FORALL_LOWER_PRECISION_FP", "fp32": "AT_FORALL_FP32",
          "fp32_set_opt_dtype": "AT_FORALL_FP32_SET_OPT_DTYPE", "promote": "AT_FORALL_PROMOTE"}
CPU_TARGET = DeviceSpec("here", 1 << 34, 1e11, 1e11, 1e10, 1e10, 1e10, allocator="cpu")


@pytest.mark.skipif(not HEADER.exists(), reason="this torch ships no ATen headers")
def test_the_lists_are_those_the_installed_torch_declares():
    text = HEADER.read_text()
    for policy, macro in MACROS.items():
        body = re.search(rf"#define {macro}\(_\)(.*?)\n\n", text, re.S).group(1)
        declared = [".".join(part.strip() for part in entry.split(",")) for entry in re.findall(r"_\(([^)]*)\)", body)]
        assert list(CUDA_POLICIES[policy]) == declared, policy
    redispatched = re.search(r"#define AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE\(_\)(.*?)\n\n", text, re.S).group(1)
    assert re.findall(r'"(norm\.[A-Za-z_]+)"', redispatched) == list(CUDA_POLICIES["fp32_append_dtype"])


def dtypes(x, w):
    """The dtypes CPU autocast gives a few ops of each list on fp32 ``x`` (4 x 8) and ``w`` (8 x 8)."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = x @ w
        return dict(matmul=y.dtype, softmax=torch.softmax(y, -1).dtype, layer_norm=F.layer_norm(y, (8,)).dtype,
                    exp=y.exp().dtype, pow=y.pow(3).dtype, sum=y.sum().dtype, norm=y.norm().dtype,
                    addcmul=torch.addcmul(x, y, y).dtype, stack=torch.stack([x, y]).dtype,
                    cross_entropy=F.cross_entropy(y, torch.zeros(4, dtype=torch.long)).dtype)


def test_within_the_block_cpu_autocast_casts_as_cuda_and_afterwards_as_the_cpu_again():
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    cpu = dtypes(x, w)
    with cuda_autocast():
        cuda = dtypes(x, w)
        with pytest.raises(RuntimeError, match="binary_cross_entropy_with_logits"), \
                torch.autocast("cpu", dtype=torch.bfloat16):
            F.binary_cross_entropy(torch.rand(4), torch.rand(4))
    bf16, fp32 = torch.bfloat16, torch.float32
    # CUDA: softmax, layer_norm, exp, pow and sum in fp32 (the CPU leaves them bf16); addcmul promoted to the widest
    assert cuda == dict(matmul=bf16, softmax=fp32, layer_norm=fp32, exp=fp32, pow=fp32, sum=fp32, norm=fp32,
                        addcmul=fp32, stack=fp32, cross_entropy=fp32)
    assert cpu == dict(matmul=bf16, softmax=bf16, layer_norm=bf16, exp=bf16, pow=bf16, sum=bf16, norm=bf16,
                       addcmul=fp32, stack=fp32, cross_entropy=fp32)
    assert dtypes(x, w) == cpu  # the kernels are gone


def op_inputs(fitted, name: str) -> set:
    """``(dtype of each floating input..., dtype argument)`` of every ``aten::NAME`` node of the fitted stages."""
    found = set()
    for _, stage in fitted.discovery.staged.stages:
        for node in stage.graph.nodes:
            if node.op == "call_function" and getattr(node.target, "_schema", None) and \
                    node.target._schema.name == f"aten::{name}":
                values = [a.meta.get("val") for a in node.args if isinstance(a, torch.fx.Node)]
                given = [a for a in node.args[1:] if isinstance(a, torch.dtype)]
                found.add((*(v.dtype for v in values if isinstance(v, torch.Tensor) and v.is_floating_point()),
                           *given))
    return found


def test_a_cuda_target_is_planned_with_cudas_casts_and_a_cpu_target_with_the_cpus():
    model, batch = load_fixture("hf_gpt2").build()
    quick = dict(progress=False, stage_options=0, autocast=torch.bfloat16)
    seen = []
    hook = model.transformer.h[0].register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    cuda = fit(model, batch, "auto", device_spec="h100-80gb", **quick)
    cpu = fit(model, batch, "auto", device_spec=CPU_TARGET, **quick)
    hook.remove()
    bf16, fp32 = torch.bfloat16, torch.float32
    # GPT-2's gelu_new cubes the bf16 output of its first MLP matmul and takes its tanh: CUDA's pow in fp32 (and so
    # the tanh after it), the CPU's in bf16
    assert op_inputs(cuda, "pow") == op_inputs(cuda, "tanh") == {(fp32,)}
    assert op_inputs(cpu, "pow") == op_inputs(cpu, "tanh") == {(bf16,)}
    # the loss: CUDA decomposes cross_entropy (log_softmax given fp32 logits, as Hugging Face upcasts them), the CPU
    # casts it whole
    assert op_inputs(cuda, "log_softmax") == {(fp32, fp32)} and not op_inputs(cuda, "cross_entropy_loss")
    assert op_inputs(cpu, "cross_entropy_loss") == {(fp32,)} and not op_inputs(cpu, "log_softmax")
    for fitted in (cuda, cpu):
        assert op_inputs(fitted, "scaled_dot_product_attention") == op_inputs(fitted, "addmm") == {(bf16,) * 3}
        assert {dtype for inputs in op_inputs(fitted, "layer_norm") for dtype in inputs} == {fp32}  # (residual)
    assert str(cuda.precision) == "bfloat16 autocast on cpu with CUDA's op lists"
    # found and profiled on fake tensors: the model's forward never ran on the real batch
    assert seen and all(type(value).__name__ == "FakeTensor" for value in seen)


def test_the_command_line_plans_a_spec_under_autocast_and_refuses_it_where_it_cannot(tmp_path, capsys):
    spec = f"{FIXTURES / 'hf_gpt2.py'}:build"
    code, out, _ = run(capsys, "plan", spec, "--device-spec", "h100-80gb", "--autocast", "bf16")
    assert code == 0 and "chosen     micro-batch 4 x 1" in out
    chain = tmp_path / "chain.json"
    code, out, _ = run(capsys, "profile", spec, "--estimate", "--device-spec", "h100-80gb", "--autocast", "bf16",
                       "-o", chain)
    assert code == 0 and chain.exists()
    for argv, words in [
        (("plan", chain, "--autocast", "bf16"), ["--autocast", "chain profile", "give the SPEC"]),
        (("profile", "gpt-tiny", "--estimate", "--autocast", "bf16", "-o", tmp_path / "c.json"),
         ["--autocast", "whole model", "drop --autocast"]),
        (("profile", spec, "--graph", "--autocast", "bf16", "-o", tmp_path / "g.json"),
         ["--autocast does not mix with --graph"]),
        (("plan", spec, "--autocast", "bf8"), ["--autocast", "bf16", "fp16"]),
    ]:
        one_error_line(*run(capsys, *argv), *words)


def test_fit_names_a_bad_autocast_in_one_line():
    model, batch = load_fixture("hf_gpt2").build()
    message = raises_one_line(fit, model, batch, "auto", device_spec="h100-80gb", autocast="int8", progress=False)
    assert "autocast" in message and "bf16" in message
