"""``scripts/profile_gloo_spin.py``'s episode counting: a run of ready ``epoll_wait`` returns with no I/O between
them is one busy-wait episode when longer than ``SPIN_RUN``, timed from its first return to the I/O ending it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from profile_gloo_spin import SPIN_RUN, _Tally  # noqa: E402

KEY = (0, "zero0", "gloo_tcp_loop", "7")


def _feed(tally: _Tally, runs: list[int], gap: float = 1e-6, other_thread: bool = False) -> list[float]:
    """Each entry of ``runs``: that many ready returns, then one ``recv``; returns each run's span (s)."""
    t, spans = 0.0, []
    for n in runs:
        start = t + gap
        for _ in range(n):
            t += gap
            tally.syscall(KEY, "7", t, "epoll_wait", 1)
            if other_thread:  # another thread's events interleave: they must not end this thread's run
                tally.syscall((0, "zero0", "gloo_tcp_loop", "8"), "8", t, "recv", 48)
        t += gap
        tally.syscall(KEY, "7", t, "recv", 48)
        spans.append(t - start)
    return spans


@pytest.mark.parametrize("other_thread", [False, True])
def test_runs_longer_than_the_threshold_are_episodes(other_thread):
    runs = [1, SPIN_RUN, SPIN_RUN + 1, 50, 2]
    tally = _Tally()
    spans = _feed(tally, runs, other_thread=other_thread)
    c = tally.count[KEY]
    long = [(n, s) for n, s in zip(runs, spans) if n > SPIN_RUN]
    assert c["ready"] == sum(runs)
    assert c["recv"] == len(runs)
    assert c["spins"] == len(long)
    assert c["spin_calls"] == sum(n for n, _ in long)
    assert c["spin_ms"] == pytest.approx(1e3 * sum(s for _, s in long))


def test_an_idle_timeout_or_failed_read_ends_a_run_without_counting_io():
    tally = _Tally()
    for i in range(SPIN_RUN + 2):
        tally.syscall(KEY, "7", i * 1e-6, "epoll_wait", 1)
    tally.syscall(KEY, "7", 1e-3, "epoll_wait", 0)  # a 10 ms idle timeout: not a ready return
    tally.syscall(KEY, "7", 2e-3, "recv", -11)  # EAGAIN
    c = tally.count[KEY]
    assert c["spins"] == 1 and c["spin_calls"] == SPIN_RUN + 2
    assert c["recv"] == 0
