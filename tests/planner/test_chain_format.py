"""The chain format ``memsched.chain/1`` (planner/chain.py): loading, defaults, validation, bounds and the
fingerprint."""

import json
import math
import re

import pytest

from checks import one_line
from format_cases import BASE_CHAIN, base_chain, delete_at, set_at, write_text
from planner import Chain, Loss, MemschedError, load_chain, save_chain
from planner.validate import MAX_BYTES, MAX_SECONDS
from profiles.synthetic import random_chain

STAGE_FIELDS = ("name", "fwd_time", "bwd_time", "out_bytes", "saved_bytes", "fwd_tmp_bytes", "bwd_tmp_bytes",
                "param_bytes")


def test_chain_round_trips_through_dict_and_file(tmp_path):
    chain = Chain.from_dict(base_chain())
    assert Chain.from_dict(chain.to_dict()) == chain
    save_chain(chain, tmp_path / "tiny.chain.json")
    loaded = load_chain(tmp_path / "tiny.chain.json")
    assert loaded == chain
    assert loaded.to_dict() == chain.to_dict()
    expected = base_chain()  # the file's every field survives unchanged; the optional one is written out
    for stage in expected["stages"]:
        stage["nograd_tmp_bytes"] = stage["fwd_tmp_bytes"]
    assert chain.to_dict() == expected


def test_synthetic_chain_round_trips(tmp_path):
    chain = random_chain(8, seed=3, tmp=True, params=True)
    assert Chain.from_dict(chain.to_dict()) == chain
    save_chain(chain, tmp_path / "c.json")
    assert load_chain(str(tmp_path / "c.json")) == chain  # a str path works as well as a Path


def test_chain_defaults():
    chain = Chain.from_dict({
        "format": "memsched.chain/1",
        "input_bytes": 64,
        "stages": [{"fwd_time": 1, "bwd_time": 2, "out_bytes": 8, "saved_bytes": 8},
                   {"fwd_time": 0.5, "bwd_time": 0.5, "out_bytes": 4, "saved_bytes": 16}],
    })
    assert chain.name == "chain"
    assert chain.device == "unknown"
    assert chain.loss == Loss(bwd_time=0.0, tmp_bytes=0)
    assert [s.name for s in chain.stages] == ["stage0", "stage1"]
    for stage in chain.stages:
        assert (stage.fwd_tmp_bytes, stage.bwd_tmp_bytes, stage.param_bytes) == (0, 0, 0)
    assert isinstance(chain.stages[0].fwd_time, float) and chain.stages[0].fwd_time == 1.0
    # defaults are written out explicitly: the dict is complete and round-trips
    assert set(chain.to_dict()) == {"format", "name", "device", "input_bytes", "stages", "loss"}
    assert Chain.from_dict(chain.to_dict()) == chain


def test_partial_loss_defaults():
    data = base_chain()
    data["loss"] = {"bwd_time": 0.25}
    assert Chain.from_dict(data).loss == Loss(bwd_time=0.25, tmp_bytes=0)
    data["loss"] = {}
    assert Chain.from_dict(data).loss == Loss()


def test_loss_saved_bytes_is_optional_and_written_only_when_set():
    data = base_chain()
    data["loss"]["saved_bytes"] = 24
    chain = Chain.from_dict(data)
    assert chain.loss.saved_bytes == 24 and chain.to_dict()["loss"] == data["loss"]
    assert chain.fingerprint() != Chain.from_dict(base_chain()).fingerprint()
    data["loss"]["saved_bytes"] = 0  # the default: left out, so older chains read, write and hash as before
    assert Chain.from_dict(data).to_dict()["loss"] == BASE_CHAIN["loss"]


def test_integral_float_bytes_accepted(tmp_path):
    data = base_chain()
    data["input_bytes"] = 5e5
    data["stages"][0]["out_bytes"] = 1e6
    data["stages"][0]["saved_bytes"] = 2e6
    data["loss"]["tmp_bytes"] = 3.0
    path = write_text(tmp_path / "c.json", json.dumps(data))
    chain = load_chain(path)
    assert chain.input_bytes == 500000 and type(chain.input_bytes) is int
    assert chain.stages[0].out_bytes == 1000000 and type(chain.stages[0].out_bytes) is int
    assert chain.stages[0].saved_bytes == 2000000 and type(chain.stages[0].saved_bytes) is int
    assert chain.loss.tmp_bytes == 3 and type(chain.loss.tmp_bytes) is int
    # and the chain is the same problem as the one written with integers
    as_ints = base_chain()
    as_ints["input_bytes"] = 500000
    as_ints["stages"][0]["out_bytes"] = 1000000
    as_ints["stages"][0]["saved_bytes"] = 2000000
    as_ints["loss"]["tmp_bytes"] = 3
    assert Chain.from_dict(as_ints) == chain
    assert Chain.from_dict(as_ints).fingerprint() == chain.fingerprint()


