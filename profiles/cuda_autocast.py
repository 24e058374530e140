"""CUDA's autocast on this CPU: while :func:`cuda_autocast` is active, ``torch.autocast("cpu", dtype)`` casts as
``torch.autocast("cuda", dtype)`` does, so that a step captured for a CUDA target holds CUDA's casts.

Autocast is a dispatcher key: an op with a kernel at ``AutocastCUDA`` casts its inputs by that kernel's policy,
and any other op falls through. The CPU and CUDA keys carry different op lists: CUDA runs ``softmax``,
``layer_norm``, ``exp``, ``pow``, ``sum`` and the losses in fp32, where CPU autocast leaves them 16-bit; CPU casts
``cross_entropy_loss``, ``stack``, ``cat`` and the linear algebra, where CUDA leaves them to their own kernels. A CPU
build of torch has no CUDA autocast to run, so the context registers Python kernels at ``AutocastCPU`` for the
length of the block: CUDA's policy for each op of CUDA's lists (:data:`CUDA_POLICIES`, as
``ATen/autocast_mode.h`` of this torch declares them: ``AT_FORALL_LOWER_PRECISION_FP``, ``AT_FORALL_FP32``,
``AT_FORALL_FP32_SET_OPT_DTYPE``, ``AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE``, ``AT_FORALL_PROMOTE``; checked
against the installed header by tests/profiles/test_cuda_autocast.py), and for each op only CPU autocast lists, what
CUDA does with it: nothing (the op runs as it is), or, for a composite op (``cross_entropy_loss``), its
decomposition, whose ops then meet autocast one by one (``log_softmax``, ``nll_loss``), as the CUDA dispatcher
decomposes it after falling through. Leaving the block removes the kernels: CPU autocast is CPU's again.

The policies, as ``autocast_mode.h`` implements them: a tensor is *eligible* when it is floating point and not
fp64; ``lower`` casts every eligible input to autocast's dtype; ``fp32`` casts them to fp32;
``fp32_set_opt_dtype`` (``softmax``, ``sum``) passes ``dtype=torch.float32`` when the first input is eligible and no
dtype is given; ``fp32_append_dtype`` (``norm``) calls the overload taking a dtype with fp32; ``promote`` casts the
eligible inputs to the widest dtype among them. Not emulated: autocast's cache of a parameter's cast (a captured
graph casts a parameter at each use, under CPU autocast as here) and ``binary_cross_entropy``, which CUDA autocast
refuses (refused here as CUDA words it).
"""

import contextlib
import warnings

import torch
from torch.utils._pytree import tree_map

LOWER, FP32, SET_OPT_DTYPE, APPEND_DTYPE, PROMOTE = "lower", "fp32", "fp32_set_opt_dtype", "fp32_append_dtype", \
    "promote"
CUDA_POLICIES = {
    LOWER: ("_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
            "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "prelu", "addmm", "addmv", "addr",
            "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul",
            "linalg_multi_dot", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell",
            "rnn_tanh_cell", "rnn_relu_cell", "_scaled_dot_product_flash_attention", "scaled_dot_product_attention"),
    FP32: ("acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
           "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm",
           "native_layer_norm", "rms_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim",
           "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
           "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
           "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
           "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
           "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d",
           "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
           "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa"),
    SET_OPT_DTYPE: ("prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum",
                    "linalg_vector_norm", "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum",
                    "sum.dim_IntList"),
    APPEND_DTYPE: ("norm.Scalar", "norm.ScalarOpt_dim"),
    PROMOTE: ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put",
              "tensordot", "scatter_add"),
}
BANNED = ("binary_cross_entropy",)  # CUDA autocast refuses it (its message: use ..._with_logits)
_APPENDED = {"norm.Scalar": "norm.ScalarOpt_dtype", "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype"}
_KEY = "AutocastCPU"


