"""A pool's idle workers do not outlive the process that owns it.

A test process killed outright (SIGKILL, as a shell's ``timeout -s KILL`` or the OOM killer does) never sends
its pool the ``None`` that ends the workers, and the fork server that started them exits with it, so they are
reparented to init. Each idle worker must notice its owner is gone and exit within ``OWNER_POLL_S``.
Reference: the workers' PIDs, read from outside (``/proc``), after the owner is dead.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tests.harness import OWNER_POLL_S

ROOT = Path(__file__).resolve().parents[1]
MARGIN_S = 20.0  # a worker polls every OWNER_POLL_S; beyond that, exiting and being reaped on a loaded machine

OWNER = """
import os, signal, sys
from tests.harness import run_on_ranks
from tests.test_harness_orphans import worker_pid
print(" ".join(str(p) for p in run_on_ranks(worker_pid, 2, timeout=120)), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def worker_pid(rank: int, world: int) -> int:
    return os.getpid()


def _running(pid: int) -> bool:  # independent of the harness's own check
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has exited; only its entry waits for a reaper


def test_idle_workers_exit_when_their_owner_is_killed(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "P3D_FRESH_RANKS": "0"}
    # Files, not pipes: the workers inherit the owner's stdout and stderr, and a pipe would stay open (and
    # ``communicate`` wait) as long as any of them lives.
    out, err = tmp_path / "owner.out", tmp_path / "owner.err"
    with open(out, "w") as out_f, open(err, "w") as err_f:
        owner = subprocess.run([sys.executable, "-c", OWNER], cwd=ROOT, env=env, stdout=out_f, stderr=err_f,
                               timeout=400)
    assert owner.returncode == -9, err.read_text()[-2000:]
    pids = [int(p) for p in out.read_text().split()]
    assert len(pids) == 2 and os.getpid() not in pids
    deadline = time.monotonic() + OWNER_POLL_S + MARGIN_S
    while any(_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    alive = [p for p in pids if _running(p)]
    for p in alive:  # do not leave them behind even when the test fails
        try:
            os.kill(p, 9)
        except ProcessLookupError:
            pass
    assert not alive, f"workers {alive} outlived their killed owner by {OWNER_POLL_S + MARGIN_S:.0f} s"
