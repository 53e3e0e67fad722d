"""Dataset blends as users write them: ``paths`` + ``weights``, or Megatron's inline syntax.

Three spellings of the same blend, all resolved by ``resolve_blend`` into
``(prefixes, weights or None)``:

- ``data.paths=[a, b] data.weights=[0.3, 0.7]`` (weights null: by dataset size);
- ``data.paths=[0.3, a, 0.7, b]``: Megatron's ``--data-path`` list, a weight before
  each prefix (every even position a number, or none of them);
- ``data.blend="0.3 a 0.7 b"`` (or ``"a b"``): the same as one string, split on
  whitespace.

Invariant: a blend is given one way only; weights are positive and finite, one per
prefix. Errors are ``BlendError`` lines of the form ``<key>=<value>: <what is allowed>``.
"""

from __future__ import annotations

from typing import Sequence

from parallel3d.option_checks import check_weights


class BlendError(ValueError):
    """A blend spelled wrongly; the message names the key and what is allowed."""


def _number(text: object) -> float | None:
    if isinstance(text, bool):
        return None
    if isinstance(text, (int, float)):
        return float(text)
    try:
        return float(str(text))
    except ValueError:
        return None


def _weight(text: object) -> object:
    """A weight as a number where it reads as one; else as given (``check_weights`` refuses and shows it)."""
    number = _number(text)
    return text if number is None else number


def split_inline_weights(items: Sequence[object], key: str) -> tuple[list[str], list[float] | None]:
    """``[w0, p0, w1, p1, ...]`` -> prefixes and weights; ``[p0, p1, ...]`` -> prefixes and None."""
    items = list(items)
    numbers = [_number(x) for x in items]
    if not items or numbers[0] is None:  # no leading weight: plain prefixes
        return [str(x) for x in items], None
    if len(items) % 2 or any(n is None for n in numbers[0::2]):
        raise BlendError(f"{key}={items}: Megatron blend syntax needs pairs [w0, prefix0, w1, prefix1, ...]")
    weights = [float(n) for n in numbers[0::2]]
    prefixes = [str(x) for x in items[1::2]]
    return prefixes, check_weights(key, weights, error=BlendError, shown=str(items))


def resolve_blend(
    paths: Sequence[object], weights: Sequence[float] | None, blend: str | None, *, prefix_key: str = "data"
) -> tuple[list[str], list[float] | None]:
    """The prefixes and weights of ``{prefix_key}.paths`` / ``.weights`` / ``.blend`` (see module doc)."""
    paths = list(paths or [])
    if blend is not None and str(blend).strip():
        if paths or weights is not None:
            raise BlendError(f"{prefix_key}.blend={blend!r}: give the blend once: either {prefix_key}.blend or "
                             f"{prefix_key}.paths (+ {prefix_key}.weights), not both")
        return split_inline_weights(str(blend).replace(",", " ").split(), f"{prefix_key}.blend")
    prefixes, inline = split_inline_weights(paths, f"{prefix_key}.paths") if paths else ([], None)
    if inline is not None:
        if weights is not None:
            raise BlendError(f"{prefix_key}.weights={list(weights)}: {prefix_key}.paths already carries weights "
                             f"(Megatron syntax); drop one of them")
        return prefixes, inline
    if weights is not None:
        if len(weights) != len(prefixes):
            raise BlendError(f"{prefix_key}.weights={list(weights)}: must give one positive weight per "
                             f"{prefix_key}.paths entry ({len(prefixes)})")
        return prefixes, check_weights(f"{prefix_key}.weights", [_weight(x) for x in weights], error=BlendError,
                                       shown=str(list(weights)))
    return prefixes, None
