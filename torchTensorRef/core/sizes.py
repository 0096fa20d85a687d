"""Parsing and printing byte sizes such as ``"512MiB"`` or ``"6GB"``."""

from __future__ import annotations

import re
from typing import Optional, Union

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
SIZES = 'an int number of bytes >= 0 or a size string such as "512MiB", "6GB" or "1.5GiB"'
ACCEPTED = SIZES.replace(" or a", ", a") + ", or None"


def parse_size(value: Union[int, str, None], what: str = "budget", none: bool = True) -> Optional[int]:
    """Return ``value`` as a number of bytes (``None`` stays ``None`` where ``none`` allows it).

    Raises:
        ValueError: naming what is accepted, for negative or unparsable values.
    """
    accepted = ACCEPTED if none else SIZES
    if value is None:
        if none:
            return None
        raise ValueError(f"{what} must be {accepted} (got: None)")
    if isinstance(value, bool):
        raise ValueError(f"{what} must be {accepted} (got: {value!r})")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{what} must be {accepted} (got: {value!r}, which is negative)")
        return value
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m and m.group(2).lower() in _UNITS:
            return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    raise ValueError(f"{what} must be {accepted} (got: {value!r})")


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
