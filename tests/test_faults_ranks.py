"""A rank stopped (SIGSTOP) or killed (SIGKILL) by PID mid-step: the job ends within a bound, and
for a hang the error names the hung rank (heartbeats), not only the rank that timed out; ranks started
further apart than the collective timeout still train (the same launch as the stopped rank's)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from parallel3d.config import resolve
from parallel3d.datasets import build_datasets
from parallel3d.parallel_state import ParallelState
from parallel3d.train import compose_job
from tests.fault_runs import REPO, TINY, Run, alive, cli_env, worker_pids
from tests.harness import free_port

TIMEOUT_S = 4  # train.timeout_s of the two-rank job below: its heartbeats go stale after STALE_BEATS x 0.8 s
LATE_S = TIMEOUT_S + 3  # rank 1 starts this long after rank 0: more than TIMEOUT_S, whatever rank 0's own start-up


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    """The corpus built once, as the CLI's rank 0 would build it (``datasets.build_datasets``): no rank of a run
    below then waits ``train.timeout_s`` for a builder tokenizing on a loaded machine."""
    cache = str(tmp_path_factory.mktemp("corpus_cache"))
    rj = resolve(compose_job([*TINY, f"data.cache_dir={cache}"])[0], 1)
    build_datasets(rj, ParallelState.single_process())
    return cache


@pytest.fixture(scope="module")
def late_start_then_stop(tmp_path_factory, cache_dir) -> dict:
    """ONE job for the two tests below (a launch of two ranks costs two torch imports): ranks started as a launcher
    would (RANK/WORLD_SIZE/MASTER_*), so the test owns their PIDs; rank 1 starts ``LATE_S`` after rank 0, further
    apart than ``train.timeout_s``; once rank 0 has logged step 5 (each step all-reduces over both ranks), rank 1 is
    stopped (SIGSTOP). Returns what rank 0 printed, both exits and the seconds from the stop to rank 0's exit."""
    port = free_port()
    args = [*TINY, "train.steps=100000", f"train.out_dir={tmp_path_factory.mktemp('late') / 'run'}",
            f"data.cache_dir={cache_dir}", "parallel.dp=2", f"train.timeout_s={TIMEOUT_S}", "train.save_every=0"]
    procs, steps = [], []
    try:
        for r in (0, 1):
            procs.append(subprocess.Popen([sys.executable, "-m", "parallel3d.train", *args], cwd=REPO,
                                          env=cli_env(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                                                      LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                                      MASTER_PORT=str(port)),
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
            if r == 0:
                time.sleep(LATE_S)
        for line in procs[0].stdout:  # rank 0 logs: wait until training runs
            if line.startswith("step") and "/100000" in line:
                steps.append(int(line.split()[1].split("/")[0]))
                if steps[-1] == 5:
                    break
        alive_at_stop = [p.poll() is None for p in procs]
        os.kill(procs[1].pid, signal.SIGSTOP)
        t0 = time.monotonic()
        _, err0 = procs[0].communicate(timeout=TIMEOUT_S + 90)
        seconds = time.monotonic() - t0
    finally:
        for p in procs:
            p.kill()
        outs = [p.communicate() for p in procs]
    return {"steps": steps, "alive_at_stop": alive_at_stop, "err0": err0, "err1": outs[1][1],
            "status": [p.returncode for p in procs], "seconds": seconds}


@pytest.mark.slow
def test_a_stopped_rank_is_named_and_the_job_ends_after_timeout(late_start_then_stop):
    run = late_start_then_stop
    err0, seconds = run["err0"], run["seconds"]
    assert run["status"][0] == 1, err0[-3000:]
    failed = [line for line in err0.splitlines() if line.startswith("[rank 0] failed:")]
    assert len(failed) == 1, err0[-3000:]
    assert "hung or dead: rank 1 (silent for" in failed[0], failed[0]
    assert "last completed step of every rank" in failed[0]
    assert "Traceback" not in err0
    assert TIMEOUT_S - 1 <= seconds < TIMEOUT_S + 30, seconds
    print(f"SIGSTOP rank 1 -> rank 0 exits naming it after {seconds:.1f}s (timeout_s={TIMEOUT_S})")


@pytest.mark.slow
def test_a_killed_rank_ends_the_whole_torchrun_job(tmp_path, cache_dir):
    args = [*TINY, "train.steps=100000", f"train.out_dir={tmp_path / 'run'}", f"data.cache_dir={cache_dir}",
            "parallel.pp=2", "train.timeout_s=60", "train.save_every=0"]
    run = Run(args, nproc=2)
    try:
        run.wait_for(r"^step +5/")
        ranks = worker_pids(run.proc.pid)
        assert len(ranks) == 2
        os.kill(ranks[1], signal.SIGKILL)
        status, seconds = run.finish(timeout=120)
    finally:
        run.kill()
    assert status != 0
    assert not any(alive(pid) for pid in ranks)
    assert seconds < 35, seconds  # torchrun's grace period for the survivors is 30 s
    print(f"SIGKILL rank 1 -> every process gone after {seconds:.1f}s")


@pytest.mark.slow
def test_ranks_starting_further_apart_than_the_collective_timeout_still_train(late_start_then_stop):
    """Ranks start minutes apart on a loaded node (each imports torch); with train.timeout_s shorter than
    that, the default group's rendezvous had failed the start-up (``DistStoreError: wait timeout``, no rank
    named). It waits ``parallel_state.START_TIMEOUT_S``; collectives keep train.timeout_s. The shared job's
    rank 1 started ``LATE_S`` after rank 0: both trained steps 1-5 together (each step all-reduces over them),
    and both were still running, rank 1 without a failure, when rank 1 was stopped."""
    from parallel3d.parallel_state import START_TIMEOUT_S

    assert LATE_S > TIMEOUT_S and START_TIMEOUT_S > LATE_S + 60
    run = late_start_then_stop
    assert run["steps"] == [1, 2, 3, 4, 5], run["err0"][-2000:]
    assert "failed:" not in run["err1"] and "Traceback" not in run["err1"], run["err1"][-2000:]
    assert run["alive_at_stop"] == [True, True] and "DistStoreError" not in run["err0"], run["err0"][-2000:]
