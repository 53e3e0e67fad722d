"""Byte sizes as users write them: ``'80GB'`` (decimal), ``'80GiB'`` (binary) or a number of bytes."""

from __future__ import annotations

import re

from parallel3d.option_checks import check_positive

GiB = 2**30

_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": GiB, "tib": 2**40}


def parse_bytes(text: str | int | float, key: str = "device_mem") -> float:
    """'80GB' -> 80e9, '80GiB' -> 80 * 2**30, 1e9 -> 1e9. SI units are decimal, *iB binary."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return check_positive(key, text, error=ValueError)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"{key}={text!r} is not a size like '80GB', '80GiB' or a number of bytes")
    value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    return check_positive(key, value, error=ValueError, shown=repr(text))  # "1e400GB" reads as inf
