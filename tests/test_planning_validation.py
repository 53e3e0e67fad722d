"""The cost model against published runs (issue 26): every held-out row of ``published_runs.yaml``.

Independent reference: the throughput/MFU the sources published (paper tables, framework READMEs),
converted into the source's own FLOPs convention. Nothing is fitted per row; the model was tuned on
the ``calibration`` split only. Rows the model misses today are listed in ``KNOWN_MISSES`` with the
measured error (reported, not hidden): the test fails if a listed row starts passing (update the
list) or if any other row misses.
"""

from __future__ import annotations

import pytest

from parallel3d.option_checks import ConfigError
from parallel3d.planning.planner import PlanRequest, evaluate
from parallel3d.planning.published import load_published_runs
from parallel3d.planning.validation import (MFU_TOLERANCE, format_rows, run_cluster, run_config, run_layout,
                                            run_options, source_flops_per_token, summary, validate, validate_run)
from parallel3d.topology import LayoutError

# Held-out rows outside the 10% bar with today's model (measured by
# `python -m parallel3d.planning.validation`); see README "Planner validation".
KNOWN_MISSES: dict[str, str] = {  # row -> error and the term the breakdown points at
    # Unstated fields (a row's `unstated`) priced at the planner's best fitting choice, as the rank check
    # does (validation.priced_candidate; '*' in the table); device GEMM curves refitted on the calibration
    # rows so priced (python -m parallel3d.planning.fit --knobs matmul_efficiency,gemm_knee).
    # The head and loss priced on a pp1 v1 chunk (it was dropped) and Megatron-Core's last gradient /
    # first parameter bucket exposed (CostOptions.grad_bucket) took mcore08 1.7B / 16B and Nemotron-4 15B
    # dp96 / dp192 inside the bar (+26 / +12 / +20 / +22% -> +6.3 / +5.2 / +6.9 / +8.7%).
    "narayanan21_gpt_7.5b": "-12.0%: tp4 at pp1, 2021 TP all-reduces exposed; micro-batch completed at 8",
    "mcore08_gpt_32b_384gpus": "+10.4%: micro-batch completed at 4 (one microbatch per step, so DP hides behind "
                               "the whole backward but its last bucket); compute 97% of the step at tp8, h=7168",
    "nemotron4_15b_dp288": "+17.3%: same per-rank work as dp96 / dp192 (+6.3 / +8.1%); the published step "
                           "grows 0.57 -> 0.64 s with dp, the priced exposed DP bucket only by ~9 ms (bucket "
                           "197M -> 288M parameters): cross-node collectives at 288 nodes are unpriced",
    # Cp ranks' head/embedding/pp messages at seq/cp tokens, Llama 3 128K's all-gather CP as stated, the
    # expert exchange at a rank's own 1/tp of the tokens took Llama 3 128K, Mixtral 128K and Qwen2-57B 1,024
    # GPUs inside the bar (-31.7 / -15.5 / -11.8% -> -0.9 / -9.9 / -9.0%).
    # One layer per chunk searched above the v <= 4 cap (planner.virtual_stage_counts: v = 7 for 7 layers a
    # stage) took MCore 462B inside the bar (-11.0% -> +1.9%) and Mixtral 8x22B on 128 / 1,024 GPUs from -13.6 /
    # -13.5% to -10.3 / -10.8% (-9.7 / -10.2% before the H100 curve was refitted on the calibration rows so
    # completed: matmul_efficiency 0.628 -> 0.623).
    "folding_mixtral_8x22b_folding_128gpus": "-10.3%: v = 7 completed; the MoE calibration rows run -6 to -8% too "
                                             "(H100 curve fitted mostly on dense rows)",
    "folding_mixtral_8x22b_folding_1024gpus": "-10.8%: as on 128 GPUs, plus the expert ZeRO-1 reduce/gather over "
                                              "16 nodes (dp 7% of the step)",
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


def test_unstated_virtual_stages_are_priced_at_the_best_fitting_choice_in_the_mfu_check():
    # The MFU check prices a row's unstated fields as the rank check does (``priced_candidate``). Reference:
    # every (micro-batch, v) the search could try for the published degrees, each evaluated on its own, the
    # fastest one fitting memory turned into an MFU by hand (tokens/s per GPU x the source's FLOPs per token
    # over its peak). MoE Folding Mixtral 8x22B on 128 GPUs states neither v nor the micro-batch (v = 1 in
    # the data file is a placeholder: a 1F1B bubble).
    run = next(r for r in load_published_runs() if r.id == "folding_mixtral_8x22b_folding_128gpus")
    assert {"layout.vp", "layout.micro_batch"} <= set(run.unstated)
    config, layout, cluster, options = run_config(run), run_layout(run), run_cluster(run), run_options(run)
    assert layout.virtual_stages == 1
    budget = cluster.device.memory_bytes * PlanRequest(1, 1).memory_fraction
    peak = (run.flops_convention.peak_tflops or cluster.device.peak_flops / 1e12) * 1e12

    def mfu(step):
        return step.tokens_per_s() / cluster.gpus * source_flops_per_token(run, config) / peak

    as_written = evaluate(config, layout, cluster, options).step
    best = as_written
    for mbs in (1, 2, 4, 8):
        for v in (1, 2, 3, 4, 7):  # the search's cap of 4, and one layer per chunk (56 layers / pp 8)
            try:
                trial = layout.replace(micro_batch_size=mbs, virtual_stages=v,
                                       schedule="1f1b" if v == 1 else "interleaved_1f1b")
                cand = evaluate(config, trial, cluster, options)
            except (ConfigError, LayoutError, ValueError):  # e.g. microbatches not a multiple of pp
                continue
            if cand.peak_bytes <= budget and cand.step.step_time_s < best.step_time_s:
                best = cand.step
    assert best.layout.virtual_stages > 1  # the placeholder v = 1 is not the best fitting choice
    row = validate_run(run)
    assert row.priced == best.layout
    assert row.predicted_mfu == pytest.approx(mfu(best), rel=1e-12)
    assert row.predicted_mfu > mfu(as_written) * 1.05  # the bubble of the placeholder is not priced
