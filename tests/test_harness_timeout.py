"""``run_on_ranks`` on ranks that hang: it returns within its timeout plus ``MARGIN_S``, with an error naming
the hung ranks, and leaves no process behind, neither the ranks nor what they started.

The hung ranks: rank 0 ignores SIGTERM and sleeps, after starting a child process (``sleep``) of its own;
rank 1 waits in an all-reduce that rank 0 never joins (gloo's collective timeout is far longer than the
test's); rank 2 returns. Each hung rank writes its PID and its child's before it hangs, so the test can
check by PID that each is gone afterwards.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.harness import run_on_ranks

TIMEOUT_S = 4.0
# What the return may take past the timeout: the result queue is polled every 1 s, then every rank's
# process group is killed and each rank joined (a killed process is reaped in well under a second).
MARGIN_S = 8.0


def _noop(rank: int, world: int) -> int:
    return rank


def _hang(rank: int, world: int, pid_dir: str) -> int:
    import torch
    import torch.distributed as dist

    if rank == 2:
        return rank
    child = subprocess.Popen(["sleep", "600"])  # a rank's own child process
    Path(pid_dir, f"rank{rank}").write_text(f"{os.getpid()} {child.pid}")
    if rank == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(600)
    dist.all_reduce(torch.ones(1))  # rank 1: rank 0 never joins
    return rank


def _running(pid: int) -> bool:
    """The process exists and is not a zombie (a killed child reparented to init may wait to be reaped)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    state = next(line for line in status.splitlines() if line.startswith("State:"))
    return "Z" not in state.split()[1]


def test_hung_ranks_are_named_killed_with_their_children_and_the_call_returns_promptly(tmp_path):
    run_on_ranks(_noop, 3)  # start-up is not charged to the timeout (harness doc): start the ranks first
    start = time.monotonic()
    with pytest.raises(TimeoutError) as caught:
        run_on_ranks(_hang, 3, str(tmp_path), timeout=TIMEOUT_S)
    took = time.monotonic() - start
    pids = {f"rank {r} {what}": int(pid) for r in (0, 1) for what, pid in
            zip(("process", "child"), (tmp_path / f"rank{r}").read_text().split())}
    deadline = time.monotonic() + 2.0  # SIGKILL is delivered asynchronously: give the kernel a moment
    while any(_running(pid) for pid in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = {name: pid for name, pid in pids.items() if _running(pid)}
    for pid in left.values():  # before any assertion: a rank left running (SIGTERM ignored) would hang
        os.kill(pid, signal.SIGKILL)  # this session's exit in multiprocessing's join of its daemons
    message = str(caught.value)
    print(f"run_on_ranks returned {took:.2f}s after the call (timeout {TIMEOUT_S}s): {message}")
    assert not left, f"still running after run_on_ranks returned: {left}"
    assert took <= TIMEOUT_S + MARGIN_S, f"returned {took:.1f}s after the call (timeout {TIMEOUT_S}s)"
    assert "ranks [0, 1] did not finish" in message and "finished: [2]" in message, message
