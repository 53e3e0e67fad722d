"""A schema dataclass built straight from plain, already-typed values: ``job_from_dict``'s fast path.

``OmegaConf.merge`` + ``to_object`` against the structured schema costs ~25 ms a job (deep copies of the
whole schema); test collection builds hundreds of jobs whose values are plain Python of the declared types.
``instance_of(schema, values)`` builds the same object those two calls would, or returns ``None`` wherever
OmegaConf might do anything but copy a value through: an unknown key, a type it would convert (``"1"`` for
an int, ``1`` for a bool), a ``None`` the field does not allow, a string it would read as an interpolation
(``${``) or as missing (``???``), a container under ``Any``, a missing required field. The caller then takes
the OmegaConf path, so every error (and its message) still comes from OmegaConf. ``field_types`` (a
dataclass's fields and resolved hints, computed once per class) serves ``config.options_of`` too.

Invariant: where ``instance_of`` returns an object, it equals ``OmegaConf.to_object(OmegaConf.merge(
OmegaConf.structured(schema), values))`` field by field, types included (an int given for a float field
becomes a float, as OmegaConf's ``FloatNode`` converts it; tuples become lists); nothing in it aliases
``values`` (``tests/test_plain_schema.py`` compares the two on generated jobs).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any

_PRIMITIVES = (int, float, bool, str, type(None))  # what OmegaConf keeps as is under ``Any``


class _NotPlain(Exception):
    """A value OmegaConf might treat other than by copying it: the caller takes the OmegaConf path."""


@functools.cache  # per class: type hints are costly to compute (~0.5 ms) and never change
def field_types(schema: type) -> dict[str, Any]:
    """The fields of dataclass ``schema`` in order, name -> resolved type hint (callers must not change it)."""
    hints = typing.get_type_hints(schema)
    return {f.name: hints[f.name] for f in dataclasses.fields(schema)}


def _plain_str(value: str) -> str:
    if "${" in value or value == "???":  # an interpolation or OmegaConf's missing marker
        raise _NotPlain
    return value


def _value(hint: Any, value: Any) -> Any:
    """``value`` as a field of type ``hint`` holds it after OmegaConf's round trip (raises ``_NotPlain``)."""
    if dataclasses.is_dataclass(hint):
        if type(value) is not dict:
            raise _NotPlain
        return _instance(hint, value)
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1:
            raise _NotPlain
        return _value(inner[0], value)
    if typing.get_origin(hint) is list:
        if type(value) not in (list, tuple):
            raise _NotPlain
        return [_value(args[0], v) for v in value]
    if hint is Any:
        if type(value) not in _PRIMITIVES:
            raise _NotPlain
        return _plain_str(value) if type(value) is str else value
    if hint is float and type(value) is int:
        return float(value)  # FloatNode converts an int
    if type(value) is not hint or hint not in _PRIMITIVES:
        raise _NotPlain
    return _plain_str(value) if hint is str else value


def _instance(schema: type, values: dict) -> Any:
    fields = field_types(schema)
    if not all(type(k) is str and k in fields for k in values):
        raise _NotPlain
    try:
        return schema(**{k: _value(fields[k], v) for k, v in values.items()})
    except TypeError:  # a required field left out: OmegaConf says which
        raise _NotPlain from None


def instance_of(schema: type, values: dict) -> Any | None:
    """``schema`` built from ``values`` as OmegaConf would build it, or ``None``: let OmegaConf do it (module doc)."""
    try:
        return _instance(schema, values)
    except (_NotPlain, OverflowError):  # OverflowError: an int too large for a float field
        return None
