"""``train.on_nonfinite`` (``parallel3d/divergence.py``): a diverged run ends with status 1 and one line, saving
nothing of the diverged steps and rotating no good checkpoint out; ``skip`` keeps the old behaviour; fp16
overflows above the loss scale's floor still skip. Real CLI runs (``tests/fault_runs.py``), one and two processes.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
from collections.abc import Iterator

import pytest
import torch

from parallel3d.checkpoint import complete_checkpoints, is_loadable, read_meta
from parallel3d.checkpoint_io.pieces import pieces_to_write
from parallel3d.checkpoint_verify import damage
from parallel3d.config import resolve
from parallel3d.divergence import DivergenceGuard, TrainingDiverged, state_is_finite
from parallel3d.parallel_state import ParallelState
from parallel3d.topology import Topology
from parallel3d.train import CONFIG_EXIT_DELAY_S, compose_job
from parallel3d.trainer import train
from parallel3d.zero import ZeroOptimizer
from parallel3d.zero.optimizer import StepInfo
from parallel3d.zero.owned import STATE_KINDS
from parallel3d.zero.precision import LossScaler
from tests.fault_runs import TINY, Run, run_to_end
from tests.harness import run_on_ranks
from tests.test_zero_optimizer import TINY_BUCKET_MB, make_mlp

pytestmark = pytest.mark.filterwarnings("ignore:no peak TFLOP/s known")
HUGE_LR = "optimizer.lr=1e300"  # the first update overflows the fp32 weights: the user trial's divergence
LINE = "training diverged at step"
# What parallel3d itself prints (console lines, warnings, a rank's failure line): none may follow the stop line.
OWN_LINE = re.compile(r"^(step\s+\d+/|warning: |\[rank \d+\] |stopping at step|parallel3d: |checkpoint )")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("corpus_cache"))


def _args(out, cache_dir, steps: int, *extra: str) -> list[str]:
    return [*TINY, f"train.steps={steps}", f"train.out_dir={out}", f"data.cache_dir={cache_dir}", *extra]


def _steps_saved(out) -> list[int]:
    return [step for step, _ in complete_checkpoints(os.path.join(out, "checkpoints"))]


def _intact(out, step: int) -> bool:
    path = dict(complete_checkpoints(os.path.join(out, "checkpoints")))[step]
    meta = read_meta(path)
    return is_loadable(path) and damage(path, meta, meta["files"]) is None


def _records(out) -> dict[int, dict]:
    with open(os.path.join(out, "metrics.jsonl")) as fh:
        return {r["step"]: r for r in map(json.loads, fh)}


def _finish(args: list[str], nproc: int = 1) -> tuple[int, list[str]]:
    """Run to the end: ``(exit status, every line, stdout and stderr merged as a terminal shows them)``."""
    run = Run(args, nproc=nproc)
    try:
        status, _ = run.finish(timeout=400)
    finally:
        run.kill()
    return status, run.lines


def _stop_line(lines: list[str]) -> str:
    found = [ln for ln in lines if LINE in ln and ln.startswith("[rank")]  # (not torchrun's summary quoting it)
    assert len(found) == 1, "\n".join(lines[-30:])
    return found[0]


def _after(lines: list[str], line: str) -> list[str]:
    return lines[lines.index(line) + 1:]


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """As the CLI's own process runs (``OMP_NUM_THREADS=1``), so its sums, and the losses it prints, are the same."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _train_in_process(args: list[str]) -> None:
    """The job the CLI would run for ``args``, trained in this process (a reference or a setup, not the CLI
    under test): what it leaves in ``train.out_dir`` is what the CLI's run would leave; a divergence raises."""
    job, plain = compose_job(args)
    with _one_thread():
        train(resolve(job, 1), ParallelState.single_process(), full_config=plain)


def _info(skipped: bool, scale: float) -> StepInfo:
    return StepInfo(grad_norm=float("nan") if skipped else 1.0, skipped=skipped, loss_scale=scale, lr=1e-3)


