"""A one-process ``-m`` sweep runs every job even when one fails (``parallel3d.sweep_status``), through the real CLI."""

from __future__ import annotations

import subprocess
import sys

import pytest

from parallel3d.wandb_reader import find_offline_runs, read_run
from tests.test_run_lock import TINY, _env


@pytest.mark.slow
def test_a_failed_job_of_a_one_process_sweep_does_not_end_the_sweep(tmp_path):
    """As in Hydra's own sweeps: job 0 diverges (its one line), job 1 still trains (``parallel3d.sweep_status``),
    and the sweep then exits 1 with a line naming the failed job. Before, job 0's failure ended the process
    and job 1 never ran, without a word. Each job logs to its own W&B run (review45: job 1's ``wandb.init`` was
    handed job 0's run, still open, and logged there)."""
    out = tmp_path / "sweep"
    proc = subprocess.run([sys.executable, "-m", "parallel3d.train", "-m", "optimizer.lr=1e300,0.003", *TINY,
                           "train.save_every=0", f"train.out_dir={out}", f"data.cache_dir={tmp_path / 'cache'}",
                           "logging.wandb.mode=offline"],
                          cwd=str(tmp_path), env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    failed = [line for line in lines if line.startswith("[rank")]
    assert len(failed) == 1 and failed[0].startswith("[rank 0] failed: TrainingDiverged: training diverged"), lines
    assert lines[-1].startswith("multirun: 1 of 2 jobs failed: job 0 "), lines
    assert "Traceback" not in proc.stderr
    assert proc.stdout.count("run summary: 2 steps this run (0 -> 2 of 2)") == 1  # job 1's
    assert (out / "1" / "checkpoints" / "step_00000002").is_dir() and not list(out.glob("0/checkpoints/step_*"))
    runs = [find_offline_runs(str(out / job)) for job in ("0", "1")]
    assert [len(r) for r in runs] == [1, 1], runs
    assert read_run(runs[0][0], wait_s=60)["complete"]  # job 0's run finished, not left open
    assert [r["_step"] for r in read_run(runs[1][0], wait_s=60)["history"] if "train/loss" in r] == [1, 2]


@pytest.mark.slow
def test_a_sweep_without_the_status_callback_still_fails_on_a_failed_job(tmp_path):
    """A config without ``SweepStatus`` (a user's own, or ``~hydra.callbacks.sweep_status``) has nothing to report a
    failed job at the sweep's end, so the failure ends the sweep with exit 1 as before, never a silent exit 0."""
    out = tmp_path / "sweep"
    proc = subprocess.run([sys.executable, "-m", "parallel3d.train", "-m", "optimizer.lr=1e300,0.003", *TINY,
                           "train.save_every=0", f"train.out_dir={out}", f"data.cache_dir={tmp_path / 'cache'}",
                           "~hydra.callbacks.sweep_status"],
                          cwd=str(tmp_path), env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("[rank 0] failed: TrainingDiverged"), proc.stderr[-2000:]
