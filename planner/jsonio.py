"""Reading and writing the project's JSON files: strict on input, atomic on output."""

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


def write_json_atomic(path, data: dict) -> None:
    """Write ``data`` to ``path`` so that readers see either the old file or the whole new one.

    The text goes to a temporary file in the same folder, is flushed to disk,
    and is then renamed over ``path``; an interrupted write leaves the old file intact.
    """
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise MemschedError(f"{path}: folder {folder} does not exist; create it or choose another output path")
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    except OSError as exc:
        raise MemschedError(f"{path}: cannot write in {folder} ({exc.strerror}); choose another output path") from None
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp_name, 0o666 & ~umask)  # mkstemp makes 0600; give the file the mode open() would
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(data, handle, indent=1)
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, path)
    except OSError as exc:
        os.unlink(tmp_name)
        raise MemschedError(f"{path}: cannot write ({exc.strerror}); choose another output path") from None
    except BaseException:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
        raise
