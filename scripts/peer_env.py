"""What the benchmarks and their DeepSpeed peer scripts share: DeepSpeed's own environment, a
peer run as a subprocess that prints one JSON line, and the peer's spawned ranks.

Standard library only: the peer scripts import it under DeepSpeed's interpreter, which has no
parallel3d installed (``scripts/`` is on their path as the running script's directory).
"""

from __future__ import annotations

import ctypes
import json
import multiprocessing as mp
import os
import queue
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deepspeed_python(venv: str, no_install: bool) -> str | None:
    """DeepSpeed's own interpreter, its venv created on first use (never the project's); None: skipped."""
    py = Path(venv) / "bin" / "python"
    if not py.exists():
        if no_install:
            print(f"[bench] no DeepSpeed environment at {venv} (--no-install): DeepSpeed skipped", flush=True)
            return None
        print(f"[bench] installing DeepSpeed into its own environment {venv} (once; torch==2.13.0 CPU)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", "torch==2.13.0",
                        "deepspeed"], check=True, env=dict(os.environ, DS_BUILD_OPS="0"))
    return str(py)


def remove_peer_shm(port: int, shm: str = "/dev/shm") -> list[str]:
    """Unlink the shared-memory all-reduce buffers (66 MiB a rank) that DeepSpeed's CPU collectives create as
    ``deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>`` and never remove: left behind by every peer
    run, they filled the 24 GiB tmpfs and got benchmark ranks OOM-killed. Only this run's port (its ranks
    have exited); returns the names removed."""
    removed = []
    for path in Path(shm).glob(f"deepspeed_allreduce_buffer_*_{port}_*"):
        path.unlink(missing_ok=True)
        removed.append(path.name)
    return removed


