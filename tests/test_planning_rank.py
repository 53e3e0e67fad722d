"""The issue's rank rule on published runs (issue 26): for every held-out row of ``published_runs.yaml``
the published layout ranks in the planner's top 5, or it is predicted within 3% of the best layout
found (every layout above it is at most 3% faster).

Independent reference: the layout the source actually ran. The search is held at the source's
recompute mode and ZeRO stage (``validation.rank_check``). Rows that miss today are listed with their
measured gap (``python -m parallel3d.planning.validation --rank``); the test fails on a new miss and
on a listed row that starts passing. Rows on more than ``CI_MAX_GPUS`` GPUs take minutes to search
and run with ``--extended`` only.
"""

from __future__ import annotations

import pytest

from parallel3d.planning.published import load_published_runs
from parallel3d.planning.planner import evaluate
from parallel3d.planning.validation import rank_search, run_cluster, run_config, run_layout, run_options, validate_run

CI_MAX_GPUS = 128
# Measured 2026-12-06 with causal flash attention priced at its unmasked tiles and each pipeline chunk priced
# by its own layers (per-row `validation.validate_run(run, with_rank=True)` over every held-out row, the
# source-framework search: sequence parallelism held at the published setting, 1F1B/interleaved only) on
# all 36 scored held-out rows: 14 pass (Nemotron-4 340B on 3,072 and 6,144 GPUs now among them); these 22
# miss. Each entry: rank, gap (predicted step time over the best searched layout's) and `validation
# --rank`'s line on why.
KNOWN_RANK_MISSES: dict[str, str] = {
    "narayanan21_gpt_3.6b":
        "rank 16, +6.3%; best tp=1 pp=1 dp=64 mbs=8 zero=0 rc=full: published loses in compute +0.16 s, tp "
        "+0.15 s (Table 1 is weak scaling at a fixed dp=32, not a chosen layout)",
    "folding_qwen2_57b_mcore_64gpus":
        "rank 17, +8.4%; best tp=2 ep=4 pp=2 dp=16 v=3 mbs=1 zero=1 rc=none sp: published loses in bubble "
        "+0.75 s (the source's vp is not stated, priced as 1)",
    "narayanan21_gpt_7.5b":
        "rank 17, +11.5%; best tp=1 pp=2 dp=64 v=4 mbs=2 zero=0 rc=full: published loses in tp +0.36 s, "
        "compute +0.13 s, dp +0.09 s (Table 1 is weak scaling at a fixed dp=32, not a chosen layout)",
    "folding_mixtral_8x22b_folding_128gpus":
        "rank 11, +11.5%; best tp=2 ep=4 pp=4 dp=16 v=4 mbs=1 zero=1 rc=none sp: published loses in bubble "
        "+0.75 s, compute +0.04 s, ep +0.03 s (the source's vp is not stated, priced as 1)",
    "mcore08_gpt_16b_192gpus":
        "rank 7, +10.0%; best tp=4 pp=1 dp=48 mbs=4 zero=1 rc=none sp: published loses in dp +0.05 s, compute "
        "+0.02 s, bubble +0.00 s",
    "narayanan21_gpt3_175b_384gpus":
        "rank 17, +9.2%; best tp=4 pp=16 dp=6 v=3 mbs=1 zero=0 rc=full: published loses in tp +3.87 s, "
        "compute +2.95 s, dp +0.14 s",
    "mcore08_gpt_32b_384gpus":
        "rank 12, +35.6%; best tp=4 pp=1 dp=96 mbs=2 zero=1 rc=none sp: published loses in dp +0.21 s, "
        "compute +0.03 s, optimizer +0.00 s",
    "narayanan21_gpt_39.1b":
        "rank 17, +17.6%; best tp=2 pp=8 dp=32 v=3 mbs=1 zero=0 rc=full: published loses in tp +1.45 s, "
        "compute +1.01 s, dp +0.67 s (Table 1 is weak scaling at a fixed dp=32, not a chosen layout)",
    "nemotron4_15b_dp96":
        "rank 17, +55.5%; best tp=2 pp=1 dp=384 mbs=1 zero=1 rc=none sp: published loses in tp +0.11 s, dp "
        "+0.07 s, compute +0.02 s (the cost model prefers tp2 for a 15B model)",
    "narayanan21_gpt_76.1b":
        "rank 15, +11.7%; best tp=4 pp=8 dp=32 v=4 mbs=1 zero=0 rc=full: published loses in compute +1.50 s, "
        "tp +0.92 s, dp +0.47 s (Table 1 is weak scaling at a fixed dp=32, not a chosen layout)",
    "folding_mixtral_8x22b_folding_1024gpus":
        "rank 17, +19.7%; best tp=2 ep=4 pp=8 dp=64 v=4 mbs=1 zero=1 rc=none sp: published loses in bubble "
        "+0.58 s, compute +0.06 s, ep +0.02 s (the source's vp is not stated, priced as 1)",
    "folding_qwen2_57b_folding_1024gpus":
        "rank 17, +21.7%; best tp=1 ep=8 pp=4 dp=256 v=4 mbs=1 zero=1 rc=none: published loses in bubble "
        "+0.22 s, ep +0.05 s, compute +0.03 s (the source's vp is not stated, priced as 1)",
    "narayanan21_gpt3_175b_1024gpus":
        "rank 15, +11.1%; best tp=4 pp=16 dp=16 v=3 mbs=1 zero=0 rc=full: published loses in tp +1.45 s, "
        "compute +1.07 s, bubble +0.73 s",
    "folding_mixtral_8x22b_folding_128k_1024gpus":
        "rank 17, +20.6%; best tp=8 cp=8(p2p) pp=2 dp=8 v=3 mbs=1 zero=1 rc=none sp: published loses in "
        "bubble +4.05 s, ep +1.75 s, pp +0.16 s",
    "narayanan21_gpt3_175b_1536gpus":
        "rank 15, +11.8%; best tp=4 pp=16 dp=24 v=3 mbs=1 zero=0 rc=full: published loses in tp +0.97 s, "
        "compute +0.74 s, bubble +0.54 s",
    "nemotron4_15b_dp192":
        "rank 17, +55.6%; best tp=2 pp=1 dp=768 mbs=1 zero=1 rc=none sp: published loses in tp +0.11 s, dp "
        "+0.07 s, compute +0.02 s (the cost model prefers tp2 for a 15B model)",
    "mcore08_gpt_119b_1536gpus":
        "rank 17, +14.3%; best tp=8 pp=12 dp=16 v=4 mbs=1 zero=1 rc=none sp: published loses in compute +0.31 "
        "s, bubble +0.12 s, dp +0.10 s",
    "narayanan21_gpt_310.1b":
        "rank 8, +6.8%; best tp=8 pp=12 dp=20 v=4 mbs=1 zero=0 rc=full: published loses in bubble +2.71 s, "
        "compute +0.41 s",
    "nemotron4_15b_dp288":
        "rank 17, +55.6%; best tp=2 pp=1 dp=1152 mbs=1 zero=1 rc=none sp: published loses in tp +0.11 s, dp "
        "+0.07 s, compute +0.02 s (the cost model prefers tp2 for a 15B model)",
    "mcore08_gpt_177b_2304gpus":
        "rank 17, +15.1%; best tp=8 pp=9 dp=32 v=4 mbs=1 zero=1 rc=none sp: published loses in bubble +0.43 "
        "s, compute +0.31 s, optimizer +0.00 s",
    "mcore08_gpt_177b_4608gpus":
        "rank 17, +25.6%; best tp=8 pp=9 dp=64 v=4 mbs=1 zero=1 rc=none sp: published loses in bubble +0.50 "
        "s, compute +0.16 s, optimizer +0.00 s",
    "mcore08_gpt_462b_6144gpus":
        "rank 11, +14.5%; best tp=8 pp=12 dp=64 v=4 mbs=1 zero=1 rc=none sp: published loses in bubble +1.47 "
        "s, compute +0.48 s, optimizer +0.00 s",
}


def _rows():
    out = []
    for run in load_published_runs():
        if run.split != "held_out" or validate_run(run).error is None:
            continue
        marks = [pytest.mark.extended] if run.hardware.gpus > CI_MAX_GPUS else []
        out.append(pytest.param(run, id=run.id, marks=marks))
    return out


@pytest.mark.parametrize("run", _rows())
def test_published_layout_ranks_top5_or_within_3_percent(run):
    config, layout, cluster, options = run_config(run), run_layout(run), run_cluster(run), run_options(run)
    step = evaluate(config, layout, cluster, options).step
    position, ok, gap, why = rank_search(config, layout, cluster, step, options)
    print(f"{run.id}: rank {position}, {100 * gap:+.1f}% slower than the best found; {why}")
    if run.id in KNOWN_RANK_MISSES:
        assert not ok, f"{run.id} now passes the rank rule (rank {position}): drop it from KNOWN_RANK_MISSES"
    else:
        assert ok, f"{run.id}: published layout ranks {position}, {100 * gap:+.1f}% slower than the best found; {why}"
