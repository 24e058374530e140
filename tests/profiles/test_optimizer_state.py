"""The resident state of the low-precision setups, measured against the optimizers themselves on this CPU:
bitsandbytes' 8-bit AdamW (its uint8 states, block-wise absmax and fp32 fallback for small tensors) and
torchtune's pure-bf16 full fine-tune (a bf16 model under torch's AdamW: bf16 states, no master copy)."""

import pytest
import torch
from torch import nn

from planner.setup import TrainingSetup
from planner.setup.training import device_sizes, resident_parts_on_device
from profiles.chain_profiler import profile_chain

bitsandbytes = pytest.importorskip("bitsandbytes")


def model_and_batch(dtype=torch.float32):
    """Weights of 6464 elements (above bitsandbytes' 4096-element threshold: 25 blocks of 256 and a part), 3030 and
    600 (below it), biases of 101 and 30, as a chain of three stages."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 101), nn.Tanh(), nn.Linear(101, 30), nn.Tanh(),
                          nn.Linear(30, 20, bias=False)).to(dtype)
    return model, torch.randn(16, 64, dtype=dtype)


def chain_of(model, x):
    stages = [nn.Sequential(*model[:2]), nn.Sequential(*model[2:4]), model[4]]
    return profile_chain(stages, x, warmup=0, repeats=1, options=0)


def state_bytes(optimizer) -> int:
    """Bytes of the optimizer's state tensors, each storage once (bitsandbytes' maps are shared), torch's per-tensor
    ``step`` counter left out (a CPU scalar beside a device's parameters unless fused or capturable)."""
    storages = {}
    for state in optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value) and key != "step":
                storages[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
    return sum(storages.values())


def stepped(optimizer, model, x):
    model(x).float().square().mean().backward()
    optimizer.step()
    return optimizer


def test_eight_bit_adam_is_sized_as_bitsandbytes_allocates_it():
    model, x = model_and_batch()
    chain = chain_of(model, x)
    measured = state_bytes(stepped(bitsandbytes.optim.AdamW8bit(model.parameters()), model, x))
    setup = TrainingSetup("adam8bit")
    # the 6464-element weight: two uint8 states and 26 fp32 absmax each; the rest two fp32 states; the two maps once
    assert measured == 2 * (6464 + 4 * 26) + 2 * 4 * (101 + 3030 + 30 + 600) + 2 * 256 * 4
    assert resident_parts_on_device(chain, setup)["optimizer"] == device_sizes(chain, setup)["optimizer"] == measured
    # the per-parameter rate alone (2 + 8/256 bytes each) is 2.2x short of it: most tensors here are small
    assert setup.breakdown(sum(p.numel() for p in model.parameters()))["optimizer"] * 2.1 < measured


def test_pure_bf16_keeps_bf16_parameters_gradients_and_states_and_no_master_copy():
    model, x = model_and_batch(torch.bfloat16)
    chain = chain_of(model, x)
    optimizer = stepped(torch.optim.AdamW(model.parameters()), model, x)
    parameters = list(model.parameters())
    setup = TrainingSetup("adamw", "pure-bf16")
    sizes = device_sizes(chain, setup)
    assert sizes["params"] == sum(p.untyped_storage().nbytes() for p in parameters)
    assert sizes["grads"] == sum(p.grad.untyped_storage().nbytes() for p in parameters)
    assert sizes["optimizer"] == state_bytes(optimizer) and sizes["master"] == 0
    assert sizes["optimizer"] == 2 * sizes["params"]  # two bf16 states
