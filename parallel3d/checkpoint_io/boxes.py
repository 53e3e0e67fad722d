"""From a flat range of a rank-local parameter to rectangular boxes of the global tensor.

A ZeRO segment is a flat range ``[a, b)`` of a row-major tp-local tensor. It is not a
rectangle of the global tensor (a row-parallel weight's shard is a column block, so
consecutive local rows are far apart globally), but it is exactly the union of at most
``2 * ndim - 1`` boxes, each a *contiguous* sub-range of ``[a, b)``:

    shape (4, 6), range [3, 20):   row 0 cols 3..5  |  rows 1..2 all cols  |  row 3 cols 0..1

``flat_range_boxes`` returns them in flat order (so box ``i`` is ``flat[lo_i:hi_i].view(sizes_i)``
of the range's data, no copy). ``to_global`` shifts a local box by the shard's offset
along the split dimension (the shard grid is tp, or etp for routed experts: ``param_meta.shard_grid``) and clips rows past the unpadded vocabulary (padding rows exist
only in memory: the checkpoint holds the canonical, unpadded tensor).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Box:
    """``sizes`` elements at ``offsets`` of a tensor; ``flat_start`` is where its data starts
    inside the flat range it was cut from (its data is ``prod(sizes)`` consecutive elements)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    flat_start: int

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def flat_range_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """Boxes covering elements ``[start, stop)`` of a row-major tensor of ``shape`` (see module doc)."""
    shape = tuple(shape)
    total = math.prod(shape)
    if not 0 <= start <= stop <= total:
        raise ValueError(f"flat range [{start}, {stop}) is outside a tensor of shape {shape} ({total} elements)")
    return _cut(shape, start, stop, 0)


def _cut(shape: tuple[int, ...], a: int, b: int, base: int) -> list[Box]:
    """Boxes of ``[a, b)`` in the coordinates of ``shape``; ``base`` is the flat position of ``a``
    inside the range being cut (it becomes the boxes' ``flat_start``)."""
    if a >= b:
        return []
    if not shape:  # a 0-d tensor: its one element
        return [Box((), (), base)]
    if len(shape) == 1:
        return [Box((a,), (b - a,), base)]
    inner = math.prod(shape[1:])
    out: list[Box] = []
    if a % inner:  # a partial first row
        row = a // inner
        end = min(b, (row + 1) * inner)
        out += [_in_row(row, sub) for sub in _cut(shape[1:], a - row * inner, end - row * inner, base)]
        base, a = base + end - a, end
    rows = (b - a) // inner
    if rows:  # whole rows: one box
        out.append(Box((a // inner,) + (0,) * (len(shape) - 1), (rows, *shape[1:]), base))
        base, a = base + rows * inner, a + rows * inner
    if a < b:  # a partial last row
        out += [_in_row(a // inner, sub) for sub in _cut(shape[1:], 0, b - a, base)]
    return out


def _in_row(row: int, sub: Box) -> Box:
    """A box of row ``row``'s sub-tensor, in the coordinates of the whole tensor."""
    return Box((row, *sub.offsets), (1, *sub.sizes), sub.flat_start)


def to_global(box: Box, local_shape: tuple[int, ...], split_dim: int | None, shard: int,
              unpadded_rows: int | None) -> Box | None:
    """``box`` of shard ``shard`` in the coordinates of the whole, unpadded tensor;
    None when it lies entirely in vocabulary padding.

    The shard is chunk ``shard`` along ``split_dim`` (None: replicated over its group), each chunk
    ``local_shape[split_dim]`` long; ``unpadded_rows`` cuts dim 0 of the whole tensor.
    """
    offsets, sizes = list(box.offsets), list(box.sizes)
    if split_dim is not None:
        offsets[split_dim] += shard * local_shape[split_dim]
    if unpadded_rows is not None and sizes:
        keep = min(offsets[0] + sizes[0], unpadded_rows) - offsets[0]
        if keep <= 0:
            return None
        sizes[0] = keep  # rows are outermost: the kept rows are a prefix of the box's data
    return Box(tuple(offsets), tuple(sizes), box.flat_start)


def global_shape(local_shape: tuple[int, ...], split_dim: int | None, shards: int,
                 unpadded_rows: int | None) -> tuple[int, ...]:
    """The whole tensor's canonical shape (``shards`` chunks joined, vocabulary padding dropped)."""
    shape = list(local_shape)
    if split_dim is not None:
        shape[split_dim] *= shards
    if unpadded_rows is not None:
        shape[0] = unpadded_rows
    return tuple(shape)
