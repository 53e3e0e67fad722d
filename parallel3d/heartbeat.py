"""Heartbeats: which rank is hung or dead when a collective times out.

A collective timeout is raised on the ranks that *waited*, not on the one that hung; so
every rank publishes, in ``<train.out_dir>/heartbeat/rank_<r>.json`` (a filesystem every
rank sees, like the checkpoints), its last completed step and a timestamp refreshed by a
daemon thread every ``interval_s``. The thread keeps beating while the main thread waits in
a collective (C++ releases the GIL), and stops when the process is stopped (SIGSTOP, a
hung node) or dead. ``diagnose`` reads every rank's file and names the ranks whose beat is
older than ``STALE_BEATS`` intervals, with each rank's last completed step.

Invariant: a file is replaced atomically (write + rename), so a reader sees a whole record
or the previous one; writes never raise into training (a full disk only loses beats).
"""

from __future__ import annotations

import json
import os
import threading
import time

STALE_BEATS = 3  # a rank silent for this many intervals is reported as hung or dead


def beat_interval(timeout_s: float) -> float:
    """Several beats per collective timeout, but no more than one per 0.5 s (shared filesystems)."""
    return max(0.5, min(10.0, timeout_s / 5))


def heartbeat_dir(out_dir: str) -> str:
    return os.path.join(out_dir, "heartbeat")


def _path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank_{rank:05d}.json")


class Heartbeat:
    """This rank's heartbeat file and the thread refreshing it (``start`` / ``stop``)."""

    def __init__(self, out_dir: str, rank: int, interval_s: float) -> None:
        self.directory = heartbeat_dir(out_dir)
        self.rank = rank
        self.interval_s = interval_s
        self.step = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def completed(self, step: int) -> None:
        """Record that ``step`` is done (written by the next beat)."""
        self.step = step

    def _write(self) -> None:
        try:
            os.makedirs(self.directory, exist_ok=True)
            path = _path(self.directory, self.rank)
            body = json.dumps({"rank": self.rank, "step": self.step, "time": time.time(), "pid": os.getpid(),
                               "interval_s": self.interval_s})
            with open(path + ".part", "w") as fh:
                fh.write(body)
            os.replace(path + ".part", path)
        except OSError:
            pass  # losing a beat must never stop training

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._write()

    def start(self) -> None:
        self._write()
        self._thread = threading.Thread(target=self._run, name="p3d-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 1)
            self._thread = None


def read_beats(out_dir: str, world_size: int) -> dict[int, dict | None]:
    """Every rank's last record (None: no file)."""
    beats: dict[int, dict | None] = {}
    for rank in range(world_size):
        try:
            with open(_path(heartbeat_dir(out_dir), rank)) as fh:
                beats[rank] = json.load(fh)
        except (OSError, ValueError):
            beats[rank] = None
    return beats


def _ranks(ranks: list[int]) -> str:
    return ",".join(map(str, ranks))


def diagnose(out_dir: str, world_size: int, rank: int, now: float | None = None) -> str | None:
    """One clause naming the silent ranks with every rank's last completed step; None if all beat,
    or if ``rank`` (this process) has not beaten yet: the files are then another run's."""
    now = time.time() if now is None else now
    beats = read_beats(out_dir, world_size)
    mine = beats.get(rank)
    if mine is None or mine.get("pid") != os.getpid():
        return None
    silent, by_step = [], {}
    for rank, beat in beats.items():
        if beat is None:
            silent.append(f"rank {rank} (no heartbeat)")
            continue
        age = now - float(beat["time"])
        by_step.setdefault(int(beat["step"]), []).append(rank)
        if age > STALE_BEATS * float(beat.get("interval_s", 1.0)):
            silent.append(f"rank {rank} (silent for {age:.0f}s, last completed step {beat['step']})")
    if not silent:
        return None
    steps = "; ".join(f"step {s}: ranks {_ranks(r)}" for s, r in sorted(by_step.items()))
    return f"hung or dead: {', '.join(silent)}; last completed step of every rank: {steps}"
