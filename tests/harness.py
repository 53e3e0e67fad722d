"""Run a test function on N real gloo ranks (spawned processes on this machine).

    results = run_on_ranks(fn, world_size, *args, timeout=120, **kwargs)

``fn(rank, world_size, *args, **kwargs)`` runs on every rank after the default
gloo group is initialised (one torch thread per rank, flush-denormal on);
``results[r]`` is rank r's return value (it must pickle). ``fn`` must be a
module-level function of an importable module (spawn pickles it by name).

Start-up of the rank processes is not counted in ``timeout``.
If any rank raises, the test fails with that rank's traceback (the first
failing rank, by arrival). If the ranks do not all finish within ``timeout``
seconds, every rank is killed with the processes it started (its process group,
SIGKILL: a hung rank may ignore SIGTERM) and the test fails naming the ranks that
had not finished (``tests/test_harness_timeout.py``). A failure or timeout also
tears the worker set down, so the next test starts on fresh processes.

Workers are forked from ``multiprocessing``'s fork server, which imports ``PRELOAD`` (torch
and the framework, and what a first step would import lazily) once per session: a new worker costs a fork,
not an interpreter importing torch (~4 s of CPU each on 2 cores) nor a first step importing torch._dynamo and
triton (~1 s each; ``tests/test_harness_pools.py``). They are kept alive between tests of the same world size
(the ``WARM_WORLD_SIZES`` most recently used sizes);
each task's new process groups are destroyed when it ends. An idle worker whose owner (the test
process) has died exits within ``OWNER_POLL_S`` (``tests/test_harness_orphans.py``). Set ``P3D_FRESH_RANKS=1`` for fresh
processes per test. Workers see the environment of the session when its first pool started:
tests pass settings as arguments.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import itertools
import multiprocessing as mp
import os
import queue
import signal
import socket
import time
import traceback
from pathlib import Path
from typing import Any, Callable

COLLECTIVE_TIMEOUT_S = 90.0
STARTUP_TIMEOUT_S = 300.0
WARM_WORLD_SIZES = 3  # pools kept between tests; idle pools cost memory, not CPU
OWNER_POLL_S = 2.0  # how often an idle worker checks that the test process owning its pool still lives
# Imported once, in the fork server. Beyond the trainer: what a rank's first step imports lazily (about 300
# modules, ~1 s of CPU in every fresh rank otherwise): torch.utils.checkpoint's first call imports
# torch._dynamo (and inductor, numpy), the AdamW / cross-entropy kernels import triton, the corpus tokenizers.
PRELOAD = ["tests.harness", "parallel3d.trainer", "torch._dynamo", "kernels.adamw", "kernels.cross_entropy",
           "tokenizers"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_context() -> mp.context.BaseContext:
    """Where rank processes come from: forks of a server that has imported ``PRELOAD``."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts (once per session)
    return ctx


