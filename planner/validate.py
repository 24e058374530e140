"""Field checks shared by the chain and plan loaders.

Each check returns the clean value or raises :class:`MemschedError` with one
line naming the field (``where``) and what a valid value looks like.
"""

import math

from planner.errors import MemschedError


def require(obj: dict, key: str, where: str):
    """``obj[key]``, or an error naming the missing field."""
    if key not in obj:
        raise MemschedError(f"{where}: missing field '{key}'")
    return obj[key]


def reject_unknown(obj: dict, known, where: str) -> None:
    """Refuse fields the format does not define (usually a typo)."""
    unknown = sorted(set(obj) - set(known))
    if unknown:
        raise MemschedError(f"{where}: unknown field '{unknown[0]}'; known fields are {', '.join(sorted(known))}")


def non_negative_bytes(value, where: str) -> int:
    """A whole, non-negative number of bytes (an integral float such as 1e6 is accepted)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MemschedError(f"{where} must be a whole number of bytes, got {value!r}")
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            raise MemschedError(f"{where} must be a whole number of bytes, got {value!r}")
        value = int(value)
    if value < 0:
        raise MemschedError(f"{where} must be >= 0 bytes, got {value}")
    return value


def non_negative_seconds(value, where: str) -> float:
    """A finite, non-negative duration in seconds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MemschedError(f"{where} must be a number of seconds, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise MemschedError(f"{where} must be a finite number of seconds, got {value!r}")
    if value < 0:
        raise MemschedError(f"{where} must be >= 0 seconds, got {value}")
    return value


def text(value, where: str) -> str:
    """A string field."""
    if not isinstance(value, str):
        raise MemschedError(f"{where} must be a string, got {value!r}")
    return value


def document(data, family: str, version: int, fields, where: str) -> None:
    """Check a top-level object: a JSON object, tagged ``memsched.<family>/<version>``, with only ``fields``."""
    if not isinstance(data, dict):
        raise MemschedError(f"{where}: expected a JSON object")
    format_tag(data, family, version, where)
    reject_unknown(data, fields, where)


def format_tag(data: dict, family: str, version: int, where: str) -> None:
    """Check the ``format`` field is ``memsched.<family>/<version>``."""
    tag = require(data, "format", where)
    expected = f"memsched.{family}/{version}"
    if tag == expected:
        return
    if isinstance(tag, str) and tag.startswith(f"memsched.{family}/"):
        raise MemschedError(
            f"{where}: format '{tag}' is not supported; this memsched reads '{expected}' (re-create the file or upgrade memsched)"
        )
    raise MemschedError(f"{where}: format is {tag!r}, expected '{expected}'; is this a memsched {family} file?")