def _rename(stage, old, new):
    def mutate(data):
        data["stages"][stage][new] = data["stages"][stage].pop(old)
    return mutate


INVALID_CHAINS = [
    pytest.param(set_at("stages", 1, "out_bytes", -1), ["stages[1]", "conv2", "out_bytes", "-1"],
                 id="negative-out_bytes"),
    pytest.param(set_at("stages", 0, "fwd_tmp_bytes", -5), ["stages[0]", "conv1", "fwd_tmp_bytes", "-5"],
                 id="negative-fwd_tmp_bytes"),
    pytest.param(set_at("stages", 2, "param_bytes", -1), ["stages[2]", "fc", "param_bytes"], id="negative-param_bytes"),
    pytest.param(set_at("input_bytes", -1), ["input_bytes", "-1"], id="negative-input_bytes"),
    pytest.param(set_at("stages", 2, "bwd_time", -0.5), ["stages[2]", "fc", "bwd_time", "-0.5"],
                 id="negative-bwd_time"),
    pytest.param(set_at("stages", 1, "fwd_time", float("nan")), ["stages[1]", "conv2", "fwd_time", "nan"],
                 id="nan-fwd_time"),
    pytest.param(set_at("stages", 0, "bwd_time", float("inf")), ["stages[0]", "conv1", "bwd_time", "inf"],
                 id="inf-bwd_time"),
    pytest.param(set_at("stages", 0, "fwd_time", float("-inf")), ["stages[0]", "conv1", "fwd_time"],
                 id="minus-inf-fwd_time"),
    pytest.param(set_at("stages", 1, "out_bytes", float("nan")), ["stages[1]", "conv2", "out_bytes"], id="nan-bytes"),
    pytest.param(set_at("stages", 1, "saved_bytes", float("inf")), ["stages[1]", "conv2", "saved_bytes"],
                 id="inf-bytes"),
    pytest.param(set_at("loss", "bwd_time", float("nan")), ["loss", "bwd_time"], id="nan-loss-bwd_time"),
    pytest.param(set_at("loss", "tmp_bytes", -3), ["loss", "tmp_bytes", "-3"], id="negative-loss-tmp_bytes"),
    pytest.param(set_at("loss", "saved_bytes", -1), ["loss", "saved_bytes", "-1"], id="negative-loss-saved_bytes"),
    pytest.param(set_at("stages", 1, "saved_bytes", 1.5), ["stages[1]", "conv2", "saved_bytes", "1.5"],
                 id="fractional-bytes"),
    pytest.param(set_at("input_bytes", 1000.5), ["input_bytes", "1000.5"], id="fractional-input_bytes"),
    pytest.param(set_at("stages", 0, "fwd_time", True), ["stages[0]", "conv1", "fwd_time", "True"], id="bool-time"),
    pytest.param(set_at("stages", 2, "out_bytes", False), ["stages[2]", "fc", "out_bytes", "False"], id="bool-bytes"),
    pytest.param(set_at("loss", "tmp_bytes", True), ["loss", "tmp_bytes"], id="bool-loss-tmp_bytes"),
    pytest.param(set_at("stages", 1, "bwd_time", "0.03"), ["stages[1]", "conv2", "bwd_time", "'0.03'"],
                 id="string-time"),
    pytest.param(set_at("stages", 0, "saved_bytes", "5000"), ["stages[0]", "conv1", "saved_bytes", "'5000'"],
                 id="string-bytes"),
    pytest.param(set_at("stages", 1, "out_bytes", None), ["stages[1]", "conv2", "out_bytes", "None"], id="null-bytes"),
    pytest.param(set_at("stages", 2, "saved_bytes", 399), ["stages[2]", "fc", "saved_bytes", "out_bytes", "399", "400"],
                 id="saved-below-out"),
    pytest.param(delete_at("stages", 0, "fwd_time"), ["stages[0]", "conv1", "fwd_time", "missing"],
                 id="missing-fwd_time"),
    pytest.param(delete_at("stages", 1, "out_bytes"), ["stages[1]", "conv2", "out_bytes", "missing"],
                 id="missing-out_bytes"),
    pytest.param(delete_at("stages", 2, "saved_bytes"), ["stages[2]", "fc", "saved_bytes", "missing"],
                 id="missing-saved_bytes"),
    pytest.param(delete_at("input_bytes"), ["input_bytes", "missing"], id="missing-input_bytes"),
    pytest.param(delete_at("stages"), ["stages", "missing"], id="missing-stages"),
    pytest.param(delete_at("format"), ["format", "missing"], id="missing-format"),
    pytest.param(set_at("stages", []), ["stages", "non-empty"], id="empty-stages"),
    pytest.param(set_at("stages", {"conv1": {}}), ["stages", "list"], id="stages-not-a-list"),
    pytest.param(set_at("stages", 1, [1, 2, 3]), ["stages[1]", "object"], id="stage-not-an-object"),
    pytest.param(_rename(0, "fwd_time", "fwd_tim"),
                 ["stages[0]", "fwd_tim", "known fields", "fwd_time", "bwd_time", "saved_bytes", "param_bytes"],
                 id="unknown-stage-field-typo"),
    pytest.param(set_at("stage", []), ["unknown field 'stage'", "known fields", "stages", "input_bytes"],
                 id="unknown-top-level-field"),
    pytest.param(set_at("loss", "tmp_byte", 3), ["loss", "tmp_byte", "known fields", "tmp_bytes", "bwd_time"],
                 id="unknown-loss-field"),
    pytest.param(set_at("loss", [0.1, 2]), ["loss", "object"], id="loss-not-an-object"),
    pytest.param(set_at("name", 7), ["name", "string"], id="name-not-a-string"),
    pytest.param(set_at("stages", 0, "name", 3), ["stages[0]", "name", "string"], id="stage-name-not-a-string"),
    pytest.param(set_at("format", "memsched.plan/1"), ["memsched.plan/1", "expected", "memsched.chain/1"],
                 id="plan-format-tag-in-a-chain"),
    pytest.param(set_at("format", "memsched.chain/2"), ["memsched.chain/2", "this memsched reads", "memsched.chain/1"],
                 id="unsupported-version"),
    pytest.param(set_at("format", 1), ["format", "memsched.chain/1"], id="format-not-a-string"),
]


