"""The cost model against published runs (issue 26): every held-out row of ``published_runs.yaml``.

Independent reference: the throughput/MFU the sources published (paper tables, framework READMEs),
converted into the source's own FLOPs convention. Nothing is fitted per row; the model was tuned on
the ``calibration`` split only. Rows the model misses today are listed in ``KNOWN_MISSES`` with the
measured error (reported, not hidden): the test fails if a listed row starts passing (update the
list) or if any other row misses.
"""

from __future__ import annotations

import pytest

from parallel3d.planning.validation import MFU_TOLERANCE, format_rows, summary, validate

# Held-out rows outside the 10% bar with today's model (measured by
# `python -m parallel3d.planning.validation`); see README "Planner validation".
KNOWN_MISSES: dict[str, str] = {  # row -> error and the term the breakdown points at
    # Causal flash attention at its unmasked tiles, its backward 2.5 forwards; device GEMM curves
    # refitted on the calibration rows (python -m parallel3d.planning.fit).
    "torchtitan_llama2_13b_a100": "+12.3%: all compute at tp1 (8k tokens); torchtitan's eager elementwise "
                                  "kernels and FSDP overheads not modelled",
    "mcore08_gpt_1.7b_48gpus": "+27.2%: all compute at tp1, h=2048; a fitted per-layer overhead comes out at "
                               "28 us, far below the ~0.5 ms per layer this row would need",
    "mcore08_gpt_177b_4608gpus": "-15.5%: 1F1B bubble 30% at 12 microbatches (vp not stated, priced as 1)",
    "nemotron4_15b_dp288": "+15.5%: same per-rank work as dp96/dp192; the published MFU falls with dp, "
                           "the model's hierarchical DP reduction does not",
    "folding_mixtral_8x22b_folding_128gpus": "-19.7%: 1F1B bubble 20% (vp not stated, priced as 1)",
    "folding_mixtral_8x22b_folding_1024gpus": "-26.7%: 1F1B bubble 31% at 16 microbatches (vp not stated)",
    "folding_mixtral_8x22b_folding_128k_1024gpus": "-18.5%: attention (58% of a layer) at the per-head GEMM rate, "
                                                   "backward 2.5x; 1F1B bubble (vp not stated)",
    "folding_qwen2_57b_folding_1024gpus": "-21.5%: 1F1B bubble 31% at 8 microbatches (vp not stated)",
    "llama3_405b_128k_16384gpus": "-30.1%: bubble 47% and pp p2p at 16 microbatches (cp16 dp8); attention at "
                                  "the per-head GEMM rate",
}


@pytest.fixture(scope="module")
def held_out():
    return validate("held_out")


def test_enough_scored_rows_cover_dense_moe_and_both_generations(held_out):
    scored = [r for r in held_out if r.error is not None]
    assert len(scored) >= 20
    assert any(r.run.model.moe for r in scored) and any(not r.run.model.moe for r in scored)
    devices = {r.run.hardware.device for r in scored}
    assert {"a100_80gb", "h100_80gb"} <= devices


def test_held_out_mfu_within_10_percent_except_reported_misses(held_out):
    print(format_rows(held_out))
    misses = {r.run.id for r in held_out if r.error is not None and not r.mfu_ok}
    assert misses - set(KNOWN_MISSES) == set(), f"new misses: {sorted(misses - set(KNOWN_MISSES))}"
    assert set(KNOWN_MISSES) - misses == set(), f"now pass, drop from KNOWN_MISSES: {sorted(set(KNOWN_MISSES) - misses)}"
    n, mean, worst = summary([r for r in held_out if r.run.id not in KNOWN_MISSES])
    assert n >= 20 and worst <= MFU_TOLERANCE


def test_calibration_rows_are_not_in_the_held_out_table(held_out):
    assert all(r.run.split == "held_out" for r in held_out)
