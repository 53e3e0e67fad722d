"""Progress of a run: ETA arithmetic, checkpoint lines, the end summary (per-rank peaks over real ranks)."""

from __future__ import annotations

import os

import pytest

from parallel3d.progress import RunClock, checkpoint_line, format_bytes, format_duration
from parallel3d.summary import RunSummary, per_rank_values
from tests.harness import run_on_ranks


def test_durations_and_sizes_read_like_a_person_writes_them():
    assert [format_duration(s) for s in (4.25, 65, 3725)] == ["4.2s", "1m05s", "1h02m"]
    assert [format_bytes(b) for b in (512, 3 * 2**20, 5.5 * 2**30)] == ["512 B", "3.0 MiB", "5.5 GiB"]


@pytest.mark.parametrize("start,end,every", [(0, 10, 3), (0, 9, 3), (4, 10, 0), (0, 500, 100), (7, 8, 5)])
def test_evaluations_left_counts_every_eval_step_and_the_end(start, end, every):
    clock = RunClock(start, end, eval_every=every, evaluating=True)
    for step in range(start, end + 1):
        # An independent count: the eval steps the trainer would run after `step`.
        want = len([s for s in range(step + 1, end + 1) if (every and s % every == 0) or s == end])
        assert clock.evals_after(step) == want, step


def test_eta_is_steps_left_times_mean_step_plus_evals_left():
    clock = RunClock(0, 10, eval_every=5, evaluating=True)
    assert clock.eta(0) is None
    for _ in range(2):
        clock.add_step(0.5)
    clock.add_eval(2.0)
    # 8 steps of 0.5 s, then the evaluations at steps 5 and 10 at 2 s each.
    assert clock.eta(2) == pytest.approx(8 * 0.5 + 2 * 2.0)
    assert RunClock(0, 10).metrics(0)["eta_s"] is None


def test_checkpoint_line_names_path_size_and_time(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.pt").write_bytes(b"\0" * 3 * 2**20)
    (tmp_path / "y").write_bytes(b"\0" * 2**20)
    assert checkpoint_line(7, str(tmp_path), 1.25) == f"checkpoint step 7: {tmp_path} (4.0 MiB, 1.2s)"


def _peaks(rank: int, world: int) -> list[float]:
    from parallel3d.parallel_state import ParallelState
    from parallel3d.topology import Topology

    pstate = ParallelState(Topology(tp=2, pp=2, dp=world // 4))
    return per_rank_values(1000.0 * (rank + 1) + 0.5, pstate)


@pytest.mark.slow
def test_per_rank_values_gathers_every_rank_by_global_rank():
    results = run_on_ranks(_peaks, 8, timeout=120)
    want = [1000.0 * (r + 1) + 0.5 for r in range(8)]
    assert all(r == want for r in results)


def test_summary_names_the_ranks_with_most_and_least_memory(tmp_path):
    s = RunSummary(steps=10, first_step=0, last_step=10, total_steps=10, tokens=20480, wall_seconds=12.0,
                   train_seconds=8.0, tflops_per_device=0.5, mfu=None, peak_bytes=[3 * 2**20, 5 * 2**20, 2**20],
                   out_dir=str(tmp_path), best_eval=(5, 3.25), last_eval=(10, 3.5), final_loss=3.1,
                   checkpoint=os.path.join(str(tmp_path), "checkpoints", "step_00000010"))
    text = "\n".join(s.lines())
    assert "20,480 tokens" in text and "mean 2,560 tok/s" in text
    assert "best eval loss 3.2500 at step 5" in text and "last eval loss 3.5000 at step 10" in text
    assert "max 5.0 MiB on rank 1, min 1.0 MiB on rank 2" in text
    assert os.path.join(str(tmp_path), "metrics.jsonl") in text and "step_00000010" in text
    assert s.wandb()["best_eval_loss"] == 3.25 and s.wandb()["peak_memory_bytes_max"] == 5 * 2**20
