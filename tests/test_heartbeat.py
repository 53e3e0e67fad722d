"""heartbeat.diagnose: names the silent ranks with every rank's last completed step, a rank whose process
is gone, a rank whose training thread is stuck outside a wait for peers (and not the ranks waiting for it),
and ignores the files of another run (this process has not beaten)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

from parallel3d.heartbeat import MIN_BEAT_GAP_S, Heartbeat, diagnose, diagnose_failure, heartbeat_dir, read_beats
from tests.harness import run_on_ranks


def test_a_silent_rank_is_named_with_every_ranks_last_step(tmp_path):
    out = str(tmp_path)
    me = Heartbeat(out, 0, interval_s=0.2)
    me.completed(7)
    me.start()
    try:
        time.sleep(0.3)
        now = time.time()
        for rank, (step, age) in {1: (7, 0.1), 2: (6, 30.0)}.items():  # rank 2 stopped 30 s ago
            with open(os.path.join(heartbeat_dir(out), f"rank_{rank:05d}.json"), "w") as fh:
                json.dump({"rank": rank, "step": step, "time": now - age, "pid": 1, "interval_s": 0.2}, fh)
        found = diagnose(out, 4, rank=0)
    finally:
        me.stop()
    assert found is not None
    assert "rank 2 (silent for 30s, last completed step 6)" in found and "rank 3 (no heartbeat)" in found
    assert "rank 1 (" not in found and "rank 0 (" not in found
    assert found.endswith("last completed step of every rank: step 6: ranks 2; step 7: ranks 0,1")


def test_a_completed_step_is_published_within_the_gap_not_the_interval(tmp_path):
    """Session 43: a pp 2 run at train.timeout_s=30 (6 s beats) did 15 steps in 2 s; its rank 1 was killed
    and rank 0's line said "rank 1 (process ... gone, last completed step 0)", every rank at step 0. A
    completed step now reaches the file within MIN_BEAT_GAP_S, however long the interval."""
    out = str(tmp_path)
    beat = Heartbeat(out, 0, interval_s=60.0)
    beat.start()
    try:
        for step in range(1, 16):
            beat.completed(step)
            time.sleep(0.02)
        deadline = time.monotonic() + 4 * MIN_BEAT_GAP_S
        while time.monotonic() < deadline and read_beats(out, 1)[0]["step"] != 15:
            time.sleep(0.05)
        assert read_beats(out, 1)[0]["step"] == 15
    finally:
        beat.stop()


def test_files_of_another_run_are_not_a_diagnosis(tmp_path):
    os.makedirs(heartbeat_dir(str(tmp_path)))
    for rank in (0, 1):
        with open(os.path.join(heartbeat_dir(str(tmp_path)), f"rank_{rank:05d}.json"), "w") as fh:
            json.dump({"rank": rank, "step": 3, "time": time.time() - 999, "pid": 1, "interval_s": 1.0}, fh)
    assert diagnose(str(tmp_path), 2, rank=0) is None


def test_a_process_of_this_host_that_is_gone_is_named_before_its_beat_is_stale(tmp_path):
    """A killed rank's peers see the broken connection at once, long before its last beat grows stale."""
    out = str(tmp_path)
    me = Heartbeat(out, 0, interval_s=5.0)
    me.start()
    try:
        gone = subprocess.Popen([sys.executable, "-c", "pass"])
        gone.wait()
        for rank, pid in ((1, gone.pid), (2, os.getpid())):  # rank 2: a live process of this host
            with open(os.path.join(heartbeat_dir(out), f"rank_{rank:05d}.json"), "w") as fh:
                json.dump({"rank": rank, "step": 4, "time": time.time(), "pid": pid, "host": socket.gethostname(),
                           "interval_s": 5.0}, fh)
        found = diagnose(out, 3, rank=0)
    finally:
        me.stop()
    assert found is not None and f"rank 1 (process {gone.pid} gone, last completed step 4)" in found, found
    assert "rank 2 (" not in found and "rank 0 (" not in found


def test_a_failed_rank_waits_a_moment_for_the_peer_that_broke_the_connection_to_end(tmp_path):
    """Found by the fault fuzz (a SIGKILLed pipeline stage): its peer saw the connection closed while the
    killed process was still being torn down, and named no one. The failure path looks again briefly."""
    out = str(tmp_path)
    me = Heartbeat(out, 0, interval_s=5.0)
    me.start()
    try:
        ending = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.0)"])
        with open(os.path.join(heartbeat_dir(out), "rank_00001.json"), "w") as fh:
            json.dump({"rank": 1, "step": 2, "time": time.time(), "pid": ending.pid, "host": socket.gethostname(),
                       "interval_s": 5.0}, fh)
        assert diagnose(out, 2, rank=0) is None  # still running
        found = diagnose_failure(out, 2, rank=0, wait_s=30.0)
    finally:
        me.stop()
        ending.wait()
    assert found is not None and f"rank 1 (process {ending.pid} gone, last completed step 2)" in found, found


def _one_stuck_rank(rank: int, world: int, out_dir: str) -> str | None:
    """Rank 1's training thread is parked outside any collective while ranks 0 and 2 wait in a barrier;
    rank 0 diagnoses from another thread meanwhile. Every heartbeat goes on beating."""
    beat = Heartbeat(out_dir, rank, interval_s=0.2)
    beat.start()
    try:
        if rank == 1:
            threading.Event().wait(4.0)  # stuck here
            dist.barrier()
            return None
        found: dict[str, str | None] = {}
        probe = threading.Timer(3.0, lambda: found.update(clause=diagnose(out_dir, world, rank)))
        probe.start()
        dist.barrier()
        probe.join()
        return found.get("clause")
    finally:
        beat.stop()


@pytest.mark.slow
def test_a_training_thread_stuck_outside_a_collective_is_named_not_the_ranks_waiting_for_it(tmp_path):
    clause = run_on_ranks(_one_stuck_rank, 3, str(tmp_path), timeout=60)[0]
    assert clause is not None and re.search(r"rank 1 \(stuck for \d+s at \S*test_heartbeat\.py:\d+ in _one_stuck_rank, "
                                            r"not waiting for peers", clause), clause
    assert "rank 2 (" not in clause and "rank 0 (" not in clause, clause
