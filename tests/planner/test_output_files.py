"""Output files (planner/jsonio.py): written atomically, and only over regular files or new names.

``-o /dev/full`` (a device), a FIFO or a folder is refused in one line before any work is done; a symbolic link stays a
link (what it points to is replaced); a failed write leaves the old file as it was.
"""

import os
import stat

import pytest

import cli
from checks import one_error_line
from planner import MemschedError, load_plan, save_chain
from planner.jsonio import output_path, write_json_atomic
from profiles.synthetic import random_chain

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def chain_file(tmp_path):
    path = tmp_path / "chain.json"
    save_chain(random_chain(6, seed=3), path)
    return str(path)


@pytest.fixture
def device(tmp_path):
    """A character device like ``/dev/full`` (1, 7) made in ``tmp_path``: a regression must not replace the real one."""
    path = tmp_path / "full"
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 7))
    except PermissionError:
        pytest.skip("making a device node needs root")
    return path


def test_a_device_is_refused_and_left_a_device(chain_file, device, capsys):
    status = cli.main(["solve", chain_file, "--budget", "60%", "-o", str(device)])
    line = one_error_line(status, *capsys.readouterr())
    assert str(device) in line and "not a regular file" in line
    assert stat.S_ISCHR(os.lstat(device).st_mode)


def test_a_fifo_is_refused_without_blocking(chain_file, tmp_path, capsys):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for argv in (["solve", chain_file, "--budget", "60%", "-o", str(fifo)],
                 ["pareto", chain_file, "--points", "2", "--plot", str(fifo)]):
        status = cli.main(argv)
        assert "not a regular file" in one_error_line(status, *capsys.readouterr())
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chain.json", "pipe"]  # no temporary file left


def test_a_folder_is_refused(chain_file, tmp_path, capsys):
    (tmp_path / "taken").mkdir()
    status = cli.main(["solve", chain_file, "--budget", "60%", "-o", str(tmp_path / "taken")])
    assert "a folder" in one_error_line(status, *capsys.readouterr())
    assert (tmp_path / "taken").is_dir()


def test_a_link_to_a_device_is_refused_and_names_both(device, tmp_path):
    link = tmp_path / "plan.json"
    link.symlink_to(device)
    with pytest.raises(MemschedError) as excinfo:
        write_json_atomic(link, {"a": 1})
    assert str(link) in str(excinfo.value) and str(device) in str(excinfo.value)
    assert link.is_symlink() and stat.S_ISCHR(os.lstat(device).st_mode)


def test_a_link_stays_a_link_and_its_target_is_replaced(chain_file, tmp_path, capsys):
    target = tmp_path / "real" / "plan.json"
    target.parent.mkdir()
    target.write_text("old")
    link = tmp_path / "plan.json"
    link.symlink_to(target)
    assert cli.main(["solve", chain_file, "--budget", "60%", "-o", str(link)]) == 0
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert load_plan(target).problem_name == load_plan(link).problem_name
    plot_target = tmp_path / "real" / "pareto.png"
    (tmp_path / "pareto.png").symlink_to(plot_target)  # dangling: the target is a new name
    assert cli.main(["pareto", chain_file, "--points", "2", "--plot", str(tmp_path / "pareto.png")]) == 0
    assert plot_target.read_bytes().startswith(PNG_SIGNATURE)
    assert (tmp_path / "pareto.png").is_symlink()


def test_new_names_and_regular_files_are_written(tmp_path):
    path = tmp_path / "new.json"
    assert output_path(path) == path
    write_json_atomic(path, {"a": 1})
    write_json_atomic(path, {"a": 2})
    assert path.read_text() == '{\n "a": 2\n}\n'
    with pytest.raises(MemschedError, match="does not exist"):
        output_path(tmp_path / "missing" / "x.json")


def test_a_failed_write_leaves_the_old_file(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text("old")
    with pytest.raises(TypeError):  # not JSON-serialisable: raised while writing the temporary file
        write_json_atomic(path, {"a": object()})
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]
