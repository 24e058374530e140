"""What a CUDA kernel saves that the CPU kernel an estimate runs does not (profiles/cuda_kernels.py), checked
against the CUDA kernels' shapes as PyTorch's own meta registrations give them."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from planner.allocator import allocated_bytes
from planner.devices import DEVICES
from profiles import cuda_kernels
from profiles.chain_profiler import profile_chain
from profiles.cuda_kernels import CudaKernelShapes, cuda_attention_kernel
from profiles.fake_build import build_fake

B, H, L, E = 2, 4, 100, 16  # L not a multiple of 32


def _saved_lse(dtype, mask=None) -> torch.Tensor:
    """The log-sum-exp CPU attention saves for its backward, under the CUDA rules, on fake tensors."""
    with FakeTensorMode():
        q = torch.randn(B, H, L, E, dtype=dtype, requires_grad=True)
        attn_mask = None if mask is None else torch.zeros(L, L, dtype=dtype)
        with CudaKernelShapes():
            out = F.scaled_dot_product_attention(q, q, q, attn_mask=attn_mask)
        return out.grad_fn._saved_logsumexp


def _meta_lse(kernel: str, dtype) -> torch.Size:
    """The log-sum-exp shape CUDA's kernel allocates, from PyTorch's meta registration of it."""
    q = torch.empty(B, H, L, E, dtype=dtype, device="meta")
    if kernel == "flash":
        return torch.ops.aten._scaled_dot_product_flash_attention(q, q, q)[1].shape
    return torch.ops.aten._scaled_dot_product_efficient_attention(q, q, q, None, True)[1].shape


@pytest.mark.parametrize("dtype, mask, kernel", [(torch.float32, None, "efficient"), (torch.bfloat16, None, "flash"),
                                                 (torch.float16, None, "flash"), (torch.bfloat16, "mask", "efficient")])
def test_attention_saves_the_log_sum_exp_of_the_kernel_cuda_runs(dtype, mask, kernel):
    query = torch.empty(B, H, L, E, dtype=dtype, device="meta")
    assert cuda_attention_kernel(query, None if mask is None else query) == kernel
    lse = _saved_lse(dtype, mask)
    assert lse.shape == (B, H, L) and lse.dtype == torch.float32  # what the CPU backward reads
    assert lse.untyped_storage().nbytes() == _meta_lse(kernel, dtype).numel() * 4  # what CUDA allocates
    assert (lse.untyped_storage().nbytes() > B * H * L * 4) == (kernel == "efficient")  # padded to 128 rows


def test_a_head_size_flash_does_not_take_goes_to_the_efficient_kernel():
    assert cuda_attention_kernel(torch.empty(1, 1, 8, 12, dtype=torch.bfloat16, device="meta")) == "efficient"
    assert cuda_attention_kernel(torch.empty(1, 1, 8, 512, dtype=torch.bfloat16, device="meta")) == "efficient"


class _Attention(nn.Module):
    def forward(self, x):
        return F.scaled_dot_product_attention(x, x, x) * 2


def test_a_cuda_estimate_counts_the_padded_log_sum_exp(monkeypatch):
    def estimate():
        _, (stages, x) = build_fake(lambda: ([_Attention()], torch.randn(B, H, L, E, requires_grad=True)))
        return profile_chain(stages, x, estimate=True, warmup=0, repeats=1, device_spec=DEVICES["h100-80gb"])

    padded = estimate().stages[0]
    monkeypatch.setattr(cuda_kernels.CudaKernelShapes, "__torch_dispatch__",
                        lambda self, func, types, args=(), kwargs=None: func(*args, **(kwargs or {})))
    plain = estimate().stages[0]
    grown = allocated_bytes(B * H * 128 * 4) - allocated_bytes(B * H * L * 4)
    assert grown == 512 and padded.saved_bytes - plain.saved_bytes == grown


def test_dropout_keeps_the_one_byte_mask_of_the_kernel_cuda_runs():
    meta = torch.ops.aten.native_dropout(torch.empty(B, L, E, device="meta"), 0.1, True)[1]
    for dtype in (torch.float32, torch.bfloat16):
        with FakeTensorMode():
            x = torch.randn(B, L, E, dtype=dtype, requires_grad=True)
            cpu = F.dropout(x, 0.1)
            with cuda_kernels.CudaDropout():
                cuda = nn.Dropout(0.1)(x)
                evaluated = F.dropout(x, 0.1, training=False)
        (noise,) = [getattr(cpu.grad_fn, name) for name in dir(cpu.grad_fn) if name.startswith("_saved_other")]
        assert noise.dtype == dtype  # the CPU keeps its scaled noise, one input element per element
        mask = cuda.grad_fn._saved_result1
        assert mask.dtype == meta.dtype == torch.bool and mask.shape == meta.shape == x.shape  # CUDA: 1 byte each
        assert cuda.dtype == dtype and evaluated is x  # the output as before; not training: no dropout at all


class _Dropout(nn.Module):
    def forward(self, x):
        return F.dropout(x * 2, 0.1) * 3


def test_a_cuda_estimate_keeps_a_byte_per_element_for_dropout_where_the_cpu_keeps_an_element(monkeypatch):
    def estimate():
        _, (stages, x) = build_fake(lambda: ([_Dropout()], torch.randn(B, 1024, requires_grad=True)))
        return profile_chain(stages, x, estimate=True, warmup=0, repeats=1, device_spec=DEVICES["h100-80gb"]).stages[0]

    cuda = estimate()
    monkeypatch.setattr(cuda_kernels.CudaDropout, "__torch_function__",
                        lambda self, func, types, args=(), kwargs=None: func(*args, **(kwargs or {})))
    cpu = estimate()
    elements = B * 1024
    # Both keep the output (the loss reads it) and, for `* 3`, nothing; dropout's noise (fp32) becomes a mask.
    assert cpu.saved_bytes - cuda.saved_bytes == allocated_bytes(elements * 4) - allocated_bytes(elements)


def test_a_16_bit_layer_norm_keeps_the_fp32_statistics_cuda_makes():
    meta = torch.ops.aten.native_layer_norm(torch.empty(B, L, E, dtype=torch.bfloat16, device="meta"), [E], None,
                                            None, 1e-5)
    for dtype, statistics in ((torch.bfloat16, torch.float32), (torch.float32, torch.float32)):
        with FakeTensorMode():
            x = torch.randn(B, L, E, dtype=dtype, requires_grad=True)
            cpu = F.layer_norm(x, (E,)).grad_fn._saved_result1
            with CudaKernelShapes():
                out = F.layer_norm(x, (E,))
            mean = out.grad_fn._saved_result1
            out.sum().backward()  # the CPU backward reads the fp32 statistics
        assert mean.dtype == statistics and mean.shape == (B, L, 1) and out.dtype == dtype
        assert cpu.dtype == dtype  # the CPU kernel's own
    assert meta[1].dtype == torch.float32  # PyTorch's reference for a device that is not the CPU
