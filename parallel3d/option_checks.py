"""``ConfigError`` and the one-line value checks every options class is built from.

Each package's options dataclass (``parallel_dims.ParallelDims``, ``pipeline.options``,
``zero.options``, ``checkpoint_io.options`` ...) validates itself with these, so every
bad value reads the same way wherever it is caught: ``<config key>=<value>: <what is
allowed>``, on one line. This module imports nothing of parallel3d: any package may use it.
The finite-number range rule (``range_rule``) is written here only: a package with its own error
class (planning, MoE, data) passes it as ``check_range(..., error=...)``.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Sequence


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


def is_number(value: Any) -> bool:
    """A real number, not a bool (numbers.Real: numpy's scalars too; a blend's weights may come as an array)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_finite_number(value: Any) -> bool:
    """A real number a run can compute with: not a bool, not nan, not +-inf (``1e400`` reads as inf)."""
    return is_number(value) and math.isfinite(value)


def number_word(value: Any) -> str:
    """``"number"``, or ``"finite number"`` where the value given was nan or infinite (says why it is refused)."""
    return "finite number" if is_number(value) and not math.isfinite(value) else "number"


def range_rule(value: Any, lo: float, hi: float | None = None, *, lo_open: bool = False) -> str | None:
    """None where ``value`` is a finite number in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``; no upper bound
    when ``hi`` is None), else what is allowed: ``"a number > 0"`` (``"a finite number > 0"`` for nan or inf).
    Infinity is refused too: no key means "unbounded" by it (null does), and it overflows deep in a run;
    nan compares as in range against a bare ``<= 0``."""
    ok = is_finite_number(value)
    if ok:
        ok = value > lo if lo_open else value >= lo
        ok = ok and (hi is None or value <= hi)
    if ok:
        return None
    return f"a {number_word(value)} {'>' if lo_open else '>='} {lo}" + ("" if hi is None else f" and <= {hi}")


def check_range(key: str, value: Any, lo: float, hi: float | None = None, *, lo_open: bool = False,
                error: type[Exception] = ConfigError, shown: str | None = None, also: str = "") -> float:
    """``value`` as a float if ``range_rule`` allows it, else ``error`` (a ``ValueError`` subclass the
    caller's package raises) reading ``<key>=<shown>: must be <rule><also>``. ``shown`` is the text the user
    wrote where ``value`` was parsed from it (``'1e400GB'``); ``also`` names another allowed spelling."""
    rule = range_rule(value, lo, hi, lo_open=lo_open)
    if rule is not None:
        raise error(f"{key}={repr(value) if shown is None else shown}: must be {rule}{also}")
    return float(value)


def check_positive(key: str, value: Any, *, error: type[Exception] = ConfigError, shown: str | None = None,
                   also: str = "") -> float:
    """A finite number > 0 (``check_range`` with ``lo=0`` open)."""
    return check_range(key, value, 0, lo_open=True, error=error, shown=shown, also=also)


def check_weights(key: str, values: Sequence[Any], *, error: type[Exception] = ConfigError,
                  shown: str | None = None) -> list[float]:
    """Blend weights: every entry a finite number > 0. The message shows the whole list (``shown``: as the
    user wrote it, where the weights were picked out of it) and the first entry refused."""
    for value in values:
        rule = range_rule(value, 0, lo_open=True)
        if rule is not None:
            raise error(f"{key}={list(values) if shown is None else shown}: every weight must be {rule}, "
                        f"got {value!r}")
    return [float(v) for v in values]


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
