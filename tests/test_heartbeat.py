"""heartbeat.diagnose: names the silent ranks with every rank's last completed step, and ignores
the files of another run (this process has not beaten)."""

from __future__ import annotations

import json
import os
import time

from parallel3d.heartbeat import Heartbeat, diagnose, heartbeat_dir


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


def test_files_of_another_run_are_not_a_diagnosis(tmp_path):
    os.makedirs(heartbeat_dir(str(tmp_path)))
    for rank in (0, 1):
        with open(os.path.join(heartbeat_dir(str(tmp_path)), f"rank_{rank:05d}.json"), "w") as fh:
            json.dump({"rank": rank, "step": 3, "time": time.time() - 999, "pid": 1, "interval_s": 1.0}, fh)
    assert diagnose(str(tmp_path), 2, rank=0) is None