def op_of(name: str):
    """The ``torch.ops.aten`` overload ``name`` (``"softmax.int"``; no overload: ``.default``)."""
    packet, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, packet), overload or "default")


def cpu_autocast_ops() -> list:
    """The names (``"softmax.int"``) of the ops CPU autocast has a kernel for, in this torch."""
    return sorted(name[len("aten::"):] for name in torch._C._dispatch_get_all_op_names()
                  if name.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(name, _KEY))


@contextlib.contextmanager
def cuda_autocast():
    """Within the block, CPU autocast applies CUDA's op lists (module docstring); CPU's again afterwards."""
    library = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():  # "overriding a previously registered kernel": meant, and undone below
            warnings.simplefilter("ignore")
            cuda = set()
            for policy, names in CUDA_POLICIES.items():
                for name in names:
                    library.impl(name, _policy_kernel(policy, op_of(name)), _KEY)
                    cuda.add(name)
            for name in BANNED:
                library.impl(name, _banned, _KEY)
            for name in cpu_autocast_ops():
                if name not in cuda and name not in BANNED:
                    library.impl(name, _fall_through_kernel(op_of(name)), _KEY)
        yield
    finally:
        library._destroy()


def _without_autocast(op, args, kwargs):
    """``op`` run past the autocast key (what a policy kernel does once it has cast)."""
    with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)):
        return op(*args, **kwargs)


def _eligible(value) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float64


def _cast_to(dtype):
    return lambda value: value.to(dtype) if _eligible(value) and value.dtype != dtype else value


def _policy_kernel(policy: str, op):
    """The ``AutocastCPU`` kernel of ``op`` under CUDA's ``policy``."""
    dtype_at = next((k for k, argument in enumerate(op._schema.arguments) if argument.name == "dtype"), None)
    appended = op_of(_APPENDED[f"{op._schema.name[len('aten::'):]}.{op._overloadname}"]) if policy == APPEND_DTYPE \
        else None

    def kernel(*args, **kwargs):
        if policy == LOWER:
            args, kwargs = tree_map(_cast_to(torch.get_autocast_dtype("cpu")), (args, kwargs))
        elif policy == FP32:
            args, kwargs = tree_map(_cast_to(torch.float32), (args, kwargs))
        elif policy == PROMOTE:
            widest = _widest([args, kwargs])
            if widest is not None:
                args, kwargs = tree_map(_cast_to(widest), (args, kwargs))
        elif policy == SET_OPT_DTYPE and args and _eligible(args[0]):
            if dtype_at is not None and len(args) > dtype_at:
                if args[dtype_at] is None:
                    args = (*args[:dtype_at], torch.float32, *args[dtype_at + 1:])
            elif kwargs.get("dtype") is None:
                kwargs = dict(kwargs, dtype=torch.float32)
        elif policy == APPEND_DTYPE and args and _eligible(args[0]):
            return _without_autocast(appended, (*args, torch.float32), kwargs)
        return _without_autocast(op, args, kwargs)

    return kernel


def _widest(tree):
    """The widest floating dtype among the eligible tensors of ``tree`` (None: none)."""
    dtypes = [leaf.dtype for leaf in torch.utils._pytree.tree_leaves(tree) if _eligible(leaf)]
    return max(dtypes, key=lambda dtype: torch.finfo(dtype).bits, default=None)


def _fall_through_kernel(op):
    """What CUDA does with an op only CPU autocast lists: runs it (a composite one: its decomposition, each of its
    ops meeting autocast)."""
    if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd"):
        return lambda *args, **kwargs: op._op_dk(torch._C.DispatchKey.CompositeImplicitAutograd, *args, **kwargs)
    return lambda *args, **kwargs: _without_autocast(op, args, kwargs)


def _banned(*args, **kwargs):
    raise RuntimeError("torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast on "
                       "CUDA: use torch.nn.functional.binary_cross_entropy_with_logits or torch.nn.BCEWithLogitsLoss "
                       "(as CUDA autocast refuses them)")
