"""Preemption and time limits, injected for real: SIGTERM to the launcher by PID (mid-step and
mid-save), the wall-clock budget; the newest complete checkpoint is intact and the resumed
losses are bit-identical to an uninterrupted run."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from parallel3d.checkpoint import complete_checkpoints, is_loadable
from parallel3d.config import job_from_dict, resolve
from parallel3d.parallel_state import ParallelState
from parallel3d.preemption import EXIT_STOPPED
from parallel3d.trainer import train
from tests.fault_runs import TINY, Run, losses_of, run_to_end, train_like_the_cli
from tests.test_train_e2e import job_values

pytestmark = pytest.mark.filterwarnings("ignore:no peak TFLOP/s known")
STOP_BOUND_S = 30.0  # signal -> every process gone (a step + a checkpoint of a tiny model, on a loaded machine)
BUDGET_STEPS = 10_000  # train.steps of every run of the budget tests: the same in each (the LR schedule depends on it)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("corpus_cache"))


def _args(out, cache_dir, steps: int, *extra: str) -> list[str]:
    return [*TINY, f"train.steps={steps}", f"train.out_dir={out}", f"data.cache_dir={cache_dir}", *extra]


def _sigterm_once(run: Run, after: str, timeout: float) -> int:
    """SIGTERM to ``run`` once a line matches ``after``; asserts exit 3 within ``STOP_BOUND_S`` and one stop line
    naming the signal; returns the step it stopped at."""
    try:
        run.wait_for(after)
        os.kill(run.proc.pid, signal.SIGTERM)
        status, seconds = run.finish(timeout=timeout)
    finally:
        run.kill()
    assert status == EXIT_STOPPED, "\n".join(run.lines[-30:])
    assert seconds < STOP_BOUND_S
    stop = [line for line in run.lines if line.startswith("stopping at step")]
    assert len(stop) == 1 and "received SIGTERM" in stop[0], run.lines[-20:]
    return int(stop[0].split()[3])


@pytest.mark.extended  # CI: the torchrun test below checks the same (exit status 3 on the rank, the requeue
# marker, the stop line, one intact checkpoint, a bit-identical resume) through two ranks
def test_sigterm_mid_step_checkpoints_exits_3_and_resumes_bit_identically(tmp_path, cache_dir):
    steps = 40
    reference = run_to_end(_args(tmp_path / "ref", cache_dir, steps))
    assert reference.returncode == 0, reference.stderr[-2000:]
    out = tmp_path / "run"
    marker = tmp_path / "requeue"
    run = Run(_args(out, cache_dir, steps, "train.save_every=0"), P3D_REQUEUE_FILE=str(marker))
    stopped_at = _sigterm_once(run, r"^step +3/", timeout=120)
    assert "Traceback" not in "\n".join(run.lines)
    assert 3 <= stopped_at < steps
    ckpts = complete_checkpoints(str(out / "checkpoints"))
    assert [s for s, _ in ckpts] == [stopped_at] and is_loadable(ckpts[0][1])
    assert marker.read_text().split()[0] == str(stopped_at)  # the batch script's cue to requeue
    resumed = run_to_end(_args(out, cache_dir, steps))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resumed from {ckpts[0][1]} at step {stopped_at}" in resumed.stdout
    assert losses_of(str(out)) == losses_of(str(tmp_path / "ref"))  # bit-identical, every step


def _train(values: dict) -> object:
    rj = resolve(job_from_dict(values, model="gpt_tiny"), 1)
    return train(rj, ParallelState.single_process())


@pytest.fixture(scope="module")
def warm_cache(tmp_path_factory, cache_dir) -> None:
    """One step trained once for the budget tests below: the corpus cache is built (and this process's torch set
    up) before a budget of seconds starts counting. Same ``train.steps`` as theirs: the job they will run."""
    _train(job_values(str(tmp_path_factory.mktemp("warm")), cache_dir, train={"steps": BUDGET_STEPS, "stop_after": 1}))


def test_max_minutes_saves_and_stops_in_time_then_resumes_bit_identically(tmp_path, cache_dir, warm_cache):
    """However many steps fit in the budget on this machine, the resumed run continues the curve of
    an uninterrupted run bit for bit (the comparison ends two steps after the stop)."""
    steps = BUDGET_STEPS
    out = str(tmp_path / "budget")
    budget_min = 0.03  # 1.8 s, set-up included
    t0 = time.monotonic()
    first = _train(job_values(out, cache_dir, train={"steps": steps, "max_minutes": budget_min}))
    took = time.monotonic() - t0
    assert first.stopped is not None and f"train.max_minutes={budget_min}" in first.stopped
    assert took < budget_min * 60 + 3  # stopped (and saved) by the budget, give or take a step on a busy machine
    assert first.checkpoints == [first.last_step] and 1 <= first.last_step < steps
    until = first.last_step + 2
    full = _train(job_values(str(tmp_path / "full"), cache_dir, train={"steps": steps, "stop_after": until}))
    second = _train(job_values(out, cache_dir, train={"steps": steps, "stop_after": until}))
    assert second.start_step == first.last_step and second.stopped is None
    assert losses_of(out) == {r["step"]: r["loss"] for r in full.records}
    assert sorted(losses_of(out)) == list(range(1, until + 1))


def _save_in_flight(root, after: int, timeout: float = 120) -> str:
    """Wait until ``root`` holds a checkpoint being written (``step_N.tmp``, renamed at its commit) of a step past
    ``after``; returns its name. Read from the disk, so a signal sent next lands inside that save."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        names = os.listdir(root) if os.path.isdir(root) else []
        for name in names:
            found = re.fullmatch(r"step_(\d+)\.tmp", name)
            if found and int(found.group(1)) > after:
                return name
        time.sleep(0.02)
    raise AssertionError(f"no save in flight under {root} after step {after}: {names}")


