"""A second job in a running job's ``train.out_dir`` is refused (``parallel3d.run_lock``), through the real CLI.

Job A (one process) is held inside its first checkpoint save by a sleep (``P3D_FAULT``), so it is
certainly running while job B starts in the same directory. Without the lock, B resumed A's
checkpoints, superseded or failed A's saves, rewrote A's ``.hydra/`` and interleaved its records with
A's in ``metrics.jsonl`` (session 44's trial); B must now exit 2 with one line before touching anything.
Once A is gone (SIGKILL: nothing to clean up), the directory is free again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from parallel3d import run_lock

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["train.steps=2", "train.global_batch_size=4", "train.micro_batch_size=2", "train.seq_len=32",
        "optimizer.warmup_steps=1", "logging.log_every=1", "train.eval_iters=0", "train.save_every=1",
        "train.async_save=false"]
HELD_S = 120  # job A sleeps this long in its first save; it is killed long before


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT", "LOCAL_WORLD_SIZE", "P3D_FAULT")}
    env.update(PYTHONPATH=REPO, OMP_NUM_THREADS="1", **extra)
    return env


def _train(args: list[str], cwd, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "parallel3d.train", *args], cwd=str(cwd), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen)


def _wait_for_save(out_dir, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Until job A sits in its first save (its step directory is being made)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert proc.poll() is None, proc.communicate()
        if (out_dir / "metrics.jsonl").exists():
            return
        time.sleep(0.2)
    raise AssertionError("job A never reached its first save")


@pytest.mark.slow
def test_a_second_job_in_a_running_jobs_out_dir_is_one_line_and_exit_2(tmp_path):
    out = tmp_path / "sweep" / "0"  # also a sweep's job 0: a sweep runs job N in <train.out_dir>/N
    common = [*TINY, f"data.cache_dir={tmp_path / 'cache'}"]
    a = _train([*common, f"train.out_dir={out}"], tmp_path,
               env=_env(P3D_FAULT=f"checkpoint.mkdir@0=sleep:{HELD_S}"))
    try:
        _wait_for_save(out, a)
        hydra_a = (out / ".hydra" / "overrides.yaml").read_text()
        records_a = (out / "metrics.jsonl").read_text()
        for second in ([f"train.out_dir={out}"], ["-m", "train.seed=7", f"train.out_dir={out.parent}"]):
            b = _train([*second, *common], tmp_path, env=_env())
            stdout, stderr = b.communicate(timeout=120)
            assert b.returncode == 2, stdout[-2000:] + stderr[-2000:]
            lines = stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith(f"config error: train.out_dir={str(out)!r}: in use by "
                                                           f"another job (process {a.pid} on "), stderr
            assert stdout == ""
        # B touched nothing of A's: its recorded config, its records, no checkpoint of B's.
        assert (out / ".hydra" / "overrides.yaml").read_text() == hydra_a
        assert (out / "metrics.jsonl").read_text() == records_a
        assert not (out / "checkpoints" / "step_00000001").exists()
    finally:
        a.send_signal(signal.SIGKILL)
        a.communicate(timeout=60)
    # A died holding the lock: the directory is free at once (the lock went with the process).
    run_lock.acquire(str(out)).close()


@pytest.mark.slow
def test_a_lock_file_that_cannot_be_opened_is_one_line_and_exit_2(tmp_path):
    """Review45: ``<out_dir>/.lock`` that this process cannot open (here a directory of that name; for a user who is
    not root, another user's lock file) was a traceback (IsADirectoryError, exit 1); one config error line now."""
    out = tmp_path / "run"
    (out / run_lock.LOCK_NAME).mkdir(parents=True)
    proc = subprocess.run([sys.executable, "-m", "parallel3d.train", *TINY, f"train.out_dir={out}",
                           f"data.cache_dir={tmp_path / 'cache'}"], cwd=str(tmp_path), env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [f"config error: train.out_dir={str(out)!r}: cannot lock "
                                                f"{out / run_lock.LOCK_NAME}: Is a directory"], proc.stderr
    assert sorted(p.name for p in out.iterdir()) == [run_lock.LOCK_NAME]