@pytest.mark.parametrize("via", ["from_dict", "file"])
@pytest.mark.parametrize("mutate, fragments", INVALID_CHAINS)
def test_invalid_chain(tmp_path, via, mutate, fragments):
    data = base_chain()
    mutate(data)
    if via == "from_dict":
        with pytest.raises(MemschedError) as excinfo:
            Chain.from_dict(data)
    else:
        path = write_text(tmp_path / "bad.chain.json", json.dumps(data, indent=1))  # NaN / Infinity are allowed
        with pytest.raises(MemschedError) as excinfo:
            load_chain(path)
        fragments = [str(path)] + fragments  # the file is named
    one_line(excinfo, *fragments)


def test_chain_from_dict_rejects_non_object():
    with pytest.raises(MemschedError) as excinfo:
        Chain.from_dict([BASE_CHAIN])
    one_line(excinfo, "JSON object")


FINGERPRINT = re.compile(r"^sha256:[0-9a-f]{64}$")


def test_fingerprint_format_and_stability(tmp_path):
    chain = Chain.from_dict(base_chain())
    fingerprint = chain.fingerprint()
    assert FINGERPRINT.match(fingerprint), fingerprint
    assert chain.fingerprint() == fingerprint
    assert Chain.from_dict(base_chain()).fingerprint() == fingerprint
    save_chain(chain, tmp_path / "c.json")
    assert load_chain(tmp_path / "c.json").fingerprint() == fingerprint


def _reversed_keys(value):
    if isinstance(value, dict):
        return {key: _reversed_keys(value[key]) for key in reversed(list(value))}
    if isinstance(value, list):
        return [_reversed_keys(item) for item in value]
    return value


def test_fingerprint_ignores_key_order_and_layout(tmp_path):
    chain = Chain.from_dict(base_chain())
    shuffled = _reversed_keys(base_chain())
    assert list(shuffled) != list(BASE_CHAIN)
    path = write_text(tmp_path / "c.json", json.dumps(shuffled, separators=(",", ":")))
    assert load_chain(path).fingerprint() == chain.fingerprint()
    path = write_text(tmp_path / "d.json", json.dumps(shuffled, indent=7, sort_keys=True))
    assert load_chain(path).fingerprint() == chain.fingerprint()


def test_synthetic_fingerprint_stable_across_save_and_load(tmp_path):
    chain = random_chain(8, seed=3, tmp=True, params=True)
    save_chain(chain, tmp_path / "c.json")
    assert FINGERPRINT.match(chain.fingerprint())
    assert load_chain(tmp_path / "c.json").fingerprint() == chain.fingerprint()


def _bumped(field, value):
    if field == "name":
        return value + "_x"
    if isinstance(value, float):
        return value + 0.0005
    return value + 1