@pytest.mark.slow
def test_sigterm_to_torchrun_mid_step_and_mid_save_resumes_bit_identically(tmp_path, cache_dir):
    """2 ranks (pp=2). First SIGTERM mid-step; after a resume, SIGTERM while an async save is
    in flight (the disk made slow on rank 1 by the ``checkpoint.write`` fault point; the signal follows its
    ``.tmp`` directory on disk). Each stop: exit status 3 on the ranks, one stop line, the requeue marker,
    the newest checkpoint intact. The uninterrupted reference and the last resume (after the mid-save stop) train
    in-process (``train_like_the_cli``)."""
    steps = 12
    layout = ["parallel.pp=2", "train.async_save=true"]
    out = tmp_path / "run"
    marker = tmp_path / "requeue"
    stops = []
    for fault in ("", "checkpoint.write@1=sleep:2"):
        run = Run(_args(out, cache_dir, steps, *layout, "train.save_every=2"), nproc=2, P3D_FAULT=fault,
                  P3D_REQUEUE_FILE=str(marker))
        try:
            if fault:  # a save of the resumed run in flight (its write sleeps 2 s on rank 1)
                newest = complete_checkpoints(str(out / "checkpoints"))[-1][1]
                assert f"resumed from {newest} at step {stops[-1][0]}" in run.wait_for(r"resumed from")
                _save_in_flight(out / "checkpoints", after=stops[-1][0])
            else:
                run.wait_for(r"^step +3/")
            t0 = time.monotonic()
            os.kill(run.proc.pid, signal.SIGTERM)
            status, _ = run.finish(timeout=120)
            seconds = time.monotonic() - t0
        finally:
            run.kill()
        text = "\n".join(run.lines)
        assert status != 0 and seconds < STOP_BOUND_S, text[-3000:]
        stop = [line for line in run.lines if line.startswith("stopping at step")]
        # torchrun signals the ranks one by one, so the logging rank may hear of it from another rank first
        assert len(stop) == 1 and re.search(r"(received SIGTERM|SIGTERM received on another rank)", stop[0]), text[-3000:]
        assert f"exitcode: {EXIT_STOPPED}" in text or "SIGTERM" in text
        assert not any(line.startswith("[rank") and "failed:" in line for line in run.lines), text[-3000:]
        stops.append((int(stop[0].split()[3]), seconds))
        assert marker.read_text().split()[0] == str(stops[-1][0])  # the batch script's cue to requeue
        ckpts = [s for s, _ in complete_checkpoints(str(out / "checkpoints"))]
        assert ckpts[-1] == stops[-1][0] and all(is_loadable(p) for _, p in complete_checkpoints(str(out / "checkpoints")))
        assert not [n for n in os.listdir(out / "checkpoints") if n.endswith(".tmp")]
    # The last resume trains in-process: a resume through torchrun is the second launch above (its losses are
    # compared below too); here what counts is that it starts from the newest (mid-save) checkpoint.
    final = train_like_the_cli(_args(out, cache_dir, steps, *layout, "train.save_every=2"), world=2)
    assert final == [(stops[-1][0], steps)] * 2, final
    train_like_the_cli(_args(tmp_path / "ref", cache_dir, steps, *layout), world=2)
    assert losses_of(str(out)) == losses_of(str(tmp_path / "ref"))
    print(f"SIGTERM -> all processes gone: mid-step {stops[0][1]:.1f}s, mid-save {stops[1][1]:.1f}s")


