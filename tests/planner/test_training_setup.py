"""planner/setup/training.py: bytes per parameter, ZeRO sharding and the activation budget, by hand."""

import dataclasses

import pytest

from checks import one_line
from planner.chain import Chain
from planner.errors import MemschedError
from planner.layout import ParameterRows
from planner.setup.account import activation_budget
from planner.setup.training import (
    OPTIMIZERS,
    PRECISIONS,
    TrainingSetup,
    device_sizes,
    optimizer_state_bytes,
    parameters_of,
    resident_parts_on_device,
)

# (params, grads, master) by precision; optimizer state by optimizer; unsharded bytes per parameter.
PRECISION_TABLE = {"fp32": (4, 4, 0), "bf16": (2, 2, 4), "fp16": (2, 2, 4), "pure-bf16": (2, 2, 0)}
OPTIMIZER_TABLE = {"sgd": 0, "momentum": 4, "adam": 8, "adamw": 8, "adam8bit": 2 + 2 * 4 / 256}  # adam8bit: 2.03125
PURE_BF16_OPTIMIZER = {"sgd": 0, "momentum": 2, "adam": 4, "adamw": 4, "adam8bit": 2 + 2 * 4 / 256}  # bf16 states


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_bytes_per_parameter_table(optimizer, precision):
    setup = TrainingSetup(optimizer=optimizer, precision=precision)
    params, grads, master = PRECISION_TABLE[precision]
    state = (PURE_BF16_OPTIMIZER if precision == "pure-bf16" else OPTIMIZER_TABLE)[optimizer]
    expected = {"params": params, "grads": grads, "master": master, "optimizer": state}
    assert setup.per_parameter() == expected
    sizes = setup.breakdown(1024)  # 1024 parameters: whole bytes for every entry, adam8bit's 2.03125 included
    assert sizes == {item: int(value * 1024) for item, value in expected.items()}
    assert setup.resident_bytes(1024) == (params + master + state) * 1024
    assert setup.gradient_bytes(1024) == grads * 1024


def test_mixed_precision_adam_is_16_bytes_per_parameter_as_in_the_paper():
    for precision in ("bf16", "fp16"):
        setup = TrainingSetup("adam", precision)
        assert sum(setup.per_parameter().values()) == 16
        assert setup.per_parameter()["master"] + setup.per_parameter()["optimizer"] == 12  # the paper's K
    assert sum(TrainingSetup("adam", "fp32").per_parameter().values()) == 16  # 4 + 4 + 8: no master copy
    assert sum(TrainingSetup("sgd", "fp32").per_parameter().values()) == 8


@pytest.mark.parametrize("zero, expected", [
    (0, {"params": 2, "grads": 2, "master": 4, "optimizer": 8}),
    (1, {"params": 2, "grads": 2, "master": 0.5, "optimizer": 1}),          # optimizer state and master copy / 8
    (2, {"params": 2, "grads": 0.25, "master": 0.5, "optimizer": 1}),       # + gradients / 8
    (3, {"params": 0.25, "grads": 0.25, "master": 0.5, "optimizer": 1}),    # + parameters / 8
])
def test_zero_stages_shard_over_eight_ranks(zero, expected):
    setup = TrainingSetup("adam", "bf16", zero=zero, dp=8)
    assert setup.per_parameter() == expected
    parameters = 10**6
    assert setup.breakdown(parameters) == {item: int(value * parameters) for item, value in expected.items()}
    assert setup.resident_bytes(parameters) == int((expected["params"] + expected["master"] + expected["optimizer"])
                                                   * parameters)
    assert setup.gradient_bytes(parameters) == int(expected["grads"] * parameters)


def test_zero_stages_in_fp32_with_momentum():
    # fp32 has no master copy: stage 1 shards the momentum buffer only.
    assert TrainingSetup("momentum", "fp32", 1, 8).per_parameter() == {"params": 4, "grads": 4, "master": 0,
                                                                      "optimizer": 0.5}
    assert TrainingSetup("momentum", "fp32", 3, 8).breakdown(800) == {"params": 400, "grads": 400, "master": 0,
                                                                     "optimizer": 400}


