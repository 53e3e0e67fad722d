"""``train.on_nonfinite`` across a resume and in what a user reads (``parallel3d/divergence.py``, session 43).

A run resumed by a scheduler counts its skipped steps on as one uninterrupted run does (the count is in the
checkpoint; an older checkpoint without it counts from 0, with a note). The last line of the run's own output
is the one that says what happened and what to do, and under torchrun the launcher's root cause is that line
(those two tests live in ``tests/test_divergence.py``, beside the runs they share). Real CLI runs
(``tests/fault_runs.py``); the reference for a resumed run is the same run straight through, trained in process.
"""

from __future__ import annotations

import re
import subprocess
import sys
import warnings

import pytest

from parallel3d.divergence import MAX_CONSECUTIVE_SKIPS, DivergenceGuard, TrainingDiverged
from parallel3d.user_warnings import RunWarning
from parallel3d.zero.precision import LossScaler
from tests.fault_runs import REPO, cli_env
from tests.harness import free_port
from tests.test_divergence import (HUGE_LR, LINE, _args, _finish, _info, _records, _steps_saved,  # noqa: F401
                                   _stop_line, _train_in_process, cache_dir)

pytestmark = [pytest.mark.filterwarnings("ignore:no peak TFLOP/s known"),
              pytest.mark.filterwarnings("ignore:step \\d+ skipped")]
# fp16 at a loss scale of 2^100: every step's gradients overflow (the weights never change, so they stay finite
# and a checkpoint may be saved), and halving the scale 32 times leaves it far above anything that fits fp16:
# the run can only stop on the count of consecutive skips, never on the scale's floor.
OVERFLOWING = ("train.precision=fp16", f"optimizer.loss_scale_init={2.0**100:g}", "train.save_every=0")
STEPS = 3 * MAX_CONSECUTIVE_SKIPS // 2


def test_consecutive_skips_count_on_across_a_resume(tmp_path, cache_dir):
    """The resumed CLI run is under test; the straight run (its reference) and the first part (the checkpoint it
    resumes from) are the same jobs trained in process, as ``parallel3d.train`` would compose them."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    with pytest.raises(TrainingDiverged) as stopped:
        _train_in_process(_args(straight, cache_dir, STEPS, *OVERFLOWING))
    reference = str(stopped.value)
    assert f"{LINE} {MAX_CONSECUTIVE_SKIPS}: {MAX_CONSECUTIVE_SKIPS} consecutive fp16 overflow steps" in reference
    _train_in_process(_args(resumed, cache_dir, STEPS, *OVERFLOWING, "train.stop_after=10"))
    assert _steps_saved(resumed) == [10] and all(r["skipped"] for r in _records(resumed).values())
    status, lines = _finish(_args(resumed, cache_dir, STEPS, *OVERFLOWING))
    assert status == 1 and any("resumed from" in ln for ln in lines), "\n".join(lines[-20:])
    # The same step, reason, loss and scale as straight through (the checkpoint is named only in the resumed one).
    stop = _stop_line(lines)
    assert stop.startswith("[rank 0] failed: TrainingDiverged: "), stop
    assert stop.split("TrainingDiverged: ", 1)[1].split("; stopped")[0] == reference.split("; stopped")[0]


def test_a_checkpoint_without_the_count_loads_with_0_and_a_note():
    guard = DivergenceGuard("stop", LossScaler(scale=2.0**16, min_scale=2.0**-100))
    for _ in range(3):
        guard.verdict(_info(True, 2.0**16))
    saved = {"step": 9, **guard.state_dict()}
    again = DivergenceGuard("stop", LossScaler(scale=2.0**16, min_scale=2.0**-100))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a checkpoint that has the count loads without a note
        again.load_state_dict(saved)
    assert again.consecutive_skips == guard.consecutive_skips == 3
    older = DivergenceGuard("stop", LossScaler(scale=2.0**16, min_scale=2.0**-100), announce=True)
    older.consecutive_skips = 5
    with pytest.warns(RunWarning, match="counts consecutive skipped steps from 0"):
        older.load_state_dict({"step": 9})
    assert older.consecutive_skips == 0
    quiet = DivergenceGuard("stop", LossScaler(scale=2.0**16, min_scale=2.0**-100))  # not the logging rank
    quiet.consecutive_skips = 5
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quiet.load_state_dict({"step": 9})
    assert quiet.consecutive_skips == 0


def test_a_run_resumed_from_a_checkpoint_without_the_count_trains_on_with_one_note(tmp_path, cache_dir, monkeypatch):
    """End to end, in process: a checkpoint written by the real writer without the key (the trainer state
    as it was before session 43) resumes, with the note, and a checkpoint written now carries the count."""
    from tests.test_train_e2e import job_values, train_single

    out = str(tmp_path / "run")
    with monkeypatch.context() as old_format:
        old_format.setattr(DivergenceGuard, "state_dict", lambda self: {})
        assert sorted(train_single("gpt_tiny", job_values(out, cache_dir, train={"stop_after": 1}))) == [1]
    with pytest.warns(RunWarning, match="checkpoint of step 1 predates the saved skip count") as caught:
        assert sorted(train_single("gpt_tiny", job_values(out, cache_dir, train={"stop_after": 2}))) == [2]
    assert len([w for w in caught if "predates" in str(w.message)]) == 1
    with warnings.catch_warnings(record=True) as later:  # step 2's checkpoint has the count: no note
        warnings.simplefilter("always")
        assert sorted(train_single("gpt_tiny", job_values(out, cache_dir, train={"stop_after": 3}))) == [3]
    assert not [w for w in later if "predates" in str(w.message)]


def test_without_torchrun_the_other_rank_points_to_the_line_and_names_no_hang(tmp_path, cache_dir):
    """Ranks started as another launcher would (RANK/WORLD_SIZE/MASTER_*): no torchrun to wait for, so the other
    rank prints its pointer at once; a divergence is not a hang, so no line carries a heartbeat diagnosis."""
    port, args = free_port(), _args(tmp_path / "plain", cache_dir, 4, "train.save_every=0", "parallel.pp=2", HUGE_LR)
    procs = [subprocess.Popen([sys.executable, "-m", "parallel3d.train", *args], cwd=REPO, text=True,
                              env=cli_env(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2",
                                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in (0, 1)]
    try:
        errs = [p.communicate(timeout=300)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [1, 1], errs
    lines = [[ln for ln in err.splitlines() if ln.startswith("[rank")] for err in errs]
    assert lines[0] == [f"[rank 0] failed: TrainingDiverged: {LINE} 2 (the logging rank's line says why)"], errs[0]
    assert len(lines[1]) == 1 and f"{LINE} 2: non-finite gradient norm" in lines[1][0], errs[1]


def test_skip_warns_once_per_skipped_step_from_one_rank_with_the_count(tmp_path, cache_dir):
    status, lines = _finish(_args(tmp_path / "skip", cache_dir, 4, "train.save_every=0", "parallel.pp=2", HUGE_LR,
                                  "train.on_nonfinite=skip"), nproc=2)
    assert status == 0, "\n".join(lines[-40:])
    skipped = [ln for ln in lines if "skipped" in ln and ln.startswith("warning: ")]
    assert [re.search(r"step (\d+)", ln).group(1) for ln in skipped] == ["2", "3", "4"], "\n".join(lines[-40:])
    assert [re.search(r"(\d+) in a row", ln).group(1) for ln in skipped] == ["1", "2", "3"], skipped
