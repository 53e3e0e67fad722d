"""A rank stopped (SIGSTOP) or killed (SIGKILL) by PID mid-step: the job ends within a bound, and
for a hang the error names the hung rank (heartbeats), not only the rank that timed out."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.fault_runs import REPO, TINY, Run, alive, cli_env, worker_pids
from tests.harness import free_port

TIMEOUT_S = 8


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("corpus_cache"))


@pytest.mark.slow
def test_a_stopped_rank_is_named_and_the_job_ends_after_timeout(tmp_path, cache_dir):
    """Two ranks started as a launcher would (RANK/WORLD_SIZE/MASTER_*), so the test owns their PIDs."""
    port = free_port()
    args = [*TINY, "train.steps=100000", f"train.out_dir={tmp_path / 'run'}", f"data.cache_dir={cache_dir}",
            "parallel.dp=2", f"train.timeout_s={TIMEOUT_S}", "train.save_every=0"]
    procs = [subprocess.Popen([sys.executable, "-m", "parallel3d.train", *args], cwd=REPO,
                              env=cli_env(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2",
                                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in (0, 1)]
    try:
        for line in procs[0].stdout:  # rank 0 logs: wait until training runs
            if line.startswith("step") and "/100000" in line and line.split()[1].startswith("5/"):
                break
        os.kill(procs[1].pid, signal.SIGSTOP)
        t0 = time.monotonic()
        _, err0 = procs[0].communicate(timeout=TIMEOUT_S + 90)
        seconds = time.monotonic() - t0
    finally:
        for p in procs:
            p.kill()
            p.communicate()
    assert procs[0].returncode == 1, err0[-3000:]
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
def test_ranks_starting_further_apart_than_the_collective_timeout_still_train(tmp_path, cache_dir):
    """Ranks start minutes apart on a loaded node (each imports torch); with train.timeout_s shorter than
    that, the default group's rendezvous had failed the start-up (``DistStoreError: wait timeout``, no rank
    named). It waits ``parallel_state.START_TIMEOUT_S``; collectives keep train.timeout_s."""
    from parallel3d.parallel_state import START_TIMEOUT_S

    late_s = 4 + 3  # rank 1 starts this long after rank 0: more than timeout_s below
    assert START_TIMEOUT_S > late_s + 60
    port = free_port()
    args = [*TINY, "train.steps=2", f"train.out_dir={tmp_path / 'run'}", f"data.cache_dir={cache_dir}",
            "parallel.dp=2", "train.timeout_s=4", "train.save_every=0"]
    procs = []
    try:
        for r in (0, 1):
            procs.append(subprocess.Popen([sys.executable, "-m", "parallel3d.train", *args], cwd=REPO,
                                          env=cli_env(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                                                      LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                                      MASTER_PORT=str(port)),
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
            if r == 0:
                time.sleep(late_s)
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
