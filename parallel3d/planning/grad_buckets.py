"""Gradient buckets as ``parallel3d.zero``'s optimizer cuts them, priced for the memory estimate.

Invariant: the bucket sizes are the runtime's own (``zero.assembly.bucket_numels``, ``BUCKET_SIZE_MB`` the
``ZeroOptions.bucket_size_mb`` default): about 1 MiB first, then up to ``bucket_size_mb`` of parameter-dtype
bytes each; ZeRO stages >= 1 own ``1 / owners`` of each bucket; at stage 3 no bucket spans two gather units.
"""

from __future__ import annotations

import math

from parallel3d.planning.activations import ActivationAssumptions
from parallel3d.zero.assembly import bucket_numels
from parallel3d.zero.options import ZeroOptions

BUCKET_SIZE_MB: float = ZeroOptions.bucket_size_mb


def largest_grad_piece(params: int, owners: int, zero_stage: int, weight_bytes: int,
                       bucket_size_mb: float = BUCKET_SIZE_MB) -> int:
    """Elements of the largest gradient piece one rank owns of a group of ``params`` parameters: the
    first bucket holds ~1 MiB, the rest fills buckets of ``bucket_size_mb``; stages >= 1 own
    ``1 / owners`` of each bucket."""
    first, bucket = bucket_numels(bucket_size_mb, weight_bytes)
    piece = params if params <= first else max(min(bucket, params - first), first)
    return math.ceil(piece / owners) if zero_stage >= 1 else piece


def bucket_count(params: float, weight_bytes: int, bucket_size_mb: float = BUCKET_SIZE_MB) -> int:
    """How many buckets (one collective call each) the runtime cuts ``params`` gradients into: the ~1 MiB
    first bucket, then ``bucket_size_mb`` each, as ``largest_grad_piece`` sizes them."""
    first, bucket = bucket_numels(bucket_size_mb, weight_bytes)
    return 1 if params <= first else 1 + math.ceil((params - first) / bucket)


def unit_bucket_count(params: float, units: int, weight_bytes: int, bucket_size_mb: float = BUCKET_SIZE_MB) -> int:
    """Buckets at ZeRO-3 (one all-gather and one reduce-scatter call each: ``params_sharded``, ``grad_sharded``),
    where a bucket never spans two gather units (``zero.assembly.build_layouts``): ``params`` spread evenly
    over ``units``, the first unit cut as ``bucket_count`` cuts a buffer, every other one into whole buckets."""
    units = max(1, units)
    per_unit = params / units
    _, bucket = bucket_numels(bucket_size_mb, weight_bytes)
    return bucket_count(per_unit, weight_bytes, bucket_size_mb) + (units - 1) * max(1, math.ceil(per_unit / bucket))


def reduce_scatter_staging_bytes(groups: list[tuple[int, int, int]], grad_bytes: int,
                                 assumptions: ActivationAssumptions) -> float:
    """Bytes alive at the end of backward while stage-1 reduce-scatters run, for ``(params, owners,
    zero_stage)`` gradient groups: the backend's copy of each whole buffer and the owned pieces
    (``ActivationAssumptions.reduce_scatter_staging_copies``)."""
    copies = assumptions.reduce_scatter_staging_copies
    return sum(grad_bytes * params * (copies + 1 / owners) for params, owners, stage in groups
               if copies and stage == 1 and owners > 1)
