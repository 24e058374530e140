"""Field checks shared by every loader (chain, plan, graph, pipeline and offload plans, the copy channel).

Each check returns the clean value or raises :class:`MemschedError` with one
line naming the field (``where``) and what a valid value looks like.

Numbers are bounded by what a real device can mean (docs/formats.md, "Bounds"), so that an absurd but
parseable value (1e30 seconds, 1e30 bytes) is refused at the field that holds it rather than overflowing a
solver's 64-bit arrays or planning a step longer than a year.
"""

import math

from planner.errors import MemschedError

MAX_BYTES = 2**60  # 1 EiB: any one size, a budget, and the sum of a problem's sizes (so that sums fit in int64)
MAX_SECONDS = 365 * 24 * 3600.0  # one year: any one duration, a time limit
MIN_BANDWIDTH, MAX_BANDWIDTH = 1.0, float(2**60)  # bytes per second of a channel that exists
MIN_THROUGHPUT, MAX_THROUGHPUT = 1e3, 1e21  # FLOP/s that an estimate may assume
MAX_INDEX = 2**20  # stages of a chain, nodes of a graph (their indices in a schedule are below it)
MAX_RUNS = 100_000  # profiling runs per stage, stage options, training steps: beyond it a call would not finish


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
    if value > MAX_BYTES:
        raise MemschedError(f"{where} = {_short(value)} bytes is beyond {MAX_BYTES} (1 EiB), more than any device "
                            "holds; give the size in bytes")
    return value


def total_bytes(values, where: str) -> None:
    """Refuse a problem whose sizes add up beyond :data:`MAX_BYTES` (each may be within it)."""
    total = sum(values)
    if total > MAX_BYTES:
        raise MemschedError(f"{where}: its sizes add up to {_short(total)} bytes, beyond {MAX_BYTES} (1 EiB), more "
                            "than any device holds; give the sizes in bytes")


def _short(value: int) -> str:
    """``value``, or its order of magnitude when it is too long to print (Python refuses ints past 4300 digits)."""
    return str(value) if value.bit_length() <= 256 else f"about 2**{value.bit_length() - 1}"


def non_negative_seconds(value, where: str) -> float:
    """A finite, non-negative duration in seconds, at most a year (:data:`MAX_SECONDS`)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MemschedError(f"{where} must be a number of seconds, got {value!r}")
    value = _float(value, where, "seconds")
    if not math.isfinite(value):
        raise MemschedError(f"{where} must be a finite number of seconds, got {value!r}")
    if value < 0:
        raise MemschedError(f"{where} must be >= 0 seconds, got {value}")
    if value > MAX_SECONDS:
        raise MemschedError(f"{where} = {value:g} seconds is more than a year ({MAX_SECONDS:g} s); give it in seconds")
    return value


def positive_seconds(value, where: str) -> float:
    """A duration in seconds above 0 and at most a year: a time limit or a timeout, which must run out."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_SECONDS:  # NaN too
        raise MemschedError(f"{where} must be a positive number of seconds, at most a year ({MAX_SECONDS:g}), "
                            f"got {value!r}")
    return float(value)


def bandwidth(value, where: str, zero: str = None, other: str = None) -> float:
    """Bytes per second of a channel: :data:`MIN_BANDWIDTH` to :data:`MAX_BANDWIDTH`; 0 only where ``zero`` says
    what it means (e.g. "no channel that way"). ``other`` names another value the caller takes (e.g. null)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        value = repr(value)
    else:
        value = _float(value, where, "bytes per second")
        if value == 0 and zero is not None:
            return 0.0
        if MIN_BANDWIDTH <= value <= MAX_BANDWIDTH:  # NaN and infinities fail
            return value
    also = "".join(f", or {text}" for text in (zero and f"0 ({zero})", other) if text)
    hint = "; a channel that moves nothing is no channel: leave it out" if value == 0 and zero is None else ""
    raise MemschedError(f"{where} must be bytes per second from {MIN_BANDWIDTH:g} to {MAX_BANDWIDTH:g}{also}, "
                        f"got {value}{hint}")


def throughput(value, where: str) -> float:
    """FLOP/s that an estimate may assume: :data:`MIN_THROUGHPUT` to :data:`MAX_THROUGHPUT` (a zettaflop is beyond
    any device)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not MIN_THROUGHPUT <= value <= MAX_THROUGHPUT:
        raise MemschedError(f"{where} must be a positive number of FLOP/s from {MIN_THROUGHPUT:g} to "
                            f"{MAX_THROUGHPUT:g}, got {value}")
    return float(value)


def positive_number(value, where: str) -> float:
    """A positive, finite number (a learning rate, a gradient norm)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise MemschedError(f"{where} must be a positive, finite number, got {value}")
    return float(value)


def count(value, where: str, minimum: int = 0, maximum: int = MAX_INDEX) -> int:
    """A whole number from ``minimum`` to ``maximum`` (an index, a number of micro-batches...)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise MemschedError(f"{where} must be a whole number, got {value!r}")
    if not minimum <= value <= maximum:
        raise MemschedError(f"{where} must be from {minimum} to {maximum}, got {_short(value)}")
    return value


def _float(value, where: str, unit: str) -> float:
    try:
        return float(value)
    except OverflowError:  # an int beyond float's range
        raise MemschedError(f"{where} = about 2**{value.bit_length() - 1} {unit} is out of range") from None


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
            f"{where}: format '{tag}' is not supported; this memsched reads '{expected}' "
            f"(re-create the file or upgrade memsched)"
        )
    raise MemschedError(f"{where}: format is {tag!r}, expected '{expected}'; is this a memsched {family} file?")
