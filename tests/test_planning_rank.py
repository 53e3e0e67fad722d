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
from parallel3d.planning.validation import rank_check, run_cluster, run_config, run_layout, run_options, validate_run

CI_MAX_GPUS = 128
# Measured 2026-12-05 (gap = predicted step time over the best searched layout's).
KNOWN_RANK_MISSES = {
    "narayanan21_gpt_3.6b",  # rank 16, +6.3%
    "narayanan21_gpt_7.5b",  # rank 17, +12.1%
    "narayanan21_gpt_39.1b",  # rank 17, +20.2%
    "narayanan21_gpt_76.1b",  # rank 17, +14.5%
    "narayanan21_gpt_310.1b",  # rank 17, +10.3%
    "narayanan21_gpt_529.6b",  # rank 17, +12.0%
    "narayanan21_gpt3_175b_384gpus",  # rank 17, +13.1%
    "folding_mixtral_8x22b_folding_128gpus",  # rank 13, +13.0%
    "folding_qwen2_57b_mcore_64gpus",  # rank 12, +5.9%
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
    step = evaluate(config, layout, cluster, options).step.step_time_s
    position, ok, gap = rank_check(config, layout, cluster, step, options)
    print(f"{run.id}: rank {position}, {100 * gap:+.1f}% slower than the best found")
    if run.id in KNOWN_RANK_MISSES:
        assert not ok, f"{run.id} now passes the rank rule (rank {position}): drop it from KNOWN_RANK_MISSES"
    else:
        assert ok, f"{run.id}: published layout ranks {position}, {100 * gap:+.1f}% slower than the best found"