def process_identity(pid: int) -> str | None:
    """``pid`` and its start time (``/proc/PID/stat`` field 22), or ``None`` once it has exited: gone, or a
    zombie waiting for its parent to reap it. The start time tells a reused PID apart."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None if fields[0] in "ZX" else f"{pid}:{fields[19]}"


def _next_task(tasks: "mp.Queue", owner: str | None) -> Any:
    """The next task, or ``None`` once the pool's owner (the test process) is gone. An owner killed outright
    (SIGKILL, a shell's ``timeout``, the OOM killer) cannot send the pool's ``None``, and the fork server
    does not end the workers either (each holds the server's liveness pipe open), so without this check a
    worker idles in ``tasks.get()`` forever, holding its memory (11 such workers once held 4.4 GiB here)."""
    while True:
        try:
            return tasks.get(timeout=OWNER_POLL_S)
        except queue.Empty:
            if owner is not None and process_identity(int(owner.split(":")[0])) != owner:
                return None


def _worker(
    rank: int, world_size: int, port: int, tasks: "mp.Queue", results: "mp.Queue", owner: str | None
) -> None:
    import torch
    import torch.distributed as dist

    # Its own process group (id = its pid), which the processes a test starts on the rank inherit:
    # ``RankPool.close`` kills the group, so a rank's children die with it (SIGKILL of the rank alone
    # leaves them running, reparented).
    os.setpgid(0, 0)

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    # Everything imported so far (torch, parallel3d) lives as long as the worker: out of the collector's
    # sight, each automatic collection walks only what the tests create (paired CPU seconds, session 47:
    # test_zero_parallel + test_moe_tp 36.3/36.0 -> 31.0/29.9 s).
    gc.freeze()
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        )
    except BaseException:
        results.put((-1, rank, "err", "init_process_group failed:\n" + traceback.format_exc()))
        return
    from torch.distributed import distributed_c10d as c10d

    results.put((-2, rank, "ready", None))
    while True:
        task = _next_task(tasks, owner)
        if task is None:
            break
        task_id, fn, args, kwargs = task
        before = set(c10d._world.pg_map.keys())
        try:
            out = ("ok", fn(rank, world_size, *args, **kwargs))
        except BaseException:
            out = ("err", traceback.format_exc())
        try:
            results.put((task_id, rank, *out))
        except BaseException:  # unpicklable result
            results.put((task_id, rank, "err", "result could not be pickled:\n" + traceback.format_exc()))
        # Destroy the groups this task created so long test runs do not pile up sockets.
        if out[0] == "ok":
            for pg in list(c10d._world.pg_map.keys()):
                if pg not in before and pg is not c10d.GroupMember.WORLD:
                    try:
                        dist.destroy_process_group(pg)
                    except Exception:
                        pass
    try:
        dist.destroy_process_group()
    except Exception:
        pass


class RankPool:
    """``world_size`` spawned worker processes sharing one gloo default group."""

    def __init__(self, world_size: int) -> None:
        ctx = rank_context()
        self.world_size = world_size
        self.results: mp.Queue = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        port = free_port()
        self.procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, port, self.tasks[r], self.results, process_identity(os.getpid())),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()
        self._ids = itertools.count()
        self._wait_ready(STARTUP_TIMEOUT_S)

    def _wait_ready(self, timeout: float) -> None:
        # Start-up (spawn + import torch + init_process_group) is not charged to a test's timeout.
        ready: set[int] = set()
        deadline = time.monotonic() + timeout
        while len(ready) < self.world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.close(kill=True)
                raise TimeoutError(f"ranks {sorted(set(range(self.world_size)) - ready)} did not start in {timeout:.0f}s")
            try:
                tid, rank, status, payload = self.results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                continue
            if tid == -1:
                self.close(kill=True)
                raise RuntimeError(f"rank {rank} failed to start:\n{payload}")
            ready.add(rank)

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, fn: Callable, args: tuple, kwargs: dict, timeout: float) -> list[Any]:
        task_id = next(self._ids)
        for q in self.tasks:
            q.put((task_id, fn, args, kwargs))
        done: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(done) < self.world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(self.world_size)) - set(done))
                self.close(kill=True)
                raise TimeoutError(
                    f"{fn.__name__}: ranks {missing} did not finish within {timeout:.0f}s "
                    f"(finished: {sorted(done)}); all ranks were killed"
                )
            try:
                tid, rank, status, payload = self.results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive() and r not in done]
                if dead:
                    codes = {r: self.procs[r].exitcode for r in dead}
                    raise RuntimeError(f"{fn.__name__}: rank(s) {dead} died (exit codes {codes})")
                continue
            if tid == -1 or status == "err":
                raise RuntimeError(f"{fn.__name__} failed on rank {rank}:\n{payload}")
            if tid == task_id:
                done[rank] = payload
        return [done[r] for r in range(self.world_size)]

    def close(self, kill: bool = False) -> None:
        if not kill:
            for q in self.tasks:
                try:
                    q.put(None)
                except Exception:
                    pass
            for p in self.procs:
                p.join(timeout=5)
        for p in self.procs:
            if kill or p.is_alive():  # a rank that has exited may have left children in its group
                _kill_group(p)
        for p in self.procs:
            p.join(timeout=5)


def _kill_group(proc: "mp.process.BaseProcess") -> None:
    """SIGKILL the rank's process group (``_worker`` made its pid the group id): the rank and the processes
    it started; SIGKILL, as a hung rank may ignore SIGTERM."""
    if proc.pid is None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # the group is empty (its members all exited)
        if proc.is_alive():  # not yet in its own group (killed before it ran setpgid)
            proc.kill()


_POOLS: dict[int, RankPool] = {}  # test-harness cache, not framework state


def _shutdown_pools() -> None:
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


atexit.register(_shutdown_pools)


def run_on_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 180.0, **kwargs: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks; see module doc."""
    fresh = os.environ.get("P3D_FRESH_RANKS") == "1"
    pool = None if fresh else _POOLS.pop(world_size, None)
    if pool is not None and not pool.alive():
        pool.close(kill=True)
        pool = None
    if pool is None:
        if len(_POOLS) >= WARM_WORLD_SIZES and not fresh:  # evict the least recently used
            oldest = next(iter(_POOLS))
            _POOLS.pop(oldest).close()
        pool = RankPool(world_size)
    if not fresh:
        _POOLS[world_size] = pool  # (re)inserted last: the dict runs from least to most recently used
    try:
        return pool.run(fn, args, kwargs, timeout)
    except BaseException:
        _POOLS.pop(world_size, None)
        pool.close(kill=True)
        raise
    finally:
        if fresh:
            pool.close()
