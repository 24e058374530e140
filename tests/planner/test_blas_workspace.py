"""The cuBLAS workspace a CUDA device holds once a matmul has run (planner/blas_workspace.py), as PyTorch 2.13's
aten/src/ATen/cuda/CublasHandlePool.cpp sizes it and the caching allocator counts it: by architecture, under
CUBLAS_WORKSPACE_CONFIG (well-formed, malformed, out of range) and with cuBLASLt's workspace separate."""

import pytest

from checks import raises_one_line
from planner.blas_workspace import LARGE_DEFAULT, SMALL_DEFAULT, blas_workspace, cublas_size

KIB, MIB = 1 << 10, 1 << 20


@pytest.mark.parametrize("capability, config, size", [
    pytest.param("9.0", None, 32 * MIB, id="hopper-default"),
    pytest.param("10.0", None, 32 * MIB, id="blackwell-default"),
    pytest.param("12.0", None, 32 * MIB, id="blackwell-workstation-default"),
    pytest.param("8.0", None, 8 * MIB + 128 * KIB, id="ampere-default"),
    pytest.param("8.9", None, 8 * MIB + 128 * KIB, id="ada-default"),
    pytest.param("7.0", None, 8 * MIB + 128 * KIB, id="volta-default"),
    pytest.param("9.0", ":4096:8", 32 * MIB, id="one-pair"),
    pytest.param("8.0", ":4096:2:16:8", 8 * MIB + 128 * KIB, id="two-pairs"),
    pytest.param("8.0", ":16:8", 128 * KIB, id="the-deterministic-small-one"),
    pytest.param("9.0", "x:1024:3y:2:2", 3 * MIB + 4 * KIB, id="pairs-found-anywhere"),
    pytest.param("9.0", ":0:0", 0, id="none"),
    pytest.param("9.0", "4096:8", 32 * MIB, id="malformed-is-the-default"),
    pytest.param("8.0", "lots", 8 * MIB + 128 * KIB, id="words-are-the-default"),
    pytest.param("8.0", "", 8 * MIB + 128 * KIB, id="empty-is-the-default"),
])
def test_the_cublas_workspace_by_architecture_and_config(capability, config, size):
    assert cublas_size(capability, config) == size
    environ = {} if config is None else {"CUBLAS_WORKSPACE_CONFIG": config}
    workspace = blas_workspace("cuda", capability, environ)
    assert (workspace.cublas, workspace.cublaslt, workspace.threads) == (size, 0, 2)  # cuBLASLt shares it


def test_what_the_allocator_counts_for_two_threads():
    # 32 MiB: a segment of its own, exactly; 8 MiB + 128 KiB: split off a 20 MiB segment, as issue #95668 measured
    # (8519680 bytes left allocated by one Linear on an A10G); each thread running matmuls holds one.
    assert (LARGE_DEFAULT, SMALL_DEFAULT) == (33554432, 8519680)
    assert blas_workspace("cuda", "9.0", {}).held == 2 * 33554432
    assert blas_workspace("cuda", "8.9", {}).held == 2 * 8519680
    # 11 MiB: a 12 MiB segment of its own, whose 1 MiB left over is not split off: 12 MiB counted
    assert blas_workspace("cuda", "9.0", {"CUBLAS_WORKSPACE_CONFIG": ":11264:1"}).held == 2 * 12 * MIB
    assert blas_workspace("cuda", "9.0", {}, threads=1).held == 33554432
    assert "default for compute capability 9.0" in blas_workspace("cuda", "9.0", {}).why
    assert "CUBLAS_WORKSPACE_CONFIG=:16:8" in blas_workspace("cuda", "9.0", {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}).why


@pytest.mark.parametrize("environ, cublaslt", [
    pytest.param({"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "1", "CUBLASLT_WORKSPACE_SIZE": "4096"}, 0, id="unified"),
    pytest.param({"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "0"}, MIB, id="separate-default"),
    pytest.param({"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "0", "CUBLASLT_WORKSPACE_SIZE": "4096"}, 4 * MIB, id="sized"),
    pytest.param({"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "0", "CUBLASLT_WORKSPACE_SIZE": " 64KiB"}, 64 * KIB,
                 id="leading-digits"),
    pytest.param({"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "0", "CUBLASLT_WORKSPACE_SIZE": "big"}, MIB, id="invalid"),
    pytest.param({"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "0", "CUBLASLT_WORKSPACE_SIZE": "9" * 12}, MIB,
                 id="out-of-range"),
])
def test_a_separate_cublaslt_workspace_adds_its_own(environ, cublaslt):
    workspace = blas_workspace("cuda", "9.0", environ)
    assert workspace.cublaslt == cublaslt
    assert workspace.held == 2 * (32 * MIB + cublaslt)


def test_a_cpu_or_an_unknown_architecture_holds_none():
    assert blas_workspace("cpu", None, {}).held == 0
    unknown = blas_workspace("cuda", None, {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"})
    assert unknown.held == 0 and "no compute_capability" in unknown.why


def test_what_pytorch_fails_on_is_refused_in_one_line():
    message = raises_one_line(blas_workspace, "cuda", "9.0", {"CUBLAS_WORKSPACE_CONFIG": ":99999999999999999999:1"})
    assert "CUBLAS_WORKSPACE_CONFIG" in message and "out of range" in message
    message = raises_one_line(blas_workspace, "cuda", "9.0", {"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "0",
                                                             "CUBLASLT_WORKSPACE_SIZE": "-5"})
    assert "CUBLASLT_WORKSPACE_SIZE" in message and "negative" in message
