"""Reading and writing the project's files: strict on input; atomic on output, and only over regular files."""

import json
import os
import re
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


class _NotANumber(ValueError):
    pass


MAX_FILE_BYTES = 2**30  # far above any chain, plan or graph memsched writes (1M stages is ~300 MB)
MAX_DEPTH = 64  # nesting of objects and lists; the formats need under 10
MAX_DIGITS = 30  # of a whole number; the largest quantity memsched reads (2**60 bytes) has 19


def _bounded_int(digits: str) -> int:
    """``json``'s integer parser, refusing a number no field can hold before Python's 4300-digit limit does."""
    if len(digits.lstrip("-")) > MAX_DIGITS:
        raise _NotANumber(f"a whole number of {len(digits.lstrip('-'))} digits (at most {MAX_DIGITS} make sense)")
    return int(digits)


def read_json(path) -> dict:
    """Return the JSON object stored at ``path``, or raise a one-line error.

    The file must be UTF-8 JSON of at most :data:`MAX_FILE_BYTES`, nested at most :data:`MAX_DEPTH` deep, with
    whole numbers of at most :data:`MAX_DIGITS` digits: anything else (binary data, UTF-16, a device such as
    /dev/zero) is refused in one line rather than read without end or parsed into a crash. ``NaN`` and
    ``Infinity`` are read, and refused by the field checks that name their field."""
    path = Path(path)
    text = _decoded(path, _read_bytes(path))
    try:
        data = json.loads(text, object_pairs_hook=_refuse_duplicate_keys, parse_int=_bounded_int)
    except json.JSONDecodeError as exc:
        raise MemschedError(f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    except _DuplicateKey as exc:
        raise MemschedError(f"{path}: key '{exc.args[0]}' appears twice in one object; keep one") from None
    except _NotANumber as exc:
        raise MemschedError(f"{path}: not a memsched file: {exc}") from None
    except RecursionError:
        raise MemschedError(f"{path}: not a memsched file: objects or lists nested too deep to read (more than "
                            f"{MAX_DEPTH} levels)") from None
    if not isinstance(data, dict):
        raise MemschedError(f"{path}: expected a JSON object at the top level, found {type(data).__name__}")
    _check_depth(data, path)
    return data


def _read_bytes(path: Path) -> bytes:
    """The file's bytes: a device is refused (/dev/zero never ends), so is a file over :data:`MAX_FILE_BYTES`."""
    try:
        if path.exists() and not path.is_file() and (path.is_char_device() or path.is_block_device()):
            raise MemschedError(f"{path}: is a device, not a file; give a memsched JSON file")
        with open(path, "rb") as handle:
            raw = handle.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise MemschedError(f"{path}: no such file") from None
    except OSError as exc:
        raise MemschedError(f"{path}: cannot read ({exc.strerror})") from None
    if len(raw) > MAX_FILE_BYTES:
        raise MemschedError(f"{path}: larger than {MAX_FILE_BYTES // 2**20} MiB; not a memsched file")
    return raw


def _decoded(path: Path, raw: bytes) -> str:
    """``raw`` as UTF-8 text (a UTF-8 byte-order mark is skipped); UTF-16 and UTF-32 (told by their byte-order
    mark) and binary data are refused."""
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise MemschedError(f"{path}: UTF-16 or UTF-32 text (it starts with a byte-order mark); memsched reads "
                            "UTF-8: convert it (iconv -f UTF-16 -t UTF-8)")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise MemschedError(f"{path}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}); is "
                            "this a memsched JSON file?") from None


def _check_depth(data, path: Path) -> None:
    """Refuse objects and lists nested beyond :data:`MAX_DEPTH` (they parse, but no format has them, and
    printing or copying them could exhaust Python's recursion limit)."""
    level, depth = [data], 1
    while level:
        if depth > MAX_DEPTH:
            raise MemschedError(f"{path}: not a memsched file: objects or lists nested more than {MAX_DEPTH} deep")
        level = [child for item in level for child in (item.values() if isinstance(item, dict) else item)
                 if isinstance(child, (dict, list))]
        depth += 1


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

    What it guarantees:

    * ``path`` holds the old file or the whole new one at every moment, whatever
      stops the process (an error, Ctrl-C, SIGKILL): the new content goes to
      ``.NAME.PID-XXXX.tmp`` in the same folder and is renamed over ``path`` in
      one step (``os.replace``) only once written;
    * the new content is on the disk before the rename (``fsync`` of the file),
      and the rename itself once this returns (``fsync`` of the folder), so a
      power loss or a crash of the machine also leaves the old or the whole new
      file, and after this returns the new one;
    * no temporary file is left behind by an error or Ctrl-C (it is removed). A
      process killed outright (SIGKILL, a power loss) cannot remove its own: the
      next write of the same ``path`` removes every ``.NAME.PID-*.tmp`` whose
      process is gone (a live writer's is kept, so two writers never break each
      other's rename; a process id reused since is taken as alive, and its
      file kept). Process ids are this machine's: in a folder shared with
      another machine, a writer there may see its file removed, and its write
      end in a one-line error, never in a broken file.

    A symbolic link stays a link (its target is replaced); anything but a regular file or a new name is refused
    (:func:`output_path`).
    """
    shown, path = path, output_path(path)
    folder = path.parent if str(path.parent) else Path(".")
    _remove_orphans(folder, path.name)
    tmp_name = None
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}-", suffix=".tmp", dir=folder)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp_name, 0o666 & ~umask)  # mkstemp makes 0600; give the file the mode open() would
        with os.fdopen(fd, "wb" if binary else "w") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, path)
        tmp_name = None
        _fsync_folder(folder)
    except OSError as exc:
        where = f"write in {folder}" if tmp_name is None else "write"  # (None: no temporary file could be made)
        raise MemschedError(f"{shown}: cannot {where} ({exc.strerror}); choose another output path") from None
    finally:
        if tmp_name is not None and os.path.exists(tmp_name):
            os.unlink(tmp_name)


def _remove_orphans(folder: Path, name: str) -> None:
    """Remove the temporary files of writes of ``name`` whose process no longer exists (killed mid-write)."""
    pattern = re.compile(rf"\.{re.escape(name)}\.(\d+)-[a-z0-9_]+\.tmp")  # mkstemp's letters after the prefix
    try:
        entries = os.listdir(folder)
    except OSError:
        return
    for entry in entries:
        match = pattern.fullmatch(entry)
        if match and not _alive(int(match.group(1))):
            try:
                os.unlink(folder / entry)
            except OSError:
                pass  # another writer removed it first, or the folder is not ours to clean


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _fsync_folder(folder: Path) -> None:
    """Make a rename in ``folder`` durable (where the system lets a folder be opened and synced)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on a folder; the rename is still atomic
    finally:
        os.close(fd)


def write_json_atomic(path, data: dict) -> None:
    """Write ``data`` to ``path`` as indented JSON, atomically (:func:`write_atomic`)."""

    def write(handle):
        json.dump(data, handle, indent=1)
        handle.write("\n")

    write_atomic(path, write)
