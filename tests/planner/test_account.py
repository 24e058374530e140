"""planner/setup/account.py: the one sum of a device's memory for a step, and everything that reads it: the
budget a device leaves, the least device memory, and a device plan's predicted peak agree part for part."""

import dataclasses

from planner.chain import Chain
from planner.devices import DEVICES
from planner.layout import ParameterRows
from planner.setup import TrainingSetup, account
from planner.setup.account import activation_budget
from profiles.device_plan import judged
from profiles.estimate import Estimate
from solvers.budgets import least_budget, least_device_memory

H100 = DEVICES["h100-80gb"]


def bf16_chain() -> Chain:
    """Two stages of a model built in bf16: 2-byte gradients, 100 + 400 parameters of 2 bytes."""
    chain = Chain.from_dict({
        "format": "memsched.chain/1", "input_bytes": 1000, "loss": {},
        "stages": [{"fwd_time": 1, "bwd_time": 2, "out_bytes": 100, "saved_bytes": 300, "param_bytes": p}
                   for p in (200, 800)]})
    return dataclasses.replace(chain, layout=((ParameterRows(100, 2, "trainable", 2),),
                                              (ParameterRows(400, 2, "trainable", 2),)))


def test_the_account_adds_the_workspace_the_resident_state_the_extra_gradients_and_the_step():
    chain, fp32 = bf16_chain(), TrainingSetup("adam")  # fp32 Adam over a bf16 model: fp32 gradients, 1000 B more
    held = account(chain, fp32, H100, step=5000)
    assert held == (64 << 20, 500 * 12, 500 * 4 - 1000, 5000)  # H100: two 32 MiB cuBLAS workspaces
    assert held.total == (64 << 20) + 6000 + 1000 + 5000 and held.beside_step == held.total - 5000
    assert account(chain, fp32) == (0, 6000, 1000, 0)  # no device: no workspace
    # what a device leaves for the step is its memory (less its workspaces) less what the account holds beside it
    assert activation_budget(chain, fp32, 100_000) == 100_000 - account(chain, fp32).beside_step
    assert least_device_memory(chain, fp32) == account(chain, fp32, step=least_budget(chain, fp32)).total


def test_a_device_plans_peak_counts_the_gradients_beyond_the_chains():
    chain, fp32 = bf16_chain(), TrainingSetup("adam")
    chosen = judged(Estimate("bf16", 500, chain), 1, 1, H100, fp32)
    assert chosen.peak == account(chain, fp32, H100, chosen.plan.predicted.peak_bytes).total
    assert chosen.peak - chosen.plan.predicted.peak_bytes == (64 << 20) + 6000 + 1000  # the 1000 was left out
