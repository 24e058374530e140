"""The cuBLAS workspace a CUDA device holds once a matmul has run, torch-free: :func:`blas_workspace`.

PyTorch (aten/src/ATen/cuda/CublasHandlePool.cpp, as torch 2.13 builds it for CUDA; docs/model.md, "The cuBLAS
workspace", says which version was read) gives every cuBLAS handle a workspace of its own on its stream,
allocated through the caching allocator (so ``torch.cuda.memory_allocated`` counts it) at the handle's first
matmul on that stream and kept for the life of the process. Its size in bytes:

* ``CUBLAS_WORKSPACE_CONFIG`` unset: :data:`LARGE_DEFAULT` (4096 KiB x 8 = 32 MiB) on a device of compute
  capability major 9, 10 or 12 (:data:`LARGE_MAJORS`: Hopper, Blackwell), else :data:`SMALL_DEFAULT`
  (4096 KiB x 2 + 16 KiB x 8, the ``:4096:2:16:8`` configuration: 8 MiB + 128 KiB).
* set: the sum of SIZE KiB x COUNT over every ``:SIZE:COUNT`` found in it (a regular-expression search, so text
  around or between the pairs is skipped); a value with no such pair is the default (PyTorch warns).

cuBLASLt shares that workspace unless ``TORCH_CUBLASLT_UNIFIED_WORKSPACE=0`` (the open-source builds' default is
to share); then each handle also gets a cuBLASLt workspace of ``CUBLASLT_WORKSPACE_SIZE`` KiB (default
:data:`LT_DEFAULT_KIB`, 1 MiB) at its first cuBLASLt matmul (a linear layer with a bias takes that path).

A handle belongs to a thread (the pool reserves one per thread and device), and a training step runs on two:
the forward on the caller's, the backward on autograd's thread for the device. So a step holds
:data:`TRAINING_THREADS` workspaces from its first backward matmul on, and every later step all along. Each is
one block of the caching allocator, counted as planner/allocator.py rounds it.
"""

import os
import re
from typing import Mapping, NamedTuple

from planner.allocator import allocated_bytes
from planner.errors import MemschedError

KIB = 1024
LARGE_DEFAULT = 4096 * KIB * 8  # bytes: the default on Hopper and Blackwell (32 MiB)
SMALL_DEFAULT = 4096 * KIB * 2 + 16 * KIB * 8  # bytes: the default elsewhere, ":4096:2:16:8" (8 MiB + 128 KiB)
LARGE_MAJORS = (9, 10, 12)  # compute capability majors with the 32 MiB default
LT_DEFAULT_KIB = 1024  # KiB: a separate cuBLASLt workspace's default size
TRAINING_THREADS = 2  # threads with a cuBLAS handle in a training step: the caller's and autograd's device thread
CONFIG = "CUBLAS_WORKSPACE_CONFIG"
LT_UNIFIED = "TORCH_CUBLASLT_UNIFIED_WORKSPACE"
LT_SIZE = "CUBLASLT_WORKSPACE_SIZE"
_PAIR = re.compile(r":([0-9]+):([0-9]+)")
_INT = re.compile(r"\s*([+-]?[0-9]+)")
_INT_MAX = 2**31 - 1  # std::stoi's range: a larger CUBLASLT_WORKSPACE_SIZE is the default (PyTorch warns)
_SIZE_MAX = 2**64 - 1  # std::stoull's range: a larger number in CUBLAS_WORKSPACE_CONFIG is an error in PyTorch


class BlasWorkspace(NamedTuple):
    """What the math libraries hold on a device: ``cublas`` and ``cublaslt`` (bytes each handle asks the caching
    allocator for; ``cublaslt`` 0 when it shares cuBLAS's), ``threads`` handles, ``held`` (bytes the allocator
    counts for them all) and ``why`` (where the sizes come from, in words)."""

    cublas: int
    cublaslt: int
    threads: int
    held: int
    why: str


def default_size(capability: str) -> int:
    """Bytes of the cuBLAS workspace without ``CUBLAS_WORKSPACE_CONFIG`` on a device of compute ``capability``
    ("9.0")."""
    major = int(capability.split(".")[0])
    return LARGE_DEFAULT if major in LARGE_MAJORS else SMALL_DEFAULT


def cublas_size(capability: str, config: str = None) -> int:
    """Bytes of one cuBLAS workspace on a device of compute ``capability`` under ``CUBLAS_WORKSPACE_CONFIG``
    ``config`` (None: unset): the sum of SIZE KiB x COUNT over its ``:SIZE:COUNT`` pairs, else the default."""
    if config is None:
        return default_size(capability)
    pairs = _PAIR.findall(config)
    if not pairs:
        return default_size(capability)
    for number in (n for pair in pairs for n in pair):
        if int(number) > _SIZE_MAX:
            raise MemschedError(f"{CONFIG}={config!r}: {number} is out of range (PyTorch fails on it); give "
                                ":SIZE:COUNT pairs in KiB, e.g. :4096:8")
    return sum(int(size) * KIB * int(count) for size, count in pairs)


def cublaslt_size(environ: Mapping) -> int:
    """Bytes of a separate cuBLASLt workspace: 0 when it shares cuBLAS's (``TORCH_CUBLASLT_UNIFIED_WORKSPACE``
    anything but "0"), else ``CUBLASLT_WORKSPACE_SIZE`` KiB read as ``std::stoi`` reads it (leading digits; none,
    or beyond an int, the default :data:`LT_DEFAULT_KIB`)."""
    if environ.get(LT_UNIFIED) != "0":
        return 0
    text = environ.get(LT_SIZE)
    match = _INT.match(text) if text is not None else None
    kib = int(match.group(1)) if match and abs(int(match.group(1))) <= _INT_MAX else LT_DEFAULT_KIB
    if kib < 0:
        raise MemschedError(f"{LT_SIZE}={text!r} is negative; give the cuBLASLt workspace in KiB, e.g. 1024")
    return kib * KIB


def blas_workspace(allocator: str, capability: str = None, environ: Mapping = None,
                   threads: int = TRAINING_THREADS) -> BlasWorkspace:
    """What cuBLAS (and cuBLASLt, when separate) hold on a device with ``allocator`` ("cuda" or "cpu") of compute
    ``capability`` ("9.0"; None: not known, nothing counted) once ``threads`` threads have run a matmul, under
    the environment ``environ`` (default: this process's, as the training's is taken to be)."""
    if allocator != "cuda":
        return BlasWorkspace(0, 0, 0, 0, "no cuBLAS on a CPU")
    if capability is None:
        return BlasWorkspace(0, 0, 0, 0, "not counted: the device spec gives no compute_capability")
    environ = os.environ if environ is None else environ
    config = environ.get(CONFIG)
    cublas, cublaslt = cublas_size(capability, config), cublaslt_size(environ)
    held = threads * (allocated_bytes(cublas) + allocated_bytes(cublaslt))
    source = f"{CONFIG}={config}" if config is not None and _PAIR.search(config) else \
        f"the default for compute capability {capability}"
    lt = f" + cuBLASLt's {cublaslt} bytes ({LT_UNIFIED}=0)" if cublaslt else ""
    return BlasWorkspace(cublas, cublaslt, threads, held,
                         f"{threads} x ({cublas} bytes{lt}, {source}): one per thread running matmuls, the step's "
                         "and autograd's, each held from its first matmul")