def run_peer(py: str, script: str, args: list[str], timeout: float = 1800) -> dict:
    """Run ``scripts/<script>`` under ``py`` (on CPU, one thread) and return the JSON it prints last.

    DeepSpeed JIT-builds a C++ op (its CPU shared-memory collectives) into ``TORCH_EXTENSIONS_DIR``
    at start-up, ~40 s. A build killed half-way leaves a ``lock`` file on which every later build
    in that directory waits forever, so each run gets a FRESH directory, seeded with a copy of
    the finished build kept beside the peer's interpreter (``<venv>/torch_extensions``, made
    from the first successful run's directory, never holding a lock): ninja finds it up to date."""
    port = free_port()
    cmd = [py, str(Path(__file__).resolve().parent / script), "--port", str(port), *args]
    kept = Path(os.path.abspath(py)).parent.parent / "torch_extensions"  # the venv, not its base python
    with tempfile.TemporaryDirectory(prefix="p3d-peer-ext-") as ext:
        if kept.is_dir():
            shutil.copytree(kept, ext, dirs_exist_ok=True, ignore=shutil.ignore_patterns("lock"))
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                  env=dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
                                           TORCH_EXTENSIONS_DIR=ext))
        finally:
            remove_peer_shm(port)
        if proc.returncode == 0 and not kept.exists() and any(Path(ext).iterdir()):
            partial = Path(tempfile.mkdtemp(prefix="torch_extensions.", dir=kept.parent))
            shutil.copytree(ext, partial, dirs_exist_ok=True, ignore=shutil.ignore_patterns("lock"))
            try:
                partial.rename(kept)  # atomic: a reader sees no copy or the whole one
            except OSError:  # another run kept its copy first
                shutil.rmtree(partial, ignore_errors=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        raise RuntimeError(f"DeepSpeed peer failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


class RankFailed(RuntimeError):
    """A spawned rank reported an error (``spawn_results``): which rank, and its traceback."""

    def __init__(self, rank: int, payload: str) -> None:
        super().__init__(f"rank {rank} failed:\n{payload}")
        self.rank, self.payload = rank, payload


def spawn_results(worker: Callable, world: int, port: int, args: Any) -> dict[int, Any]:
    """Spawn ``worker(rank, world, port, args, out)`` on ``world`` ranks; each puts ``(rank, "ok"|"err",
    payload)``. Returns every rank's payload by rank; on any rank's error kills the others and raises
    ``RankFailed``."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, port, args, out)) for r in range(world)]
    for proc in procs:
        proc.start()
    got = {}
    for _ in procs:
        rank, status, payload = out.get(timeout=1800)
        if status == "err":
            for proc in procs:
                proc.kill()
            raise RankFailed(rank, payload)
        got[rank] = payload
    for proc in procs:
        proc.join()
    return got


def rank_zero_result(worker: Callable, world: int, port: int, args: Any) -> Any:
    """``spawn_results``' rank 0 payload; on any rank's error prints ``{"error": ...}`` and exits 1 (the
    peer scripts' protocol with ``run_peer``)."""
    try:
        return spawn_results(worker, world, port, args)[0]
    except RankFailed as failed:
        print(json.dumps({"error": f"rank {failed.rank}: {failed.payload}"}))
        sys.exit(1)


def rank_zero_item(worker: Callable, world: int, *args: Any) -> Any:
    """Spawn ``worker(rank, world, port, *args, queue)`` on ``world`` ranks (a fresh 127.0.0.1 port) and
    return the one item rank 0 puts on ``queue``, after every rank has exited (the profiling scripts)."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, world, port, *args, queue)) for r in range(world)]
    for proc in procs:
        proc.start()
    item = queue.get()
    for proc in procs:
        proc.join()
    return item


# ---- peak memory of rank processes, read by their parent from /proc -----------------------------
# glibc's malloc keeps freed blocks below its (self-raising) mmap threshold in its heaps, so resident
# memory would depend on allocation history; a fixed 64 KiB threshold gives every tensor its own
# mapping, returned when the tensor dies, and the resident set follows the live tensors.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8


def track_live_memory() -> None:
    """Call first thing in a rank process whose peak RSS is measured (see above)."""
    libc = ctypes.CDLL("libc.so.6")
    for param, value in ((_M_MMAP_THRESHOLD, 64 * 1024), (_M_TRIM_THRESHOLD, 128 * 1024), (_M_ARENA_MAX, 1)):
        libc.mallopt(param, value)


def _status_kib(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {key} in /proc/{pid}/status")


class PeakGate:
    """Peak resident memory of rank processes around one call, read from OUTSIDE them.

    Ranks call ``gate.measure(fn)`` (all together, the same number of times); their parent
    runs ``observe(pids)`` once per call: it records each rank's resident set, resets the
    kernel's high-water mark (``/proc/<pid>/clear_refs``: 5), lets the ranks run ``fn``
    and reads the mark (``VmHWM``) before they go on. Returns, per call, the largest peak
    over ranks and the largest rise over the rank's own resident set before ``fn``."""

    def __init__(self, ctx: Any, world: int, timeout: float = 900.0) -> None:
        self.barrier = ctx.Barrier(world + 1)
        self.timeout = timeout

    def measure(self, fn: Callable[[], Any]) -> Any:
        self.barrier.wait(self.timeout)  # ready: the parent reads the resident set and resets the mark
        self.barrier.wait(self.timeout)
        result = fn()
        self.barrier.wait(self.timeout)  # done: the parent reads the mark before anything else runs
        self.barrier.wait(self.timeout)
        return result

    def abort(self) -> None:
        self.barrier.abort()

    def observe(self, pids: list[int]) -> dict:
        self.barrier.wait(self.timeout)
        base = [_status_kib(p, "VmRSS") for p in pids]
        for p in pids:
            with open(f"/proc/{p}/clear_refs", "w") as f:
                f.write("5")
        self.barrier.wait(self.timeout)
        self.barrier.wait(self.timeout)
        peak = [_status_kib(p, "VmHWM") for p in pids]
        self.barrier.wait(self.timeout)
        return {"peak_rss_bytes": 1024 * max(peak), "peak_over_base_bytes": 1024 * max(a - b for a, b in zip(peak, base))}


def _rank_main(worker: Callable, rank: int, world: int, port: int, args: Any, out: Any, gate: PeakGate) -> None:
    """A rank process: memory tracking, one thread, the rendezvous environment; then ``worker(rank, world,
    args, gate)`` (which creates its process group) and its result, or its traceback, put on ``out``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_SIZE=str(world), OMP_NUM_THREADS="1")
    try:
        track_live_memory()
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        torch.set_flush_denormal(True)
        out.put((rank, "ok", worker(rank, world, args, gate)))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        gate.abort()
        out.put((rank, "err", traceback.format_exc()))


def run_ranks(worker: Callable, world: int, port: int, args: Any, measures: int = 0, timeout: float = 1800) -> tuple:
    """Spawn ``worker(rank, world, args, gate) -> payload`` on ``world`` ranks (``_rank_main``); each calls
    ``gate.measure`` ``measures`` times. Returns rank 0's payload and the ``measures`` observations of
    ``PeakGate``; raises with the failing rank's traceback."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    gate = PeakGate(ctx, world)
    procs = [ctx.Process(target=_rank_main, args=(worker, r, world, port, args, out, gate)) for r in range(world)]
    for proc in procs:
        proc.start()
    observed: list = []
    failure: list = []

    def watch() -> None:
        try:
            for _ in range(measures):
                observed.append(gate.observe([p.pid for p in procs]))
        except BaseException as exc:  # noqa: BLE001 - a broken barrier: a rank failed, reported below
            failure.append(exc)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    got = {}
    try:
        while len(got) < world:
            try:
                rank, status, payload = out.get(timeout=timeout)
            except queue.Empty:
                raise RuntimeError(f"ranks {sorted(set(range(world)) - set(got))} gave no result in {timeout:.0f}s")
            if status == "err":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            got[rank] = payload
        watcher.join(timeout=60)
        if failure or len(observed) != measures:
            raise RuntimeError(f"memory observation failed: {failure or 'incomplete'}")
    finally:
        gate.abort()
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    return got[0], observed


def cpu_seconds() -> float:
    """User + system CPU seconds of this process so far (every thread: compute, gloo's, allocator's)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def timed_steps(step: Callable[[], Any], steps: int, warmup: int,
                before: Callable[[], None] | None = None, cpu_ms: list[float] | None = None) -> list[float]:
    """Wall ms of each of ``steps`` calls of ``step`` after ``warmup`` untimed ones, the slowest rank's
    (a barrier starts each; ``before`` runs outside the timing, e.g. to clear gradients).

    ``cpu_ms``: gets each step's CPU ms (user + sys, getrusage) averaged over the ranks: unlike wall time it
    barely moves with other jobs on the machine (time a rank waits descheduled or blocked is not counted)."""
    import torch
    import torch.distributed as dist

    times = []
    for i in range(warmup + steps):
        if before is not None:
            before()
        dist.barrier()
        cpu0 = cpu_seconds()
        start = time.perf_counter()
        step()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        cpu = torch.tensor([cpu_seconds() - cpu0], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        dist.all_reduce(cpu, op=dist.ReduceOp.SUM)
        if i >= warmup:
            times.append(elapsed.item() * 1e3)
            if cpu_ms is not None:
                cpu_ms.append(cpu.item() * 1e3 / dist.get_world_size())
    return times


def write_results(args: Any, results: list[dict], targets: Any, dim: str) -> None:
    """Write the benchmark's JSON to ``args.out`` and exit 1 after naming every row whose fingerprint
    differs from the reference by more than ``args.tolerance`` (``dim``: "cp" or "ep")."""
    import datetime

    import torch

    bad = [(res[dim], r["impl"], r["mismatch"]) for res in results for r in res["rows"]
           if r["mismatch"] > args.tolerance]
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(args).items() if k not in ("out", "peer_venv")}
    path.write_text(json.dumps({"config": config, "cpu_count": os.cpu_count(), "torch": torch.__version__,
                                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                                "load_average": os.getloadavg(), "results": results, "targets": targets,
                                "mismatches": bad}, indent=1))
    print(f"wrote {path}")
    if bad:
        for size, impl, m in bad:
            print(f"MISMATCH {dim}={size} {impl}: fingerprint difference {m:.2e} > tolerance {args.tolerance:.0e}")
        sys.exit(1)