def test_time_budget_interrupts_a_long_evaluation_and_saves_that_step(tmp_path, cache_dir, warm_cache):
    """An evaluation of many batches does not hold up the stop: the budget is asked before each evaluation
    batch, the evaluation ends with no eval_loss logged for it, and the step it followed is saved."""
    steps = BUDGET_STEPS
    out = str(tmp_path / "budget")
    budget_min = 0.03  # 1.8 s, set-up included
    values = job_values(out, cache_dir, train={"steps": steps, "max_minutes": budget_min, "eval_every": 1,
                                               "eval_iters": 20_000},  # unbounded by the budget: minutes here
                        data={"valid_fraction": 0.1})
    t0 = time.monotonic()
    first = _train(values)
    took = time.monotonic() - t0
    assert first.stopped is not None and f"train.max_minutes={budget_min}" in first.stopped
    assert took < budget_min * 60 + 3, f"stopped {took:.1f} s after start: the evaluation held the stop up"
    assert first.checkpoints == [first.last_step] and 1 <= first.last_step < steps
    assert all("eval_loss" not in r for r in first.records if r["step"] == first.last_step)


@pytest.mark.slow
def test_sigterm_during_a_long_evaluation_stops_and_checkpoints_that_step(tmp_path, cache_dir):
    """The real CLI: SIGTERM while an evaluation of 100,000 batches runs (or the step before it) ends the
    job with exit 3 and a checkpoint of the evaluated step, within the same bound as mid-step."""
    out = tmp_path / "run"
    args = [*_args(out, cache_dir, 20, "train.save_every=0", "train.eval_every=1", "data.valid_fraction=0.1"),
            "train.eval_iters=100000"]  # after TINY's eval_iters=0: the later override wins
    run = Run(args)
    # The banner comes once the handlers are installed; step 1's line only after its evaluation.
    stopped_at = _sigterm_once(run, r"^parallel3d: ", timeout=2 * STOP_BOUND_S)
    assert any(line.startswith(f"evaluation after step {stopped_at} stopped after") for line in run.lines), \
        run.lines[-20:]
    ckpts = complete_checkpoints(str(out / "checkpoints"))
    assert [s for s, _ in ckpts] == [stopped_at] and is_loadable(ckpts[0][1])


def test_ctrl_c_is_one_line_per_rank_exit_130_and_keeps_the_checkpoints(tmp_path, cache_dir):
    """Session 43: Ctrl-C (SIGINT to the process group, as a terminal sends it) printed a 30-line
    KeyboardInterrupt traceback. It is one line and the shell's status 130; the checkpoint written before
    it stays loadable, and train.resume=auto continues from it."""
    from parallel3d.train import EXIT_INTERRUPTED

    out = tmp_path / "run"
    run = Run(_args(out, cache_dir, 400, "train.save_every=2"))
    try:
        run.wait_for(r"^checkpoint step 2:")  # printed a step or two after the step (async save)
        os.killpg(run.proc.pid, signal.SIGINT)
        status, seconds = run.finish(timeout=120)
    finally:
        run.kill()
    text = "\n".join(run.lines)
    assert status == EXIT_INTERRUPTED == 130 and seconds < STOP_BOUND_S, text[-3000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    lines = [line for line in run.lines if "interrupted" in line]
    assert len(lines) == 1 and lines[0].startswith("[rank 0] interrupted (SIGINT, Ctrl-C): stopped at once without a "
                                                   f"save; the checkpoints in {out / 'checkpoints'} are kept"), lines
    ckpts = complete_checkpoints(str(out / "checkpoints"))
    assert ckpts and all(is_loadable(path) for _, path in ckpts)
