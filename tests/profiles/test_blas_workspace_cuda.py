"""On a CUDA device, when there is one: a training step leaves allocated exactly the cuBLAS workspaces
planner/blas_workspace.py predicts for the device's compute capability (the forward's thread's and autograd's)."""

import pytest
import torch
from torch import nn

from planner.blas_workspace import blas_workspace


@pytest.mark.skipif(not torch.cuda.is_available(), reason="measures a CUDA device's cuBLAS workspaces")
def test_a_training_step_holds_the_predicted_cublas_workspaces():
    torch.manual_seed(0)
    layer = nn.Linear(256, 256, device="cuda")  # with a bias: addmm, cuBLASLt's path
    x = torch.randn(64, 256, device="cuda", requires_grad=True)
    for tensor in (layer.weight, layer.bias, x):  # gradients made beforehand: the step adds into them
        tensor.grad = torch.zeros_like(tensor)
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()  # as in a fresh process
    before = torch.cuda.memory_allocated()
    layer(x).square().sum().backward()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    major, minor = torch.cuda.get_device_capability()
    assert held == blas_workspace("cuda", f"{major}.{minor}").held, (torch.cuda.get_device_name(), held)
