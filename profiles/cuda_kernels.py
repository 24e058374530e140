"""What a CUDA kernel saves that the CPU kernel an estimate runs does not: rules applied while estimating for a
CUDA device on this CPU.

A CPU build of torch cannot make CUDA fake tensors, so an estimate for a CUDA device runs the CPU kernels on fake
tensors. Where the CUDA kernel allocates other shapes, :class:`CudaKernelShapes` (a ``TorchDispatchMode``)
replaces the CPU kernel's outputs with tensors of the CUDA kernel's storage sizes, so that the live-memory
tracker above it counts what the device would hold. Each rule follows the CUDA kernel's shapes as PyTorch's own
meta registrations give them (``torch/_meta_registrations.py``; checked by tests/profiles/test_cuda_kernels.py):

- **Attention** (``scaled_dot_product_attention``). On CPU it runs
  ``_scaled_dot_product_flash_attention_for_cpu``, which saves the output and a log-sum-exp of shape
  ``(B, H, L)`` in fp32. CUDA's flash kernel (fp16 or bf16, no attention mask, head size a multiple of 8 up to
  256) saves the same shapes; otherwise (fp32, a mask) CUDA runs the memory-efficient kernel, whose log-sum-exp
  is padded to ``(B, H, ceil(L / 32) * 32)``: that padding is added here. Not counted: the dropout seed and
  offset (a few bytes), and a model whose CPU attention takes the math path (softmax of ``(B, H, L, S)`` saved):
  the CUDA kernels save less, so such an estimate is high.
- **LayerNorm** (``native_layer_norm``). On a 16-bit input the CPU kernel returns the mean and reciprocal
  deviation its backward saves in the input's dtype; CUDA's in fp32 (PyTorch's reference ``native_layer_norm``
  converts them back only on CPU): 4 bytes per normalised row each, not 2. They are made fp32 here.
- **Dropout** (``torch.nn.functional.dropout``, as ``nn.Dropout`` and the Hugging Face models call it). On CPU it
  draws a noise tensor of the input's dtype, scales it and multiplies: the backward keeps that noise, one
  element as large as the input's per element. CUDA runs the fused ``native_dropout``, whose backward keeps a
  ``bool`` mask: one byte per element (Korthikanti et al. 2022 count the same). :class:`CudaDropout` (a
  ``TorchFunctionMode``: ``dropout`` is decomposed before any dispatch mode sees it) runs ``native_dropout``
  instead, whose CPU kernel keeps the same ``bool`` mask. An in-place dropout keeps the CPU's.
"""

import contextlib

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

LSE_ALIGN = 32  # the memory-efficient kernel's log-sum-exp rows are padded to a multiple of this
FLASH_DTYPES = (torch.float16, torch.bfloat16)  # (the 16-bit dtypes: flash attention's, LayerNorm's fp32 statistics)
FLASH_MAX_HEAD = 256


def cuda_attention_kernel(query, attn_mask=None) -> str:
    """``"flash"`` or ``"efficient"``: the kernel CUDA's ``scaled_dot_product_attention`` runs for ``query``
    (``(B, H, L, E)``) with or without a mask, by the first rules of PyTorch's selection (sdp_utils): flash for
    fp16/bf16 without a mask and a head size that is a multiple of 8 up to 256, else memory-efficient."""
    head = query.shape[-1]
    if query.dtype in FLASH_DTYPES and attn_mask is None and head % 8 == 0 and head <= FLASH_MAX_HEAD:
        return "flash"
    return "efficient"


class CudaKernelShapes(TorchDispatchMode):
    """Outputs of CPU kernels resized to the storages the CUDA kernels allocate (the module docstring's rules)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.ops.aten.native_layer_norm.default and out[1].dtype in FLASH_DTYPES:
            output, mean, rstd = out
            return output, mean.new_empty(mean.shape, dtype=torch.float32), rstd.new_empty(rstd.shape,
                                                                                        dtype=torch.float32)
        if func is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default:
            output, lse = out
            if cuda_attention_kernel(args[0], kwargs.get("attn_mask")) == "efficient":
                rows = lse.shape[-1]
                padded = lse.new_empty(*lse.shape[:-1], -(-rows // LSE_ALIGN) * LSE_ALIGN)
                return output, padded[..., :rows]
        return out


class CudaDropout(TorchFunctionMode):
    """``dropout`` run as CUDA's fused kernel, keeping a 1-byte mask per element (the module docstring's rule)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.dropout:
            named = dict(zip(("input", "p", "training", "inplace"), args), **kwargs)
            p, training = named.get("p", 0.5), named.get("training", True)
            if training and not named.get("inplace", False) and 0 < p < 1 and named["input"].is_floating_point():
                return torch.ops.aten.native_dropout(named["input"], p, True)[0]
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_kernels():
    """Within the block, the CPU kernels an estimate runs keep what CUDA's would (:class:`CudaKernelShapes`,
    :class:`CudaDropout`)."""
    with CudaDropout(), CudaKernelShapes():
        yield
