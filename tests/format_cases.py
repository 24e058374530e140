"""What the format tests share: a tiny three-stage chain, the assertion that an error is one line, and
mutations that set or delete one field of a document (the rotor plan they share is the fixture ``rotor_plan``
in conftest.py)."""

import copy

from planner import MemschedError

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


def assert_one_line(excinfo, *fragments) -> str:
    """The error is a MemschedError with a non-empty one-line message containing every fragment."""
    message = str(excinfo.value)
    assert isinstance(excinfo.value, MemschedError)
    assert message.strip(), "empty error message"
    assert "\n" not in message and "\r" not in message, f"message spans lines: {message!r}"
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


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
