"""Parsing and printing byte sizes such as ``"512MiB"`` or ``"6GB"``."""

from __future__ import annotations

import operator
import re
from fractions import Fraction
from typing import Literal, Optional, SupportsIndex, Union, overload

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
SIZES = 'an int number of bytes >= 0 or a size string such as "512MiB", "6GB" or "1.5GiB"'
ACCEPTED = SIZES.replace(" or a", ", a") + ", or None"
#: the largest size accepted: the most bytes torch can count (a 64-bit signed int)
MAX_BYTES = 2**63 - 1

#: what ``parse_size`` reads
Size = Union[SupportsIndex, float, str, None]


@overload
def parse_size(value: Size, what: str = ..., *, none: Literal[False]) -> int: ...
@overload
def parse_size(value: Size, what: str = ..., none: bool = ...) -> Optional[int]: ...


def parse_size(value: Size, what: str = "budget", none: bool = True) -> Optional[int]:
    """Return ``value`` as a number of bytes (``None`` stays ``None`` where ``none`` allows it).

    ``value`` is ``None``, an integer of any type (``int``, ``numpy.int64``: anything with
    ``__index__``), an integral float, or a size string; a string's number is read exactly,
    and a fraction of a byte is dropped.

    Raises:
        ValueError: naming ``what`` and what is accepted, for negative, unparsable or
            too large values (more than ``MAX_BYTES``).
    """
    accepted = ACCEPTED if none else SIZES
    if value is None:
        if none:
            return None
        raise ValueError(f"{what} must be {accepted} (got: None)")
    nbytes = _to_bytes(value)
    if nbytes is None:
        raise ValueError(f"{what} must be {accepted} (got: {value!r})")
    if nbytes < 0:
        raise ValueError(f"{what} must be {accepted} (got: {value!r}, which is negative)")
    if nbytes > MAX_BYTES:
        raise ValueError(f"{what} must be {accepted} (got: {value!r}, which is more than the "
                         f"2**63 - 1 bytes torch can count)")
    return nbytes


def _to_bytes(value: Union[SupportsIndex, float, str]) -> Optional[int]:
    """``value`` as an int of bytes, or ``None`` where it is no size at all."""
    if isinstance(value, bool):
        return None  # (an int to Python, but never meant as a size)
    if isinstance(value, float):
        return int(value) if value.is_integer() else None  # (nan and the infinities are not)
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m is None or m.group(2).lower() not in _UNITS:
            return None
        try:
            return int(Fraction(m.group(1)) * _UNITS[m.group(2).lower()])
        except ValueError:  # (more digits than Python converts)
            return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def format_size(nbytes: Optional[int]) -> str:
    """Human-readable binary size: ``format_size(3 * 2**20) == "3.0 MiB"``."""
    if nbytes is None:
        return "unlimited"
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"  # pragma: no cover - loop always returns
