"""Tests of parsing and printing byte sizes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, strategies as st

from torchTensorRef.core.sizes import format_size, parse_size

FACTORS = {
    "": 1, "B": 1, "kB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "K": 2**10, "M": 2**20, "G": 2**30,
}


@given(st.integers(0, 10**6), st.sampled_from(sorted(FACTORS)), st.sampled_from(["", " "]))
def test_parse_integer_sizes(n, unit, space):
    assert parse_size(f"{n}{space}{unit}") == n * FACTORS[unit]
    assert parse_size(f"  {n}{space}{unit.lower()}  ") == n * FACTORS[unit]
    assert parse_size(f"{n}{unit.upper()}") == n * FACTORS[unit]


def test_parse_fractional_sizes_round_down():
    assert parse_size("1.5GiB") == 3 * 2**29
    assert parse_size("0.5KiB") == 512
    assert parse_size("1.0001B") == 1


@pytest.mark.parametrize("value", [0, 1, 123456789, None])
def test_ints_and_none_pass_through(value):
    assert parse_size(value) == value


def test_integral_floats_are_accepted():
    assert parse_size(2048.0) == 2048


@pytest.mark.parametrize("value", [-1, -0.0 - 1, "-1MiB", "1e9", "six", "6 gigs", "MiB", "", "1.5.2GB",
                                   "5 MiBs", 1.5, float("nan"), True, False, [1], b"1MiB"])
def test_bad_sizes_name_what_is_accepted(value):
    with pytest.raises(ValueError) as info:
        parse_size(value, "budget")
    message = str(info.value)
    assert message.startswith("budget must be")
    assert '"512MiB"' in message and "None" in message
    assert repr(value) in message


@pytest.mark.parametrize("value", ["9" * 400 + "GiB", "8388608TiB", "1" + "0" * 5000, 2**63, 1e300])
def test_sizes_too_large_are_refused_naming_what_is_accepted(value):
    # A size string too large for a float raised OverflowError ("cannot convert float infinity
    # to integer"), naming neither the setting nor what is accepted.
    with pytest.raises(ValueError) as info:
        parse_size(value, "host_budget")
    message = str(info.value)
    assert message.startswith("host_budget must be") and '"512MiB"' in message
    assert repr(value) in message


def test_sizes_are_read_exactly_up_to_the_largest_torch_can_count():
    assert parse_size(2**63 - 1) == parse_size("8388607.999999999999999999TiB") == 2**63 - 1
    assert parse_size("2.01MB") == 2_010_000  # (a float times the unit gave 2009999)


@pytest.mark.parametrize("value", [np.int64(2**40), np.int32(4096), np.uint8(7)])
def test_integers_of_any_integral_type_are_accepted(value):
    # numpy.int64 was refused while numpy.float64 was accepted.
    nbytes = parse_size(value)
    assert nbytes == int(value) == parse_size(np.float64(value)) and type(nbytes) is int
    with pytest.raises(ValueError, match="np.True_"):
        parse_size(np.True_)  # (a bool, of numpy's or Python's, is no size)


def test_the_setting_is_named():
    with pytest.raises(ValueError, match="^limit must be"):
        parse_size("x", "limit")


@pytest.mark.parametrize("nbytes, text", [
    (0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1536, "1.5 KiB"), (3 * 2**20, "3.0 MiB"),
    (2**30, "1.0 GiB"), (5 * 2**40, "5120.0 GiB"), (None, "unlimited"),
])
def test_format_size(nbytes, text):
    assert format_size(nbytes) == text


@given(st.integers(0, 2**50))
def test_format_then_parse_is_within_rounding(nbytes):
    text = format_size(nbytes).replace(" ", "")
    back = parse_size(text)
    assert abs(back - nbytes) <= max(0.05 * nbytes, 1)
