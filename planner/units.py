"""Quantities written by people (bytes ``4GiB``, ``512MB``, ``123456789``, ``50%``; rates ``16GB/s``), the
short form of a byte count, and the one way seconds are added up.
"""

import math
import re
from decimal import Decimal

from planner.errors import MemschedError
from planner.validate import MAX_BYTES, bandwidth

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_QUANTITY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*|%)\s*$")
_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*(?:/\s*s)?\s*$")


def parse_budget(text: str, reference_bytes: int = None, what: str = "budget") -> int:
    """Bytes from ``text``; a percentage is taken of ``reference_bytes`` (the store-all peak), rounded down."""
    match = _QUANTITY.match(str(text))
    if not match:
        raise MemschedError(f"{what}: cannot read {text!r}; "
                            f"write bytes like 123456789, 4GiB, 512MB, or a percentage like 50%")
    number, unit = Decimal(match.group(1)), match.group(2)  # exact decimal arithmetic: no rounding surprises
    if number.adjusted() > 30:  # 1e31 or more, whatever the unit: refused before a slow exact conversion
        raise MemschedError(_beyond(what, text))
    if unit == "%":
        if reference_bytes is None:
            raise MemschedError(f"{what}: a percentage needs a chain to take it of; give bytes instead")
        value = int(number * reference_bytes / 100)
    else:
        factor = _UNITS.get(unit.lower())
        if factor is None:
            raise MemschedError(f"{what}: unknown unit {unit!r} in {text!r}; "
                                f"use B, KB, MB, GB, TB, KiB, MiB, GiB, TiB or %")
        value = int(number * factor)
    if not 1 <= value <= MAX_BYTES:
        raise MemschedError(_beyond(what, text))
    return value


def _beyond(what: str, text: str) -> str:
    return f"{what}: {text!r} must be a positive amount of memory (at least 1 byte, at most 1 EiB = {MAX_BYTES} bytes)"


def format_bytes(count: int) -> str:
    """A short human form with binary units: ``315.7 MiB``."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def describe_bytes(count: int) -> str:
    """Bytes and their human form: ``506811045 bytes (483.3 MiB)``."""
    return f"{count} bytes ({format_bytes(count)})"


def parse_bandwidth(text: str, what: str = "--bandwidth") -> float:
    """Bytes per second from ``16GB/s``, ``12GiB/s``, ``800MB`` or ``1.5e10`` (decimal and binary units)."""
    match = _RATE.match(str(text))
    factor = _UNITS.get(match.group(2).lower()) if match else None
    if factor is None:
        raise MemschedError(f"{what}: cannot read {text!r}; write a rate like 16GB/s or 12GiB/s")
    number = Decimal(match.group(1))
    value = float(number * factor) if number.adjusted() <= 30 else math.inf  # 1e31 or more: out of range
    return bandwidth(value, f"{what} {text!r}")


def sum_seconds(seconds) -> float:
    """``seconds`` added one by one, left to right, as the simulators' clocks add them, so that a total
    computed here and a replayed time are the same float (``sum`` compensates rounding from Python 3.12)."""
    total = 0.0
    for value in seconds:
        total += value
    return total
