"""The fitted GEMM curve is the compute ceiling plus the HBM roofline (``parallel3d.planning.gemm``).

``matmul_efficiency * x / (x + gemm_knee)`` with ``gemm_knee = matmul_efficiency * peak / HBM bandwidth``
is exactly ``time = FLOPs / (matmul_efficiency * peak) + bytes / HBM bandwidth`` for a GEMM that moves its
three operands once (``2 (mk + kn + mn)`` bf16 bytes): the compute at the large-GEMM rate and the operand
traffic at the datasheet bandwidth, not overlapped. The knees that ``planning.fit`` found on the calibration
rows alone (A100 and H100 families) sit at that value, from the datasheet peak and bandwidth, which the GEMM
curve itself never reads (the fit prices whole rows, whose elementwise terms do). References: the two-term time written out here, and each family's datasheet numbers in its
device YAML.
"""

from __future__ import annotations

import itertools

import pytest

from parallel3d.planning.devices import DEVICES
from parallel3d.planning.fit import BOUNDS, FAMILIES
from parallel3d.planning.gemm import GemmCurve

BF16_BYTES = 2
# How finely ``planning.fit`` pins a knee: its last golden-section bracket at the default ``--steps 8``
# over the knee's bounds, half of it either side (about 8.6 of 0..800).
FIT_RESOLUTION = 0.6180339887498949 ** 8 * (BOUNDS["gemm_knee"][1] - BOUNDS["gemm_knee"][0]) / 2


def _roofline_knee(name: str) -> float:
    d = DEVICES[name]
    return d.matmul_efficiency * d.peak_flops / d.hbm_bytes_per_s


def test_curve_with_the_roofline_knee_is_compute_plus_operand_traffic():
    peak, eff, bw = 989e12, 0.62, 3.35e12
    curve = GemmCurve(peak_flops=peak, max_efficiency=eff, knee=eff * peak / bw)
    for m, n, k in itertools.product([128, 1024, 4096, 16384], [64, 3072, 16384], [128, 1024, 8192]):
        flops = 2.0 * m * n * k
        two_terms = flops / (eff * peak) + BF16_BYTES * (m * k + k * n + m * n) / bw
        assert curve.seconds(flops, m, n, k) == pytest.approx(two_terms, rel=1e-12)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fitted_knee_is_the_datasheet_roofline(family):
    """Within the fit's own resolution (``FIT_RESOLUTION``; found 2026-12-06: H100 187, 2026-12-07: 180, against 0.635 x 989 /
    3.35 = 187.5, A100 108 against 0.703 x 312 / 2.039 = 107.6). A refit that lands off it means the fitted
    curve stopped being the compute + HBM-traffic time above: say why before moving this bound."""
    fitted = DEVICES[family].gemm_knee
    assert fitted == pytest.approx(_roofline_knee(family), abs=FIT_RESOLUTION)
