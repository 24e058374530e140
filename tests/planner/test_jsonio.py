"""Reading and writing files (planner/jsonio.py): JSON refused in one line, atomic writes, file modes."""

import json
import os
import stat

import pytest

import planner
import planner.jsonio
from checks import one_line
from format_cases import base_chain, write_text
from planner import MemschedError, load_chain, save_chain, save_plan
from profiles.synthetic import random_chain


@pytest.mark.parametrize("text, fragments", [
    pytest.param('[{"format": "memsched.chain/1"}]', ["JSON object", "list"], id="top-level-array"),
    pytest.param('"memsched.chain/1"', ["JSON object", "str"], id="top-level-string"),
    pytest.param('{"format": "memsched.chain/1",\n "input_bytes": 10,\n "stages": [}\n', ["not valid JSON", "line 3",
                                                                                        "column"], id="malformed-json"),
    pytest.param('{"format": "memsched.chain/1", "input_bytes": 10,', ["not valid JSON", "line 1", "column"],
                 id="truncated-json"),
    pytest.param("", ["not valid JSON", "line 1", "column 1"], id="empty-file"),
])
def test_unreadable_chain_file(tmp_path, text, fragments):
    path = write_text(tmp_path / "bad.chain.json", text)
    with pytest.raises(MemschedError) as excinfo:
        load_chain(path)
    one_line(excinfo, str(path), *fragments)


def test_missing_chain_file(tmp_path):
    with pytest.raises(MemschedError) as excinfo:
        load_chain(tmp_path / "absent.chain.json")
    one_line(excinfo, "absent.chain.json", "no such file")


def test_duplicate_keys_are_refused(tmp_path):
    path = tmp_path / "dup.json"
    path.write_text('{"format": "memsched.chain/1", "input_bytes": 1, "input_bytes": 2, "stages": []}')
    with pytest.raises(MemschedError) as excinfo:
        load_chain(path)
    one_line(excinfo, "input_bytes", "twice")


def test_a_utf8_byte_order_mark_is_skipped(tmp_path):
    path = tmp_path / "bom.chain.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(base_chain()).encode())
    assert load_chain(path).name == "tiny"


def test_write_replaces_existing_file_whole(rotor_plan, tmp_path):
    chain, plan = rotor_plan
    path = tmp_path / "out.json"
    path.write_text("x" * 200_000)  # longer than what replaces it: no tail may survive
    save_plan(plan, path)
    assert json.loads(path.read_text()) == json.loads(json.dumps(plan.to_dict()))
    assert sorted(os.listdir(tmp_path)) == ["out.json"]
    save_chain(chain, path)  # and once more, a different (shorter) document over it
    assert load_chain(path) == chain
    assert path.read_text().endswith("}\n")
    assert sorted(os.listdir(tmp_path)) == ["out.json"]


def test_write_json_atomic_leaves_no_temp_files(tmp_path):
    target = tmp_path / "data.json"
    for round_ in range(3):
        planner.jsonio.write_json_atomic(target, {"round": round_, "values": list(range(round_))})
        assert sorted(os.listdir(tmp_path)) == ["data.json"]
        assert json.loads(target.read_text()) == {"round": round_, "values": list(range(round_))}


def test_save_chain_and_plan_leave_no_temp_files(rotor_plan, tmp_path):
    chain, plan = rotor_plan
    save_chain(chain, tmp_path / "c.json")
    save_plan(plan, tmp_path / "p.json")
    save_plan(plan, str(tmp_path / "p.json"))
    assert sorted(os.listdir(tmp_path)) == ["c.json", "p.json"]


@pytest.mark.parametrize("error", [RuntimeError("disk full"), KeyboardInterrupt()], ids=["RuntimeError",
                                                                                         "KeyboardInterrupt"])
def test_failed_serialisation_keeps_old_file(rotor_plan, tmp_path, monkeypatch, error):
    chain, plan = rotor_plan
    path = tmp_path / "plan.json"
    save_chain(chain, path)
    before = path.read_bytes()

    def broken_dump(obj, handle, **kwargs):
        handle.write('{"format": "memsched.plan/1", "kind": "ch')
        handle.flush()
        raise error

    monkeypatch.setattr(planner.jsonio.json, "dump", broken_dump)
    with pytest.raises(type(error)):
        save_plan(plan, path)
    with pytest.raises(type(error)):
        save_chain(chain, path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert load_chain(path) == chain
    assert sorted(os.listdir(tmp_path)) == ["plan.json"]


def test_failed_first_write_leaves_nothing(rotor_plan, tmp_path, monkeypatch):
    _, plan = rotor_plan

    def broken_dump(obj, handle, **kwargs):
        handle.write("{")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(planner.jsonio.json, "dump", broken_dump)
    with pytest.raises(MemschedError) as excinfo:  # a full disk is the user's to fix: one line, no traceback
        save_plan(plan, tmp_path / "plan.json")
    one_line(excinfo, "plan.json", "No space left on device")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)],
                         ids=["umask022", "umask077", "umask002"])
def test_written_file_mode_follows_umask(rotor_plan, tmp_path, umask, mode):
    chain, plan = rotor_plan
    old = os.umask(umask)
    try:
        save_plan(plan, tmp_path / "plan.json")
        save_chain(chain, tmp_path / "chain.json")
        existing = tmp_path / "existing.json"
        existing.write_text("{}")
        existing.chmod(0o600 if mode != 0o600 else 0o644)
        save_chain(chain, existing)  # a new file replaces the old: it gets the umask's mode
    finally:
        os.umask(old)
    for name in ("plan.json", "chain.json", "existing.json"):
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == mode, name


def test_missing_output_folder(rotor_plan, tmp_path):
    chain, plan = rotor_plan
    with pytest.raises(MemschedError) as excinfo:
        save_plan(plan, tmp_path / "no" / "such" / "plan.json")
    one_line(excinfo, "does not exist")
    with pytest.raises(MemschedError) as excinfo:
        save_chain(chain, tmp_path / "missing" / "chain.json")
    one_line(excinfo, "missing", "does not exist")
    assert os.listdir(tmp_path) == []


def test_saving_onto_a_folder_is_a_clear_error(tmp_path):
    (tmp_path / "taken").mkdir()
    with pytest.raises(MemschedError) as excinfo:
        save_chain(random_chain(3, seed=0), tmp_path / "taken")
    one_line(excinfo, "taken", "cannot write")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]
