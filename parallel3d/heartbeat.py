"""Heartbeats: which rank is hung or dead when a collective times out.

A collective timeout is raised on the ranks that *waited*, not on the one that hung; so
every rank publishes, in ``<train.out_dir>/heartbeat/rank_<r>.json`` (a filesystem every
rank sees, like the checkpoints), its last completed step and a timestamp refreshed by a
daemon thread every ``interval_s``. The thread keeps beating while the main thread waits in
a collective (C++ releases the GIL), and stops when the process is stopped (SIGSTOP, a
hung node) or dead. Each beat also says where the training thread is (``thread_probe``: a rank
whose training thread is stuck outside a wait for peers keeps beating) and which process and host
wrote it. ``diagnose`` reads every rank's file and names the ranks that are hung or dead, with each
rank's last completed step: a beat older than ``STALE_BEATS`` intervals (stopped or dead), a process
of this host that is gone (killed: its peers see the broken connection before its beat is stale), or a
training thread parked at one place that is not a wait for peers for ``STALE_BEATS`` intervals.

Invariant: a file is replaced atomically (write + rename), so a reader sees a whole record
or the previous one; writes never raise into training (a full disk only loses beats).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time

from parallel3d.thread_probe import probe

STALE_BEATS = 3  # a rank silent for this many intervals is reported as hung or dead
# A killed peer's sockets close while the kernel tears the process down, a moment before it has ended:
# a rank that failed on the broken connection looks again for this long before it reports no culprit.
GONE_WAIT_S = 2.0
# No rank writes its file more often than this (shared filesystems): the floor of the interval, and the
# least gap between the beats that publish a newly completed step.
MIN_BEAT_GAP_S = 0.5


def beat_interval(timeout_s: float) -> float:
    """Several beats per collective timeout, but no more than one per ``MIN_BEAT_GAP_S``."""
    return max(MIN_BEAT_GAP_S, min(10.0, timeout_s / 5))


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
        self._stepped = threading.Event()  # a step completed since the last beat
        self._thread: threading.Thread | None = None
        self._training_thread = threading.get_ident()  # the thread that starts the heartbeat trains
        self._where: tuple[str, bool] | None = None
        self._where_since = time.time()

    def completed(self, step: int) -> None:
        """Record that ``step`` is done; the thread publishes it within ``MIN_BEAT_GAP_S``, not at the
        next interval (fast steps with a long interval otherwise reported a dead peer's step as 0)."""
        self.step = step
        self._stepped.set()

    def _sample(self) -> dict:
        """Where the training thread is, and since when it has been there (module doc)."""
        where = probe(self._training_thread)
        if where != self._where:
            self._where, self._where_since = where, time.time()
        if where is None:
            return {}
        return {"where": where[0], "waiting": where[1], "where_since": self._where_since}

    def _write(self) -> None:
        try:
            os.makedirs(self.directory, exist_ok=True)
            path = _path(self.directory, self.rank)
            body = json.dumps({"rank": self.rank, "step": self.step, "time": time.time(), "pid": os.getpid(),
                               "host": socket.gethostname(), "interval_s": self.interval_s, **self._sample()})
            with open(path + ".part", "w") as fh:
                fh.write(body)
            os.replace(path + ".part", path)
        except OSError:
            pass  # losing a beat must never stop training

    def _run(self) -> None:
        last = time.monotonic()  # start() has just written
        while not self._stop.wait(min(MIN_BEAT_GAP_S, self.interval_s)):
            # Beat at the interval, or earlier once a step has completed (the gap above has passed).
            self._stepped.wait(max(0.0, self.interval_s - (time.monotonic() - last)))
            if self._stop.is_set():
                return
            self._stepped.clear()
            self._write()
            last = time.monotonic()

    def start(self) -> None:
        self._write()
        self._thread = threading.Thread(target=self._run, name="p3d-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._stepped.set()  # wake the thread now rather than at the end of its interval
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


def _process_gone(beat: dict) -> bool:
    """Whether the process that wrote ``beat`` ran on this host and has ended (a zombie counts as ended)."""
    if beat.get("host") != socket.gethostname() or not isinstance(beat.get("pid"), int):
        return False
    try:
        with open(f"/proc/{beat['pid']}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        pass
    try:
        os.kill(beat["pid"], 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, another user's
        return False
    return False


def _stuck_for(beat: dict, now: float) -> float | None:
    """Seconds the training thread of ``beat`` has been parked outside a wait for peers (None: it is not)."""
    if beat.get("waiting", True) or "where_since" not in beat:
        return None
    return now - float(beat["where_since"])


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
    me, silent, by_step = rank, [], {}
    for rank, beat in beats.items():
        if beat is None:
            silent.append(f"rank {rank} (no heartbeat)")
            continue
        age = now - float(beat["time"])
        stale = STALE_BEATS * float(beat.get("interval_s", 1.0))
        by_step.setdefault(int(beat["step"]), []).append(rank)
        stuck = _stuck_for(beat, now)
        if rank == me:  # this rank is reporting: neither dead nor stuck
            continue
        if _process_gone(beat):
            silent.append(f"rank {rank} (process {beat['pid']} gone, last completed step {beat['step']})")
        elif age > stale:
            silent.append(f"rank {rank} (silent for {age:.0f}s, last completed step {beat['step']})")
        elif stuck is not None and stuck > stale:
            silent.append(f"rank {rank} (stuck for {stuck:.0f}s at {beat['where']}, not waiting for peers, "
                          f"last completed step {beat['step']})")
    if not silent:
        return None
    steps = "; ".join(f"step {s}: ranks {_ranks(r)}" for s, r in sorted(by_step.items()))
    return f"hung or dead: {', '.join(silent)}; last completed step of every rank: {steps}"


def diagnose_failure(out_dir: str, world_size: int, rank: int, wait_s: float = GONE_WAIT_S) -> str | None:
    """``diagnose`` for a rank that has failed: polled for up to ``wait_s`` while it finds no culprit."""
    deadline = time.monotonic() + wait_s
    found = diagnose(out_dir, world_size, rank)
    while found is None and time.monotonic() < deadline:
        time.sleep(0.1)
        found = diagnose(out_dir, world_size, rank)
    return found