FINGERPRINT_CHANGES = (
    [pytest.param(("stages", i, field), id=f"stages[{i}].{field}") for i in (0, 2) for field in STAGE_FIELDS]
    + [pytest.param(("input_bytes",), id="input_bytes"),
       pytest.param(("loss", "bwd_time"), id="loss.bwd_time"),
       pytest.param(("loss", "tmp_bytes"), id="loss.tmp_bytes")]
)


@pytest.mark.parametrize("keys", FINGERPRINT_CHANGES)
def test_fingerprint_changes_with_each_field(keys):
    original = Chain.from_dict(base_chain())
    data = base_chain()
    target = data
    for key in keys[:-1]:
        target = target[key]
    target[keys[-1]] = _bumped(keys[-1], target[keys[-1]])
    changed = Chain.from_dict(data)
    assert changed != original
    assert FINGERPRINT.match(changed.fingerprint())
    assert changed.fingerprint() != original.fingerprint()


def test_fingerprints_of_all_single_field_changes_are_distinct():
    seen = {Chain.from_dict(base_chain()).fingerprint()}
    count = 1
    for param in FINGERPRINT_CHANGES:
        keys = param.values[0]
        data = base_chain()
        target = data
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = _bumped(keys[-1], target[keys[-1]])
        seen.add(Chain.from_dict(data).fingerprint())
        count += 1
    assert len(seen) == count


def test_sizes_and_times_at_their_bounds_are_read_and_beyond_them_refused():
    data = base_chain()
    others = data["loss"]["tmp_bytes"] + sum(stage[field] for stage in data["stages"] for field in stage
                                             if field.endswith("_bytes")) + sum(stage["fwd_tmp_bytes"]
                                                                                for stage in data["stages"])
    data["input_bytes"], data["stages"][0]["fwd_time"] = MAX_BYTES - others, MAX_SECONDS  # nograd_tmp: fwd_tmp's
    chain = Chain.from_dict(data)
    assert chain.input_bytes == MAX_BYTES - others and chain.stages[0].fwd_time == MAX_SECONDS
    data["input_bytes"] += 1  # the sizes now add up to one byte more than 1 EiB
    with pytest.raises(MemschedError) as excinfo:
        Chain.from_dict(data)
    one_line(excinfo, "add up", str(MAX_BYTES))
    for field, value, fragment in [("out_bytes", MAX_BYTES + 1, "out_bytes"),
                                   ("bwd_time", math.nextafter(MAX_SECONDS, math.inf), "more than a year")]:
        data = base_chain()
        data["stages"][1][field] = value
        with pytest.raises(MemschedError) as excinfo:
            Chain.from_dict(data)
        one_line(excinfo, "stages[1]", fragment)


@pytest.mark.parametrize("bandwidth, accepted", [(0, True), (1.0, True), (2.0**60, True), (0.5, False),
                                                 (2.0**61, False)])
def test_a_chain_channel_is_no_channel_or_one_a_device_can_have(bandwidth, accepted):
    data = {**base_chain(), "transfer": {"d2h_bandwidth": bandwidth, "h2d_bandwidth": 1e9}}
    if accepted:
        assert Chain.from_dict(data).transfer.d2h_bandwidth == bandwidth
    else:
        with pytest.raises(MemschedError) as excinfo:
            Chain.from_dict(data)
        one_line(excinfo, "transfer.d2h_bandwidth", "0 (no channel that way)")


def test_a_parameter_layout_round_trips_and_is_validated_in_one_line():
    """``layout`` (planner/layout.py): written only when recorded (older chains keep their fingerprints), read back
    as it was, part of the fingerprint, and a malformed one refused naming the entry."""
    raw = base_chain()
    plain = Chain.from_dict(raw)
    assert "layout" not in plain.to_dict()
    rows = [[[3, 8, "trainable"], [1, 4, "frozen"]]] + [[] for _ in raw["stages"][1:]]
    laid_out = Chain.from_dict(dict(raw, layout=rows))
    assert laid_out.to_dict()["layout"] == rows and Chain.from_dict(laid_out.to_dict()) == laid_out
    assert laid_out.layout[0][0].bytes == 24 and laid_out.fingerprint() != plain.fingerprint()
    for bad, where in (([[]], "layout must be a list with one list of parameters per stage"),
                       ([[[3, 8, "learned"]]] + rows[1:], "layout[0][0] must be [rows, row_bytes, kind]"),
                       ([[[3, -8, "shared"]]] + rows[1:], "layout[0][0]"),
                       ([[{"rows": 3}]] + rows[1:], "layout[0][0]")):
        with pytest.raises(MemschedError) as caught:
            Chain.from_dict(dict(raw, layout=bad))
        assert where in one_line(caught)
