"""The grad norm's sum of squares (``zero.clip.sq_sum_fp64``) against Python's exactly rounded ``math.fsum``.

The squares of fp32 values are exact in fp64, so the only rounding left is the fp64 additions':
a few ulps over a few hundred thousand elements. Rounding each square to fp32 first (the earlier
``torch.square(g).sum(dtype=torch.float64)``) is off by ~1e-10 relative here, which RTOL catches.
"""

from __future__ import annotations

import math

import pytest
import torch

from parallel3d.zero.clip import SQ_SUM_CHUNK, sq_sum_fp64

RTOL = 1e-13  # fp64 accumulation (~1e-15 here); fp32-rounded squares miss it by ~3 orders


def _fsum_squares(values: torch.Tensor) -> float:
    """The exactly rounded sum of the exact fp64 squares of ``values`` (fp32)."""
    return math.fsum(v * v for v in values.double().tolist())


@pytest.mark.parametrize("numel", [7, SQ_SUM_CHUNK, 2 * SQ_SUM_CHUNK + 5])
def test_sum_of_squares_matches_fsum(numel):
    values = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 3.0
    got = sq_sum_fp64(values)
    assert got.dtype == torch.float64
    want = _fsum_squares(values)
    assert abs(got.item() - want) <= RTOL * want, (got.item(), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_scaled_sum_rounds_the_scaled_gradient_to_fp32(dtype):
    """``scale * g`` is the fp32 gradient the update reads (``grad.float() * coef``): its squares are summed."""
    scale = 1.0 / 3.0
    values = (torch.randn(SQ_SUM_CHUNK + 11, generator=torch.Generator().manual_seed(1)) * 5.0).to(dtype)
    got = sq_sum_fp64(values, scale).item()
    want = _fsum_squares(values.float() * scale)
    assert abs(got - want) <= RTOL * want, (got, want)


def test_large_values_do_not_overflow_and_non_finite_propagates():
    """An fp32 value above ~1.8e19 squares to inf in fp32 but not in fp64; inf and nan still show."""
    big = torch.tensor([3e30, -2e30, 1.0])
    assert sq_sum_fp64(big).item() == pytest.approx(_fsum_squares(big), rel=RTOL)
    assert math.isinf(sq_sum_fp64(torch.tensor([1.0, math.inf])).item())
    assert math.isnan(sq_sum_fp64(torch.tensor([1.0, math.nan])).item())
