"""``planning.grad_buckets.largest_grad_piece`` against the runtime's own bucketing (``zero.buffers.BufferLayout``
built the way ``zero.assembly.build_layouts`` builds it): the estimate's largest owned gradient piece is the
runtime's, to within one parameter (the runtime closes a bucket at a parameter boundary)."""

from __future__ import annotations

import math

import pytest
import torch

from parallel3d.planning.grad_buckets import bucket_count, largest_grad_piece, unit_bucket_count
from parallel3d.zero.assembly import bucket_numels
from parallel3d.zero.buffers import BufferLayout

PARAM_NUMEL = 4096  # small parameters: bucket edges land within one of them


def runtime_layout(params: int, owners: int, zero_stage: int, dtype: torch.dtype, bucket_size_mb: float) -> BufferLayout:
    """A ``BufferLayout`` of ``params`` elements in PARAM_NUMEL-sized parameters, as the runtime cuts it."""
    count = math.ceil(params / PARAM_NUMEL)
    named = [(f"p{i}", torch.nn.Parameter(torch.empty(PARAM_NUMEL, dtype=dtype, device="meta"))) for i in range(count)]
    first_numel, bucket_numel = bucket_numels(bucket_size_mb, dtype.itemsize)  # as build_layouts sizes them
    sharded = zero_stage >= 1
    layout = BufferLayout(named, bucket_numel=bucket_numel, reduce_kind="dp_cp", replicas=owners,
                          owner_count=owners if sharded else 1, owner_index=0, count_in_norm=lambda p: True,
                          first_bucket_numel=first_numel)
    return layout


def runtime_largest_piece(params: int, owners: int, zero_stage: int, dtype: torch.dtype, bucket_size_mb: float) -> int:
    """Largest ``piece_size`` of the runtime's layout of ``params`` elements."""
    return max(b.piece_size for b in runtime_layout(params, owners, zero_stage, dtype, bucket_size_mb).buckets)


@pytest.mark.parametrize("params", [40 * PARAM_NUMEL, 100 * PARAM_NUMEL, 1000 * PARAM_NUMEL])
@pytest.mark.parametrize("owners,zero_stage", [(1, 0), (4, 0), (4, 1), (8, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_largest_piece_matches_the_runtime_buckets(params, owners, zero_stage, dtype):
    bucket_size_mb = 2.0
    estimate = largest_grad_piece(params, owners, zero_stage, dtype.itemsize, bucket_size_mb)
    runtime = runtime_largest_piece(params, owners, zero_stage, dtype, bucket_size_mb)
    slack = math.ceil(PARAM_NUMEL / (owners if zero_stage >= 1 else 1)) + 1
    assert abs(estimate - runtime) <= slack, (estimate, runtime)


@pytest.mark.parametrize("params", [100, 40 * PARAM_NUMEL, 300 * PARAM_NUMEL, 1000 * PARAM_NUMEL, 2000 * PARAM_NUMEL])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bucket_count_is_the_runtime_bucket_count(params, dtype):
    """The collective calls the cost model charges parallel3d's DP reduction (one per bucket, each paying
    NCCL's ring latency) are the runtime's buckets (sizes here whole multiples of the bucket edges)."""
    bucket_size_mb = 2.0
    runtime = len(runtime_layout(params, 4, 1, dtype, bucket_size_mb).buckets)
    assert bucket_count(params, dtype.itemsize, bucket_size_mb) == runtime


@pytest.mark.parametrize("units", [1, 3, 8])
@pytest.mark.parametrize("per_unit", [250 * PARAM_NUMEL, 600 * PARAM_NUMEL])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unit_bucket_count_is_the_runtime_zero3_bucket_count(units, per_unit, dtype):
    """ZeRO-3's calls (one gather and one reduce-scatter per bucket) are the runtime's buckets when a bucket
    never spans two gather units (``BufferLayout``'s ``unit_of``, as ``build_layouts`` passes it at stage 3)."""
    bucket_size_mb = 2.0
    count = per_unit // PARAM_NUMEL
    named = [(f"u{u}.p{i}", torch.nn.Parameter(torch.empty(PARAM_NUMEL, dtype=dtype, device="meta")))
             for u in range(units) for i in range(count)]
    unit = {id(p): name.split(".")[0] for name, p in named}
    first_numel, bucket_numel = bucket_numels(bucket_size_mb, dtype.itemsize)  # as build_layouts sizes them
    layout = BufferLayout(named, bucket_numel=bucket_numel, reduce_kind="dp_cp", replicas=4, owner_count=4,
                          owner_index=0, count_in_norm=lambda p: True, unit_of=lambda p: unit[id(p)],
                          first_bucket_numel=first_numel)
    assert unit_bucket_count(units * per_unit, units, dtype.itemsize, bucket_size_mb) == len(layout.buckets)
