"""What the format tests share: a tiny three-stage chain, mutations that set or delete one field of a document,
and operations written as text (the rotor plan they share is the fixture ``rotor_plan`` in conftest.py; the
one-line error check is checks.py's)."""

import copy

from planner.ops import Op

BASE_CHAIN = {
    "format": "memsched.chain/1",
    "name": "tiny",
    "device": "cpu",
    "input_bytes": 1000,
    "stages": [
        {"name": "conv1", "fwd_time": 0.01, "bwd_time": 0.02, "out_bytes": 2000, "saved_bytes": 5000,
         "fwd_tmp_bytes": 100, "bwd_tmp_bytes": 200, "param_bytes": 300},
        {"name": "conv2", "fwd_time": 0.015, "bwd_time": 0.03, "out_bytes": 1500, "saved_bytes": 4000,
         "fwd_tmp_bytes": 50, "bwd_tmp_bytes": 60, "param_bytes": 70},
        {"name": "fc", "fwd_time": 0.005, "bwd_time": 0.011, "out_bytes": 400, "saved_bytes": 900,
         "fwd_tmp_bytes": 7, "bwd_tmp_bytes": 8, "param_bytes": 9},
    ],
    "loss": {"bwd_time": 0.001, "tmp_bytes": 10},
}


def base_chain() -> dict:
    return copy.deepcopy(BASE_CHAIN)


def write_text(path, text: str):
    path.write_text(text)
    return path


def set_at(*keys_and_value):
    *keys, value = keys_and_value

    def mutate(data):
        target = data
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value
    return mutate


def delete_at(*keys):
    def mutate(data):
        target = data
        for key in keys[:-1]:
            target = target[key]
        del target[keys[-1]]
    return mutate


def ops(text):
    """``"F_all 0, Offload 0 saved, Loss"`` as operations."""
    out = []
    for word in text.split(","):
        parts = word.split()
        out.append(Op(parts[0], *(int(parts[1]),) if len(parts) > 1 else (), *parts[2:]))
    return out