@pytest.mark.parametrize("zero, gigabytes", [(0, 120), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_the_zero_papers_figure_1(zero, gigabytes):
    """Rajbhandari et al. (SC 2020), Figure 1: Ψ = 7.5B, K = 12, Nd = 64, mixed-precision Adam."""
    setup = TrainingSetup("adam", "fp16", zero=zero, dp=64)
    psi = 7_500_000_000
    total = setup.resident_bytes(psi) + setup.gradient_bytes(psi)
    exact = {0: 16 * psi, 1: 4 * psi + 12 * psi // 64, 2: 2 * psi + 14 * psi // 64, 3: 16 * psi // 64}[zero]
    assert total == exact  # 120e9, 31.40625e9, 16.640625e9, 1.875e9
    assert round(total / 1e9, 1) == gigabytes


def test_pure_bf16_keeps_no_master_copy_and_its_optimizer_state_in_bf16():
    setup = TrainingSetup("adamw", "pure-bf16")
    assert sum(setup.per_parameter().values()) == 8  # torchtune's full fine-tune: 2 + 2 + 0 + 4
    assert setup.describe().startswith("adamw, bf16 parameters, gradients and optimizer state (no master copy)")
    with pytest.raises(MemschedError) as caught:
        TrainingSetup("adam", "pure-bf16", update="on-host")
    one_line(caught, "pure-bf16", "on-host", "fp32 master copy")


def test_eight_bit_adam_counts_each_tensor_as_bitsandbytes_allocates_it():
    # fewer than 4096 elements: two fp32 states; else two uint8 states and an fp32 absmax per 256 elements each,
    # and the two quantisation maps of 256 fp32 once
    elements = [100, 4095, 4096, 5000]
    expected = 2 * 4 * (100 + 4095) + 2 * (4096 + 4 * 16) + 2 * (5000 + 4 * 20) + 2 * 256 * 4
    assert optimizer_state_bytes(TrainingSetup("adam8bit"), elements) == expected == 54_088
    assert optimizer_state_bytes(TrainingSetup("adam8bit"), [100]) == 800  # no map without an 8-bit tensor
    assert optimizer_state_bytes(TrainingSetup("adam", "pure-bf16"), elements) == 4 * sum(elements)
    layout = ((ParameterRows(50, 1600, "trainable"), ParameterRows(1, 400, "trainable")),  # 20 000 and 100 elements
              (ParameterRows(4095, 4, "trainable"), ParameterRows(8, 4096, "frozen")))
    chain = dataclasses.replace(_chain([80_400, 16_380]), layout=layout)
    exact = 2 * (20_000 + 4 * 79) + 2 * 4 * (100 + 4095) + 2 * 256 * 4
    assert device_sizes(chain, TrainingSetup("adam8bit"))["optimizer"] == exact
    assert resident_parts_on_device(chain, TrainingSetup("adam8bit"))["optimizer"] == exact


def test_fractional_bytes_round_up_per_item():
    setup = TrainingSetup("adam", "bf16", zero=3, dp=3)
    assert setup.breakdown(10) == {"params": 7, "grads": 7, "master": 14, "optimizer": 27}  # 20/3, 20/3, 40/3, 80/3
    assert setup.resident_bytes(10) == 7 + 14 + 27
    assert TrainingSetup("adam8bit").breakdown(1) == {"params": 4, "grads": 4, "master": 0, "optimizer": 3}
    assert TrainingSetup("adam8bit").breakdown(256) == {"params": 1024, "grads": 1024, "master": 0, "optimizer": 520}


@pytest.mark.parametrize("fields, words", [
    ({"optimizer": "lamb"}, ["optimizer", "'lamb'", "sgd, momentum, adam, adamw, adam8bit"]),
    ({"precision": "fp8"}, ["precision", "'fp8'", "fp32, bf16, fp16"]),
    ({"zero": 4}, ["zero", "0, 1, 2 or 3", "4"]),
    ({"zero": -1}, ["zero", "-1"]),
    ({"zero": 1.0}, ["zero", "1.0"]),
    ({"dp": 0}, ["dp", "from 1 to 262144", "0"]),
    ({"dp": 10**9}, ["dp", "from 1 to 262144", "1000000000"]),
    ({"update": "later"}, ["update", "'later'", "after, in-backward, on-host"]),
])
def test_invalid_setups_are_refused_in_one_line(fields, words):
    with pytest.raises(MemschedError) as caught:
        TrainingSetup(**fields)
    one_line(caught, *words)


def test_zero_without_ranks_is_allowed_and_changes_nothing():
    assert TrainingSetup("adam", "bf16", zero=3, dp=1).breakdown(100) == TrainingSetup("adam", "bf16").breakdown(100)


def _chain(param_bytes, input_bytes=1000):
    return Chain.from_dict({
        "format": "memsched.chain/1", "input_bytes": input_bytes, "loss": {},
        "stages": [{"fwd_time": 1, "bwd_time": 2, "out_bytes": 100, "saved_bytes": 300, "param_bytes": p}
                   for p in param_bytes]})


def test_parameters_of_a_chain_are_its_fp32_gradient_bytes_over_four():
    assert parameters_of(_chain([400, 800])) == 300
    assert parameters_of(_chain([0, 0])) == 0
    assert parameters_of(_chain([401])) == 101  # not a whole number of fp32 values: rounded up


def test_a_chain_of_a_model_built_in_bf16_counts_its_parameters_from_its_layouts_element_size():
    # 2-byte gradients (param_bytes 400 + 800): 600 parameters, not 300; bf16 Adam keeps 14 bytes each.
    bf16 = dataclasses.replace(_chain([400, 800]), layout=((ParameterRows(100, 4, "trainable", 2),),
                                                          (ParameterRows(400, 2, "trainable", 2),)))
    assert parameters_of(bf16) == 600
    assert activation_budget(bf16, TrainingSetup("adam", "bf16"), 10_000) == 10_000 - 600 * 14
    # fp32 gradients for a bf16 model: 1200 bytes beyond the chain's are taken off too.
    assert activation_budget(bf16, TrainingSetup("adam"), 20_000) == 20_000 - 600 * 12 - 1200
    # A frozen bf16 base under fp32 adapters (LoRA): only the trainable parameters' element size counts.
    lora = dataclasses.replace(_chain([400, 800]), layout=((ParameterRows(1000, 2, "frozen", 2),
                                                           ParameterRows(100, 4, "trainable"),),
                                                          (ParameterRows(200, 4, "trainable"),)))
    assert parameters_of(lora) == 300
    # The layout's JSON: the element size written only when not 4 (an fp32 chain hashes as before), read back.
    again = Chain.from_dict(bf16.to_dict())
    assert again.layout == bf16.layout and bf16.to_dict()["layout"][0] == [[100, 4, "trainable", 2]]
    assert lora.to_dict()["layout"][1] == [[200, 4, "trainable"]]
    broken = bf16.to_dict()
    broken["layout"][0][0][3] = 3
    with pytest.raises(MemschedError, match=r"layout\[0\]\[0\] must be .* element_bytes 1, 2, 4 or 8"):
        Chain.from_dict(broken)


def test_activation_budget_by_hand():
    chain = _chain([400, 800])  # 300 parameters, 1200 bytes of fp32 gradients counted by the chain
    # fp32 Adam, one device: resident 300 * (4 + 8) = 3600; the setup's gradients are the chain's.
    assert activation_budget(chain, TrainingSetup("adam"), 10_000) == 10_000 - 3600
    # SGD: only the parameters are resident.
    assert activation_budget(chain, TrainingSetup("sgd"), 10_000) == 10_000 - 1200
    # bf16 Adam, ZeRO 2 or 3 over 4 ranks (FSDP2 keeps shards between steps): a rank keeps 25 + 50 parameters (a
    # quarter of the rows of 4 bytes): 75 * (2 + 4 + 8) = 1050; without a layout, refused.
    laid_out = dataclasses.replace(chain, layout=((ParameterRows(100, 4, "trainable"),),
                                                  (ParameterRows(200, 4, "trainable"),)))
    for zero in (2, 3):
        assert activation_budget(laid_out, TrainingSetup("adam", "bf16", zero, 4), 10_000) == 10_000 - 1050
        with pytest.raises(MemschedError, match="records no parameter layout"):
            activation_budget(chain, TrainingSetup("adam", "bf16", zero, 4), 10_000)
    # 401 bytes of gradients = 101 parameters, whose fp32 gradients are 404: the 3 extra bytes are subtracted.
    assert activation_budget(_chain([401]), TrainingSetup("sgd"), 10_000) == 10_000 - 404 - 3


def test_no_memory_left_is_one_line_naming_the_numbers():
    chain = _chain([400, 800])
    with pytest.raises(MemschedError) as caught:
        activation_budget(chain, TrainingSetup("adam"), 3600)
    one_line(caught, "3600", "300 parameters")
    assert activation_budget(chain, TrainingSetup("adam"), 3601) == 1
    with pytest.raises(MemschedError, match="device memory"):
        activation_budget(chain, TrainingSetup("adam"), 0)


