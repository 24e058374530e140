"""The byte quantities people type and read (planner/units.py): budgets and sizes."""

import tracemalloc

import pytest

from checks import one_line
from planner import MemschedError
from planner.units import format_bytes, parse_budget


@pytest.mark.parametrize("text, reference, expected", [
    pytest.param("123456789", None, 123456789, id="plain-bytes"),
    pytest.param("4GiB", None, 4 * 2**30, id="GiB"),
    pytest.param("512MB", None, 512 * 10**6, id="MB"),
    pytest.param("1.5 GiB", None, 3 * 2**29, id="fractional-with-space"),
    pytest.param("2 kib", None, 2048, id="lower-case-unit"),
    pytest.param("1TB", None, 10**12, id="TB"),
    pytest.param("100B", None, 100, id="B"),
    pytest.param(" 7MiB ", None, 7 * 2**20, id="surrounding-spaces"),
    pytest.param("50%", 1000, 500, id="50-percent"),
    pytest.param("100%", 123456789, 123456789, id="100-percent"),
    pytest.param("25%", 10, 2, id="percent-rounds-down"),
    pytest.param("123456789", 1000, 123456789, id="bytes-ignore-reference"),
])
def test_parse_budget(text, reference, expected):
    value = parse_budget(text, reference)
    assert value == expected
    assert type(value) is int


@pytest.mark.parametrize("text, reference, fragments", [
    pytest.param("abc", None, ["'abc'"], id="not-a-number"),
    pytest.param("4XB", None, ["'XB'", "GiB", "MB", "KiB", "%"], id="unknown-unit"),
    pytest.param("-1", None, ["'-1'"], id="negative"),
    pytest.param("0", None, ["'0'", "positive"], id="zero"),
    pytest.param("0GiB", None, ["positive"], id="zero-with-unit"),
    pytest.param("0%", 1000, ["positive"], id="zero-percent"),
    pytest.param("50%", None, ["percentage"], id="percent-without-reference"),
    pytest.param("", None, ["budget"], id="empty"),
    pytest.param("1e400", None, ["positive"], id="overflow"),
])
def test_parse_budget_errors(text, reference, fragments):
    with pytest.raises(MemschedError) as excinfo:
        parse_budget(text, reference)
    one_line(excinfo, *fragments)


def test_parse_budget_names_what_is_parsed():
    with pytest.raises(MemschedError) as excinfo:
        parse_budget("lots", what="--budget")
    one_line(excinfo, "--budget", "'lots'")


def test_parse_budget_percentage_is_exact():
    assert parse_budget("29%", 100) == 29


def test_parse_budget_large_counts_are_exact():
    assert parse_budget("9007199254740993") == 9007199254740993


def test_parse_budget_below_one_byte_is_refused():
    with pytest.raises(MemschedError):
        parse_budget("0.5")


@pytest.mark.parametrize("count, expected", [
    pytest.param(0, "0 B", id="zero"),
    pytest.param(512, "512 B", id="bytes"),
    pytest.param(1023, "1023 B", id="just-below-KiB"),
    pytest.param(1024, "1.0 KiB", id="KiB"),
    pytest.param(1536, "1.5 KiB", id="fractional-KiB"),
    pytest.param(5 * 2**20, "5.0 MiB", id="MiB"),
    pytest.param(4 * 2**30, "4.0 GiB", id="GiB"),
    pytest.param(2**40, "1.0 TiB", id="TiB"),
    pytest.param(2048 * 2**40, "2048.0 TiB", id="beyond-TiB"),
])
def test_format_bytes(count, expected):
    assert format_bytes(count) == expected


def test_a_budget_of_a_million_digits_is_refused_without_building_it():
    """It took 60 s for 1e999999: an exact million-digit integer (415 KiB) was built first. Counted in bytes
    allocated (Python's and the decimal module's), not in seconds: the refusal builds no big number."""
    tracemalloc.start()
    try:
        for text in ("1e999999", "1e999999999", "1e999999%"):
            with pytest.raises(MemschedError) as excinfo:
                parse_budget(text, 1000)
            one_line(excinfo, "positive", "1 EiB")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024, peak  # measured: 2 KiB (10**99999 alone, a tenth of the digits, is 88 KiB)
    assert parse_budget(str(2**60)) == 2**60
