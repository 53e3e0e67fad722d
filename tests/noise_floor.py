"""A drawn model shape's reference noise floor, and the per-step tolerance its layout check earns from it.

Invariant: a layout case that misses ``RTOL`` is judged again, step by step, at
``tolerance(floor[step]) = max(RTOL, NOISE_FACTOR * floor[step])``. ``floor[step]`` is the largest relative
deviation (loss, grad norm, eval loss; this step or any before it) between the single-process reference
and the same single process with one sample per micro-batch: the same math in another summation order,
so what rounding alone moves on this shape by that step. A miss therefore always means more than
``NOISE_FACTOR`` times the rounding the reference itself shows, as a miss of ``RTOL`` does for the layout
matrix's fixed models (their floor stays < RTOL/10, ``tests/test_layout_matrix.py``). Step 1 is
computed before any update, its floor is bare forward/backward rounding (~1e-7): it stays at ``RTOL``,
where a wrong gradient shows. A shape is a usable probe only while its floor stays below ``FLOOR_CAP``.

Why some shapes sit higher: Adam's first updates are ~lr * sign(grad) for tiny gradients, and a top-k
router flips an expert choice on a near tie; rounding crosses either threshold in one run and not the
other. Case 0 (MoE, one kv head; ``scripts/check_layouts.py --shapes --case 0``): the reference with
another micro-batching moves its step-4 grad norm by 5e-6 to 1.4e-5 (the layout: 1.6e-5 to 1.7e-5),
and over 10 steps both wander between 2e-7 and 2.5e-5 without a trend (docs/testing.md, "Odd degrees and odd
model shapes").
"""

from __future__ import annotations

import dataclasses
import os

from tests import layout_run as lr
from tests.layout_matrix import RTOL, LayoutCase

NOISE_FACTOR = 10
# Tolerances then stay <= 1e-3. A real cp bug for scale: the sequence aux loss's expert counts left unsummed
# over cp moved case 0's step-1 grad norm by 2.7e-4 and step 2's by 6.1e-3 (step 1 is judged at RTOL anyway).
FLOOR_CAP = 10 * RTOL


def tolerance(floor: float) -> float:
    return max(RTOL, NOISE_FACTOR * floor)


def floors(curve: list, reference: list) -> dict[int, float]:
    """step -> the largest relative deviation of ``curve`` from ``reference`` up to that step."""
    out, worst = {}, 0.0
    for got, ref in zip(curve, reference):
        worst = max([worst, *(abs(a - b) / abs(b) for a, b in zip(got[1:], ref[1:]) if b is not None)])
        out[ref[0]] = worst
    return out


def measure(case: LayoutCase, reference: list, out_dir: str, cache_dir: str) -> dict[int, float]:
    """``case``'s noise floors: its reference run again with one sample per micro-batch, vs ``reference``."""
    g = case.train["global_batch_size"]
    reordered = lr.train_reference(case.job({}, {"global_batch_size": g, "micro_batch_size": 1},
                                            os.path.join(out_dir, "noise-floor"), cache_dir), quiet=True)
    return floors(reordered, reference)


def judge(result: lr.CaseResult, out_dir: str, cache_dir: str) -> tuple[lr.CaseResult, dict[int, float]]:
    """``result`` as is if it meets RTOL (or crashed; floors empty: not measured); else the floors (one
    more single-process run) and ``result`` judged again at each step's ``tolerance``."""
    if result.ok or result.error is not None:
        return result, {}
    measured = measure(result.case, result.reference, out_dir, cache_dir)
    if max(measured.values()) >= FLOOR_CAP:  # rounding alone reaches the cap: no verdict on the layout
        return dataclasses.replace(result, error=f"noise floor {max(measured.values()):.1e} >= {FLOOR_CAP:.0e}"), measured
    rtols = {step: tolerance(f) for step, f in measured.items()}
    return dataclasses.replace(result, rtol_by_step=rtols, worst={}), measured