def test_guard_stops_at_once_without_a_dynamic_scale_and_never_with_skip():
    stop = DivergenceGuard("stop", LossScaler(enabled=False))
    assert stop.verdict(_info(False, 1.0)) is None
    assert "non-finite gradient norm" in stop.verdict(_info(True, 1.0))
    skip = DivergenceGuard("skip", LossScaler(enabled=False))
    assert all(skip.verdict(_info(True, 1.0)) is None for _ in range(100))


def test_guard_lets_fp16_overflows_skip_until_the_floor_or_too_many_in_a_row():
    scaler = LossScaler(scale=8.0, min_scale=1.0)
    guard = DivergenceGuard("stop", scaler)
    verdicts = []
    while not verdicts or verdicts[-1] is None:  # the scaler halves the scale per overflow, as the optimizer does
        used = scaler.scale
        scaler.update(overflow=True)
        verdicts.append(guard.verdict(_info(True, used)))
    assert len(verdicts) == 4 and "floor" in verdicts[-1]  # 8, 4, 2 skip; an overflow at 1 (the floor) stops
    many = DivergenceGuard("stop", LossScaler(scale=2.0**16, min_scale=2.0**-100), max_consecutive_skips=3)
    assert [many.verdict(_info(True, 2.0**16)) is None for _ in range(2)] == [True, True]
    assert many.verdict(_info(False, 2.0**16)) is None  # a good step resets the count
    assert [many.verdict(_info(True, 2.0**16)) for _ in range(3)][-1] == "3 consecutive fp16 overflow steps skipped"


# Where the saved state lives: replicated (0), sharded on the device (2), offloaded to host memory (1) and to
# memory-mapped files (3: the parameters sharded too, never gathered by the check).
STATE_CASES = [(0, "none"), (1, "cpu"), (2, "none"), (3, "disk")]


def _verdicts_with_one_poisoned_element(rank, world_size, kind, root):
    """Per case: (the check before, after rank 0 made one element of ``kind`` NaN; what this rank saves is finite)."""
    ps = ParallelState(Topology(tp=1, pp=1, dp=world_size))
    out = {}
    for stage, offload in STATE_CASES:
        opt = ZeroOptimizer([make_mlp()], ps, zero_stage=stage, lr=1e-3, bucket_size_mb=TINY_BUCKET_MB,
                            offload=offload, offload_dir=os.path.join(root, f"s{stage}") if offload == "disk" else None)
        before = state_is_finite(opt, ps)
        if rank == 0:  # through the optimizer's own write path; rank 0 writes this piece in a checkpoint at any stage
            g, b = next((g, b) for g, layout in enumerate(opt.layouts) for b in layout.buckets if b.piece_size)
            state = [t.clone() for t in opt.read_state_piece(g, b)]
            state[STATE_KINDS.index(kind)][0] = float("nan")
            opt.write_state_piece(g, b, *state)
        saved_finite = all(bool(torch.isfinite(p.data).all()) for p in pieces_to_write(opt, ps))
        out[(stage, offload)] = (before, state_is_finite(opt, ps), saved_finite)
    return out


@pytest.mark.parametrize("kind", STATE_KINDS)
def test_the_save_check_reads_every_saved_state_wherever_it_lives(kind, tmp_path):
    """``state_is_finite`` (the save-time check) against what a checkpoint would write (``pieces_to_write``): one
    non-finite element on one rank, in any state kind, stage or offload mode, makes every rank refuse the save."""
    per_rank = run_on_ranks(_verdicts_with_one_poisoned_element, 2, kind, str(tmp_path), timeout=180)
    for case in STATE_CASES:
        assert not all(r[case][2] for r in per_rank), case  # the poison reached what would be saved
        assert [r[case][:2] for r in per_rank] == [(True, False)] * 2, (case, per_rank)


