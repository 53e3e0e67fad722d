"""The cost model against published runs (issue 26): every held-out row of ``published_runs.yaml``.

Independent reference: the throughput/MFU the sources published (paper tables, framework READMEs),
converted into the source's own FLOPs convention. Nothing is fitted per row; the model was tuned on
the ``calibration`` split only. Rows the model misses today are listed in ``KNOWN_MISSES`` with the
measured error (reported, not hidden): the test fails if a listed row starts passing (update the
list) or if any other row misses.
"""

from __future__ import annotations

import pytest

from models.config import ModelConfig

from parallel3d.option_checks import ConfigError
from parallel3d.planning.planner import evaluate, finest_virtual_stages, virtual_stage_counts
from parallel3d.planning.request import PlanRequest
from parallel3d.planning.published import load_published_runs
from parallel3d.planning.layout import Layout
from parallel3d.planning.source_frameworks import run_options, source_flops_per_token
from parallel3d.planning.validation import (MFU_TOLERANCE, _rank_request, format_rows, run_cluster, run_config,
                                            run_layout, summary, validate)
from parallel3d.topology import LayoutError

# Held-out rows outside the 10% bar with today's model (measured by
# `python -m parallel3d.planning.validation`); see README "Where issue 26 stands" and docs/planner.md.
KNOWN_MISSES: dict[str, str] = {  # row -> error and the term the breakdown points at
    # Unstated fields (a row's `unstated`) priced at the planner's best fitting choice, as the rank check
    # does (validation.priced_candidate; '*' in the table); device GEMM curves refitted on the calibration
    # rows so priced (python -m parallel3d.planning.fit --knobs matmul_efficiency,gemm_knee).
    # The head and loss priced on a pp1 v1 chunk (it was dropped) and Megatron-Core's last gradient /
    # first parameter bucket exposed (CostOptions.grad_bucket) took mcore08 1.7B / 16B and Nemotron-4 15B
    # dp96 / dp192 inside the bar (+26 / +12 / +20 / +22% -> +6.3 / +5.2 / +6.9 / +8.7%).
    # Virtual stages tried down to one layer per chunk (validation.max_virtual_stages: GPT 462B and Mixtral at
    # pp 8 have 7-layer stages) and Megatron-LM 2021's fp16 gradients all-reduced in fp16 took GPT 7.5B and 462B
    # inside the bar (-12.0 / -11.0% -> -8.2 / +1.9%, GEMM curves refitted: A100 0.703 / 108, H100 0.623 / 187).
    # TransformerEngine's userbuffers TP overlap priced from its mechanism (planning.tp_overlap: SMs the
    # communication kernels take, a pipelined reduce-scatter's last slice) took MCore GPT 32B inside the bar
    # (+10.4% -> +5.4%; its --tp-comm-overlap had been priced free).
    # The H100 curve refitted on today's calibration rows (0.623 -> 0.635, knee 187 unchanged; it had not been
    # refitted after the TP-overlap pricing) took MoE Folding Mixtral 8x22B on 128 / 1,024 GPUs inside the bar
    # (-10.3 / -10.8% -> -8.9 / -9.4%): every H100 row rises about 1.3 points, nothing Mixtral-specific (docs/planner.md, "GEMM curve and micro-batch completion, tried").
    # NCCL's ring latency per collective call across nodes (comm_cost.ring_latency, tuning.cc's ring / Simple
    # constants), with each source framework's buckets (Megatron-Core: max(4e7, 1e6 x dp) parameters on the first
    # stage's first chunk, one bucket per other chunk; before Megatron-LM 0fda386c04 a fixed 4e7:
    # source_frameworks.FIXED_BUCKET_SOURCES) took Nemotron-4 15B dp288 inside the bar (+18.8% -> +1.1%; dp96 /
    # dp192 +7.7 / +9.6% -> +7.6 / +2.8%), the H100 curve refitted on the calibration rows (0.635 / 187 -> 0.635 /
    # 180). Mixtral 8x22B on 1,024 GPUs passes at -9.9% (-10.2% on the old curve).
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


def _held_out_row(held_out, run_id: str):
    """The MFU check's own row for ``run_id`` (the module's ``validate`` result: each row is priced once)."""
    return next(r for r in held_out if r.run.id == run_id)


def test_unstated_virtual_stages_are_priced_at_the_best_fitting_choice_in_the_mfu_check(held_out):
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
        for v in range(1, 56 // 8 + 1):  # down to one of its 56 layers per virtual stage at pp 8
            try:
                trial = layout.replace(micro_batch_size=mbs, virtual_stages=v,
                                       schedule="1f1b" if v == 1 else "interleaved_1f1b")
                cand = evaluate(config, trial, cluster, options)
            except (ConfigError, LayoutError, ValueError):  # e.g. microbatches not a multiple of pp
                continue
            if cand.peak_bytes <= budget and cand.step.step_time_s < best.step_time_s:
                best = cand.step
    assert best.layout.virtual_stages > 1  # the placeholder v = 1 is not the best fitting choice
    row = _held_out_row(held_out, run.id)
    assert row.priced == best.layout
    assert row.predicted_mfu == pytest.approx(mfu(best), rel=1e-12)
    assert row.predicted_mfu > mfu(as_written) * 1.05  # the bubble of the placeholder is not priced


def test_virtual_stages_are_tried_down_to_one_layer_per_chunk(held_out):
    # Megatron-LM interleaves down to one layer per virtual stage, so a source free to pick v could run
    # v = layers / pp; the planner's default cap (4) is only a search-cost choice. The rank check asks the
    # planner's one rule (virtual_stage_counts) with its cap raised to the published depth's finest v
    # (planner.finest_virtual_stages). Hand values: GPT 462B, 112 layers at pp 16 -> 7; GPT 177B, 96 at pp 6
    # -> 16; Llama 3 405B, 126 at pp 16 written as v 8 (uneven: 128 chunks, the first and last may hold only
    # the embedding / head) -> 8; a pp 1 layout, or 2 layers per stage, keeps the default 4.
    lay = Layout(tp=8, pp=16, dp=48, micro_batch_size=1, seq_len=4096, global_batch_size=3072)
    assert _rank_request(lay, 112, uneven=False).max_virtual_stages == 7
    assert _rank_request(lay.replace(pp=6, dp=128), 96, uneven=False).max_virtual_stages == 16
    llama = lay.replace(virtual_stages=8, schedule="interleaved_1f1b")
    assert _rank_request(llama, 126, uneven=True).max_virtual_stages == 8
    assert _rank_request(lay.replace(pp=1, dp=768), 32).max_virtual_stages == 4
    assert _rank_request(lay.replace(pp=64, dp=12), 128).max_virtual_stages == 4
    # One layer per chunk: 112 at pp 16 -> 7; 126 at pp 16 splits evenly not at all (1), unevenly into 8
    # chunks a stage (126 layers + an embedding-only and a head-only chunk = 128).
    assert finest_virtual_stages(112, 16, uneven=False) == 7
    assert (finest_virtual_stages(126, 16, uneven=False), finest_virtual_stages(126, 16, uneven=True)) == (1, 8)
    # The rule itself: the cap, plus one layer per chunk where pp divides the layers (112 at pp 16: 7).
    assert virtual_stage_counts(_model(112), 16, PlanRequest(global_batch_size=3072, seq_len=4096)) == [1, 2, 3, 4, 7]
    assert virtual_stage_counts(_model(112), 16, _rank_request(lay, 112, uneven=False)) == list(range(1, 8))
    assert virtual_stage_counts(_model(126), 16, PlanRequest(global_batch_size=3072, seq_len=4096)) == [1, 2, 3, 4]
    # GPT 462B states no v: 7 layers per stage split evenly only as v = 1 or 7, and the completion takes 7.
    run = next(r for r in load_published_runs() if r.id == "mcore08_gpt_462b_6144gpus")
    assert "layout.vp" in run.unstated
    assert _held_out_row(held_out, run.id).priced.virtual_stages == 7


def _model(layers: int) -> ModelConfig:
    return ModelConfig(arch="gpt", num_layers=layers, hidden_size=256, num_heads=8, num_kv_heads=8,
                       ffn_hidden_size=1024, vocab_size=1024, max_seq_len=4096)


def test_megatron_2021_all_reduces_fp16_gradients_after_the_backward():
    # Megatron-LM's 2021 DDP reduces its gradient buffer in the parameter dtype (fp32 only with
    # --accumulate-allreduce-grads-in-fp32, which it forces for bf16): Narayanan et al.'s fp16 runs move
    # 2 bytes per gradient. Hand count for GPT 7.5B (36 layers, h 4096, vocab 51,200 tied, learned positions)
    # at tp 4 on 16 DGX A100s: per layer a rank holds (12 h^2 + 7 h) / 4 (the split qkv, fc1 weights and
    # biases, proj and fc2 weights) + 6 h held whole (proj and fc2 biases, two LayerNorms); its dp group is 2
    # ranks on each of 16 nodes, so the ring all-reduce takes 2 x (1/2 x B / NVLink + 15/16 x B / 2 / NIC)
    # with B = 2 bytes x its parameters (one step: micro-batch 1, not overlapped in 2021).
    run = next(r for r in load_published_runs() if r.id == "narayanan21_gpt_7.5b")
    config, cluster = run_config(run), run_cluster(run)
    layout = run_layout(run).replace(micro_batch_size=1)
    h, layers, tp = 4096, 36, 4
    per_layer = (3 * h * h + 3 * h) / tp + (h * h) / tp + h + (4 * h * h + 4 * h) / tp + (4 * h * h) / tp + h + 4 * h
    embeddings = 51200 // tp * h + 2048 * h + 2 * h  # vocab-parallel words, positions, final LayerNorm
    params = layers * per_layer + embeddings
    nbytes = 2 * params
    link = 0.8  # the device's link_efficiency
    # ... plus NCCL's ring latency of that one call (2021: one all_reduce of the whole buffer), each of its two
    # ring passes over 32 ranks on 16 nodes: 8.4 us + 16 NVLink steps x 3.4 us + 15 network steps x 14 us
    # (src/graph/tuning.cc, ring / Simple).
    expected = 2 * (0.5 * nbytes / (300e9 * link) + 15 / 16 * nbytes / 2 / (25e9 * link)
                    + (8.4 + 16 * 3.4 + 15 * 14.0) * 1e-6)
    step = evaluate(config, layout, cluster, run_options(run)).step
    assert step.dp_exposed_s == pytest.approx(expected, rel=1e-3)
