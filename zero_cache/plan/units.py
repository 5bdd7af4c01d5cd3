"""Byte quantities as users write them in configs: ``2147483648``, ``"2GB"``, ``"1.5 GiB"``, ``"auto"``."""

from __future__ import annotations

import re
from fractions import Fraction

# Decimal units follow SI (1 GB = 10**9 B), binary units follow IEC (1 GiB = 2**30 B), the way
# `df`, `nvidia-smi` and DeepSpeed's own size strings mix them; we accept both and never guess.
_UNIT_BYTES = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")

AUTO = "auto"


def parse_bytes(value: int | float | str, *, name: str = "size") -> int:
    """Turn a byte quantity from a config into an integer number of bytes.

    Args:
        value: an integer (or integral float such as ``1e9``) number of bytes, or a string with
            an optional unit: ``"512MB"``, ``"2 GiB"``, ``"1.5G"`` (bare K/M/G/T are binary).
        name: the config key, used in the error message.

    Returns:
        The number of bytes, at least 0.

    Raises:
        ValueError: the value is negative, fractional in bytes, or has an unknown unit.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{name}: expected a byte count such as 2147483648 or '2GB', got {value!r}")
    if isinstance(value, str):
        match = _SIZE_RE.match(value)
        if match is None:
            raise ValueError(f"{name}: cannot read {value!r} as a size; write e.g. 2147483648, '2GB' or '2GiB'")
        # Fraction parses the decimal text exactly: "2.01KB" is 2010 bytes, not 2009.9999999999998.
        number, unit = Fraction(match.group(1)), match.group(2).lower()
    else:
        number, unit = Fraction(value), ""  # exact for ints of any size and for floats such as 1e9
    if unit not in _UNIT_BYTES:
        allowed = ", ".join(u.upper() for u in _UNIT_BYTES if u)
        raise ValueError(f"{name}: unknown unit {unit!r} in {value!r}; use one of {allowed}")
    num_bytes = number * _UNIT_BYTES[unit]
    if num_bytes < 0 or num_bytes.denominator != 1:
        raise ValueError(f"{name}: {value!r} is not a whole, non-negative number of bytes")
    return int(num_bytes)


def parse_budget(value: int | float | str | None, *, name: str) -> int | None:
    """Like :func:`parse_bytes`, but ``"auto"`` (or None) means "measure free memory", returned as None."""
    if value is None or (isinstance(value, str) and value.strip().lower() == AUTO):
        return None
    return parse_bytes(value, name=name)


def format_bytes(num_bytes: int | float) -> str:
    """Human-readable binary size, e.g. ``format_bytes(3 * 2**30) == '3.00 GiB'``."""
    size = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")