@pytest.mark.filterwarnings("ignore:step \\d+ skipped")
def test_diverged_run_exits_1_keeps_the_good_checkpoints_and_skip_keeps_saving(tmp_path, cache_dir, capsys):
    """The diverged run is the CLI under test (exit 1, its one line). The good checkpoints (its setup), the resume
    from them and the ``skip`` run are the trainer's behaviour, trained in process as the CLI composes them (a
    launch would add only its start-up; a CLI run that finishes exits 0, one that raises exits 1)."""
    good = tmp_path / "good"
    _train_in_process(_args(good, cache_dir, 2, "train.save_every=1", "train.keep_last=2"))  # the good checkpoints
    skipping = tmp_path / "skipping"
    shutil.copytree(good, skipping)
    # Resumed at step 2 with the huge lr: step 3's update overflows the weights; its save is refused.
    diverged = run_to_end(_args(good, cache_dir, 6, "train.save_every=1", "train.keep_last=2", HUGE_LR))
    assert diverged.returncode == 1, diverged.stdout[-2000:] + diverged.stderr[-2000:]
    lines = [ln for ln in diverged.stderr.splitlines() if LINE in ln]
    assert len(lines) == 1 and f"{LINE} 3:" in lines[0] and "step_00000002" in lines[0], diverged.stderr[-2000:]
    assert _steps_saved(good) == [1, 2] and _intact(good, 1) and _intact(good, 2)
    capsys.readouterr()
    _train_in_process(_args(good, cache_dir, 3))  # the good checkpoint loads and trains on
    assert "resumed from" in capsys.readouterr().out and max(_steps_saved(good)) == 3
    assert math.isfinite(_records(good)[3]["loss"]) and not _records(good)[3]["skipped"]
    # skip: today's behaviour: the run "finishes", skipping and saving, and rotates the good checkpoints out.
    _train_in_process(_args(skipping, cache_dir, 6, "train.save_every=1", "train.keep_last=2", HUGE_LR,
                            "train.on_nonfinite=skip"))
    assert _steps_saved(skipping) == [5, 6] and all(_records(skipping)[s]["skipped"] for s in (4, 5, 6))


def test_non_finite_grad_norm_stops_before_the_final_save(tmp_path, cache_dir):
    """In process (the trainer's stop, not the CLI's: its exit 1 and line are the test above's and
    ``fp16_at_the_floor``'s): the exception is what the CLI prints after ``[rank 0] failed: TrainingDiverged: ``."""
    out = tmp_path / "run"
    with pytest.raises(TrainingDiverged) as stopped:
        _train_in_process(_args(out, cache_dir, 4, "train.save_every=0", HUGE_LR))
    line = str(stopped.value).strip().splitlines()[0]  # the first line: what the CLI's failure line carries
    assert f"{LINE} 2: non-finite gradient norm" in line and "no checkpoint was written" in line
    assert _steps_saved(out) == []


@pytest.fixture(scope="module")
def pp2_diverged(tmp_path_factory, cache_dir) -> tuple[str, int, list[str]]:
    """torchrun, pp 2, a huge lr, stopping at step 2: ``(run dir, exit status, merged lines)``. One run read by
    the two tests of what a two-rank divergence prints (each asserts its own of the run's properties)."""
    out = str(tmp_path_factory.mktemp("pp2"))
    status, lines = _finish(_args(out, cache_dir, 4, "train.save_every=0", "parallel.pp=2", HUGE_LR), nproc=2)
    return out, status, lines


@pytest.fixture(scope="module")
def fp16_at_the_floor(tmp_path_factory, cache_dir) -> tuple[str, int, list[str]]:
    """One process, fp16 at a loss scale of 2 and a huge lr: step 2 skips (scale 2 -> 1), step 3 overflows at the
    floor and stops: ``(run dir, exit status, merged lines)``, read by two tests (the numbers, what it prints)."""
    out = str(tmp_path_factory.mktemp("fp16"))
    status, lines = _finish(_args(out, cache_dir, 6, "train.save_every=0", "train.precision=fp16",
                                  "optimizer.loss_scale_init=2", HUGE_LR))
    return out, status, lines


