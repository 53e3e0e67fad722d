"""ZeRO-2 and ZeRO-3 inside a full 3D layout (tp=2 x pp=2 x dp=2 on 8 gloo ranks) against single-process AdamW.

In its own module so that the 8-rank worker pool is spawned once, first (the
harness keeps two pool sizes warm; the other ZeRO tests use 2 and 4 ranks).
"""

import pytest

from tests.test_zero_parallel import _run


@pytest.mark.slow
def test_zero2_and_zero3_on_tp2_pp2_dp2():
    _run(2, 2, 2, (2, 3), 5, "tp=2 pp=2 dp=2")
