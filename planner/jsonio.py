"""Reading and writing the project's files: strict on input; atomic on output, and only over regular files."""

import json
import os
import tempfile
from pathlib import Path

from planner.errors import MemschedError


class _DuplicateKey(ValueError):
    pass


def _refuse_duplicate_keys(pairs):
    """``json`` keeps the last of repeated keys silently; a file with one is ambiguous, so refuse it."""
    data = {}
    for key, value in pairs:
        if key in data:
            raise _DuplicateKey(key)
        data[key] = value
    return data


def read_json(path) -> dict:
    """Return the JSON object stored at ``path``, or raise a one-line error."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise MemschedError(f"{path}: no such file") from None
    except OSError as exc:
        raise MemschedError(f"{path}: cannot read ({exc.strerror})") from None
    try:
        data = json.loads(text, object_pairs_hook=_refuse_duplicate_keys)
    except json.JSONDecodeError as exc:
        raise MemschedError(f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    except _DuplicateKey as exc:
        raise MemschedError(f"{path}: key '{exc.args[0]}' appears twice in one object; keep one") from None
    if not isinstance(data, dict):
        raise MemschedError(f"{path}: expected a JSON object at the top level, found {type(data).__name__}")
    return data


def output_path(path) -> Path:
    """The file that writing to ``path`` replaces: ``path`` itself, or what its symbolic links lead to.

    Raises a one-line :class:`MemschedError` unless that is a regular file or a new name in an existing folder:
    a device (``/dev/full``), a FIFO, a socket or a folder is never replaced by a file.
    """
    path = Path(path)
    target = Path(os.path.realpath(path)) if path.is_symlink() else path
    if target.exists() and not target.is_file():
        kind = "a folder" if target.is_dir() else "a device, FIFO or socket, not a regular file"
        shown = str(path) if target == path else f"{path} (a link to {target})"
        raise MemschedError(f"{shown}: cannot write over {kind}; choose another output path")
    folder = target.parent if str(target.parent) else Path(".")
    if not folder.is_dir():
        raise MemschedError(f"{path}: folder {folder} does not exist; create it or choose another output path")
    return target


def write_atomic(path, write, binary: bool = False) -> None:
    """Call ``write(handle)`` on a temporary file beside ``path``, then rename it over ``path``.

    Readers see either the old file or the whole new one; an interrupted write leaves the old file intact. A
    symbolic link stays a link (its target is replaced); anything but a regular file or a new name is refused
    (:func:`output_path`).
    """
    shown, path = path, output_path(path)
    folder = path.parent if str(path.parent) else Path(".")
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    except OSError as exc:
        raise MemschedError(f"{shown}: cannot write in {folder} ({exc.strerror}); choose another output path") from None
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp_name, 0o666 & ~umask)  # mkstemp makes 0600; give the file the mode open() would
    try:
        with os.fdopen(fd, "wb" if binary else "w") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, path)
    except OSError as exc:
        os.unlink(tmp_name)
        raise MemschedError(f"{shown}: cannot write ({exc.strerror}); choose another output path") from None
    except BaseException:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
        raise


def write_json_atomic(path, data: dict) -> None:
    """Write ``data`` to ``path`` as indented JSON, atomically (:func:`write_atomic`)."""

    def write(handle):
        json.dump(data, handle, indent=1)
        handle.write("\n")

    write_atomic(path, write)