# A logging rank slower to print its line than the other rank is to exit (a loaded node): torchrun stops the
# job at the first exit, so the line must not depend on who gets there first. Slower than the other ranks'
# own wait for torchrun's stop (``CONFIG_EXIT_DELAY_S``), so only the ranks' meeting (``exit_together``) keeps it.
SLOW_LOGGING_RANK = {"as fast": {}, "slow logging rank": {
    "P3D_FAULT": f"train.failure_line@1=sleep:{CONFIG_EXIT_DELAY_S + 3:g}"}}


@pytest.mark.parametrize("env", SLOW_LOGGING_RANK)
def test_two_ranks_stop_together_with_one_line_from_the_logging_rank(tmp_path, cache_dir, env, request):
    """"as fast" reads the module's ``pp2_diverged`` run (stdout and stderr merged: the rank's line is its stderr,
    no console line carries the divergence); the slow logging rank needs its own run."""
    if env == "as fast":
        out, status, text = request.getfixturevalue("pp2_diverged")
    else:
        out = str(tmp_path / "pp2")
        proc = run_to_end(_args(out, cache_dir, 4, "train.save_every=0", "parallel.pp=2", HUGE_LR), nproc=2,
                          **SLOW_LOGGING_RANK[env])
        status, text = proc.returncode, proc.stderr.splitlines()
    assert status == 1, "\n".join(text[-40:])
    # (torchrun's failure summary quotes the logging rank's line as its root cause: that is not a rank's line)
    full = [ln for ln in text if f"{LINE} 2: non-finite gradient norm" in ln
            and not ln.lstrip().startswith("traceback :")]
    assert len(full) == 1 and full[0].startswith("[rank 1] failed") and "loss nan" in full[0], "\n".join(text[-40:])
    assert _steps_saved(out) == []


def test_under_torchrun_the_logging_ranks_line_is_last_and_the_launchers_root_cause(pp2_diverged):
    _, status, lines = pp2_diverged
    assert status == 1, "\n".join(lines[-40:])
    stop = _stop_line(lines)
    assert stop.startswith("[rank 1] failed") and f"{LINE} 2: non-finite gradient norm" in stop
    assert "hung or dead" not in stop and not any("skipped" in ln for ln in lines), "\n".join(lines[-40:])
    assert not [ln for ln in _after(lines, stop) if OWN_LINE.search(ln)], "\n".join(lines[-40:])
    root = "\n".join(lines[next(i for i, ln in enumerate(lines) if "Root Cause" in ln):])
    assert "rank      : 1 " in root and f"{LINE} 2: non-finite gradient norm" in root, root


def test_fp16_overflow_skips_above_the_floor_and_stops_at_it(fp16_at_the_floor):
    out, status, lines = fp16_at_the_floor
    assert status == 1, "\n".join(lines[-20:])
    assert f"{LINE} 3: fp16 overflow at the loss scale's floor" in _stop_line(lines), "\n".join(lines[-20:])
    records = _records(out)
    assert records[2]["skipped"] and records[2]["loss_scale"] == 2.0 and not records[1]["skipped"]
    assert _steps_saved(out) == []


def test_the_stop_line_is_the_last_the_run_prints_and_no_skip_warning_precedes_it(fp16_at_the_floor):
    _, status, lines = fp16_at_the_floor
    assert status == 1, "\n".join(lines[-20:])
    stop = _stop_line(lines)
    assert f"{LINE} 3: fp16 overflow at the loss scale's floor" in stop and lines[-1] == stop, "\n".join(lines[-8:])
    skipped = [ln for ln in lines if "skipped" in ln]
    # Step 2's overflow is absorbed (scale 2 -> 1): one warning says so; step 3's is the stop, said once, last.
    assert len(skipped) == 1 and skipped[0].startswith("warning: step 2 skipped"), "\n".join(lines[-12:])
