"""``ConfigError`` and the one-line value checks every options class is built from.

Each package's options dataclass (``parallel_dims.ParallelDims``, ``pipeline.options``,
``zero.options``, ``checkpoint_io.options`` ...) validates itself with these, so every
bad value reads the same way wherever it is caught: ``<config key>=<value>: <what is
allowed>``, on one line. This module imports nothing of parallel3d: any package may use it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any


class ConfigError(ValueError):
    """A bad configuration value; the message is one line a user can act on."""


def check_int(key: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{key}={value!r}: must be an integer >= {minimum}")
    return value


def check_choice(key: str, value: Any, allowed: tuple) -> Any:
    if isinstance(value, bool) or value not in allowed:
        raise ConfigError(f"{key}={value!r}: must be one of {', '.join(map(str, allowed))}")
    return value


def is_finite_number(value: Any) -> bool:
    """A real number a run can compute with: not a bool, not nan, not +-inf (``1e400`` reads as inf)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def number_word(value: Any) -> str:
    """``"number"``, or ``"finite number"`` where the value given was nan or infinite (says why it is refused)."""
    return "finite number" if isinstance(value, float) and not math.isfinite(value) else "number"


def check_range(key: str, value: Any, lo: float, hi: float | None = None, *, lo_open: bool = False) -> float:
    """A finite number in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``; no upper bound when ``hi`` is None).
    Infinity is refused too: no key means "unbounded" by it (null does), and it overflows deep in a run."""
    ok = is_finite_number(value)
    if ok:
        ok = value > lo if lo_open else value >= lo
        ok = ok and (hi is None or value <= hi)
    if not ok:
        bound = f"{'>' if lo_open else '>='} {lo}" + ("" if hi is None else f" and <= {hi}")
        raise ConfigError(f"{key}={value!r}: must be a {number_word(value)} {bound}")
    return float(value)


def check_path(key: str, value: Any) -> str:
    """A path that names something: an empty (or blank) one would resolve to the current directory."""
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{key}={value!r}: must be a non-empty path")
    return value


def check_bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{key}={value!r}: must be true or false")
    return value


def as_tuples(options: Any) -> None:
    """Freeze list values of a (frozen) options dataclass into tuples, in place, so an options
    object built from a Hydra section holds no mutable value (call from ``__post_init__``)."""
    for f in dataclasses.fields(options):
        value = getattr(options, f.name)
        if isinstance(value, list):
            object.__setattr__(options, f.name, tuple(value))
