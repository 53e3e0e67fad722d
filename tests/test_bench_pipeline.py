"""``scripts/bench_pipeline.py``'s overhead-bound case (m = 16, micro-batch 1), end to end on tiny shapes.

Timings are not asserted (noisy on shared CPUs). What is: the case times exactly our 1f1b and
torch.pipelining's Schedule1F1B at 16 microbatches of one sample, every round and step, with
positive times; the paired ratio is the median of the per-round quotients of the two systems'
medians (the ones the table prints); the target is marked from that ratio.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


ROUNDS, STEPS = 2, 2


@pytest.fixture(scope="module")
def small_mb_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    """One run of the overhead-bound case on tiny shapes (its JSON and stdout), shared by the tests below."""
    out = tmp_path_factory.mktemp("bench_pipeline") / "pipe.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_pipeline.py"), "--small-mb-only", "--stages", "2",
           "--rounds", str(ROUNDS), "--steps", str(STEPS), "--warmup", "0", "--layers", "2", "--hidden", "16",
           "--seq", "8", "--vocab", "64", "--p2p-reps", "1", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text()), proc.stdout


def test_small_microbatch_case_times_ours_and_torch_pipelining(small_mb_run: tuple[dict, str]) -> None:
    data, stdout = small_mb_run
    rounds, steps = ROUNDS, STEPS
    assert data["rows"] == []
    rows = {r["system"]: r for r in data["small_mb_rows"]}
    assert set(rows) == {"ours 1f1b", "ours 1f1b plain", "torch.pipelining 1f1b"}  # ours: split drain and plain (early39)
    ours, theirs = rows["ours 1f1b"], rows["torch.pipelining 1f1b"]
    for row in rows.values():
        assert (row["stages"], row["microbatches"], row["micro_batch_size"], row["case"]) == (2, 16, 1, "small_mb")
        assert row["n"] == rounds * steps and all(t > 0 for t in row["steps_s"])
        assert row["min_s"] <= row["median_s"] <= row["max_s"]
        assert len(row["round_medians_s"]) == rounds
    assert ours["round_medians_s"] == theirs["ours_1f1b_round_medians_s"]
    # sim's message time is the post -> receiver latency; the exchange loop's time is reported beside it
    assert ours["p2p_message_s"] >= 0 and ours["p2p_post_s"] > 0 and ours["p2p_exchange_s"] > 0
    per_round = [a / b for a, b in zip(theirs["round_medians_s"], ours["round_medians_s"])]
    assert theirs["paired_vs_ours_1f1b"] == pytest.approx(statistics.median(per_round))
    assert theirs["round_medians_s"] == pytest.approx(
        [statistics.median(theirs["steps_s"][i * steps:(i + 1) * steps]) for i in range(rounds)])
    target = data["small_mb_targets"]["pp2"]
    assert target["torch_over_ours_paired"] == theirs["paired_vs_ours_1f1b"]
    assert target["met"] == (theirs["paired_vs_ours_1f1b"] >= 1.0)
    assert "m=16, micro-batch 1" in stdout and "target (issue 27) pp2" in stdout


def test_small_microbatch_case_compares_equal_work_and_cpu_time(small_mb_run: tuple[dict, str]) -> None:
    """Both systems' steps leave the same gradients (torch's step is followed by the tied-embedding
    sum our engine does in its step; without it the word embedding's gradient lacks the head's part),
    and each row carries its CPU seconds per step (all ranks) with the paired ratio to our 1f1b."""
    data, stdout = small_mb_run
    rounds, steps = ROUNDS, STEPS
    rows = {r["system"]: r for r in data["small_mb_rows"]}
    ours, theirs = rows["ours 1f1b"], rows["torch.pipelining 1f1b"]
    assert theirs["grad_diff_vs_ours_1f1b"] < 1e-5
    for row in rows.values():
        assert len(row["cpu_steps_s"]) == rounds * steps and all(c > 0 for c in row["cpu_steps_s"])
        assert row["cpu_median_s"] == pytest.approx(statistics.median(row["cpu_steps_s"]))
        assert len(row["cpu_round_ratios"]) == rounds
        assert row["paired_cpu_vs_ours_1f1b"] == pytest.approx(statistics.median(row["cpu_round_ratios"]))
    assert ours["paired_cpu_vs_ours_1f1b"] == 1.0
    assert "CPU per step, paired torch/ours" in stdout
