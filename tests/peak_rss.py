"""Peak memory measured from outside the code under test: the kernel's high-water mark of resident
memory (peak RSS) of fresh rank processes training through the real ``Trainer``.

    peaks = peak_rss_of_job(job_values(tokens, out_dir, model, parallel, train), world_size)

Every rank is a new process forked from the test harness's fork server, which imported
``parallel3d.trainer`` once (no import cost per rank, no state of earlier tests). It joins a
new gloo group, runs ``train`` and reports ``getrusage(RUSAGE_SELF).ru_maxrss``: the most resident
memory the process ever held, counted by the kernel over its whole life (start-up, every forward
and backward, optimizer steps), whatever the code tracks itself. Every rank starts from the same
fork image, so the difference between two jobs that differ in one option is what that option costs
at the peak. Measured noise between identical jobs: ~1 MiB.

``peak_allocated_of_job`` measures the same jobs by the tensor allocator instead: c10's CPU allocator
counts every tensor allocation and free of the rank while the profiler's memory tracking is on (the
whole of ``train``), and the largest running total is the peak of live tensor bytes. It is exact and
deterministic (no malloc heaps, interpreter or library pages, and no baseline job to subtract), so a
test can compare it with the estimator's total; it misses only buffers a library allocates outside
torch's allocator (gloo's transport staging), which RSS counts.

A rank that raises fails the call with its traceback; ranks still running after ``timeout``
seconds are killed and the call fails naming them.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import multiprocessing as mp
import os
import queue
import resource
import time
import traceback
from typing import Any

import numpy as np

from tests.harness import free_port, rank_context

# The end-of-run save fails at its first step (creating its directory) on every rank, before it
# copies anything (a blocking save: train.async_save=false, see job_values), and training ends as
# after any failed save: a save stages the whole state and would set the peak instead of training.
SKIP_SAVE_ENV = {"P3D_FAULT": "checkpoint.mkdir@*"}
# glibc's malloc serves blocks of >= 128 KiB from mmap but raises that threshold (up to 32 MiB) as
# such blocks are freed, after which freed memory may stay in its heaps: the peak RSS then depends
# on allocation history and thread timing (seen here: +-30 MiB between identical runs). A fixed
# threshold gives every tensor its own mapping, returned when the tensor is freed, so the resident
# memory follows the live tensors.
MMAP_THRESHOLD = 64 * 1024
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8  # mallopt parameters (malloc.h)
VOCAB = 512


def _track_live_memory() -> None:
    os.environ["P3D_HOST_HEAP"] = "leave"  # a split backward must not reset these (parallel3d.host_heap)
    libc = ctypes.CDLL("libc.so.6")
    for param, value in ((_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, 2 * MMAP_THRESHOLD),
                         (_M_ARENA_MAX, 1)):
        if libc.mallopt(param, value) != 1:
            raise RuntimeError(f"mallopt({param}, {value}) failed")


def _allocator_peak(prof: Any) -> int:
    """The largest running total of live CPU tensor bytes among a profiler run's allocation events."""
    from torch._C._profiler import _EventType

    peak, stack = 0, list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            peak = max(peak, node.extra_fields.total_allocated)
        stack.extend(node.children)
    return peak


def _rank(rank: int, world_size: int, port: int, values: dict[str, Any], env: dict[str, str],
          results: "mp.Queue", allocator: bool = False) -> None:
    try:
        _track_live_memory()
        import torch
        import torch.distributed as dist

        from parallel3d.config import job_from_dict, resolve
        from parallel3d.parallel_state import ParallelState
        from parallel3d.trainer import train

        torch.set_num_threads(1)
        torch.set_flush_denormal(True)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size), **env)
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=90))
        rj = resolve(job_from_dict(values), world_size)
        profiler: Any = contextlib.nullcontext()
        if allocator:
            from torch.profiler import ProfilerActivity, profile

            profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with open(os.devnull, "w") as null, contextlib.redirect_stdout(null), contextlib.redirect_stderr(null):
            with profiler:
                train(rj, ParallelState(rj.topology))
        if allocator:
            results.put((rank, "ok", _allocator_peak(profiler)))
        else:
            results.put((rank, "ok", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))  # KiB on Linux
    except BaseException:  # noqa: BLE001 - reported to the caller with the traceback
        results.put((rank, "err", traceback.format_exc()))


def peak_allocated_of_job(values: dict[str, Any], world_size: int, timeout: float = 180.0) -> list[int]:
    """Peak live tensor bytes of each rank of ``values``'s job, by the CPU allocator (module doc)."""
    return peak_rss_of_job(values, world_size, timeout, allocator=True)


def peak_rss_of_job(values: dict[str, Any], world_size: int, timeout: float = 180.0,
                    allocator: bool = False) -> list[int]:
    """Peak RSS in bytes of each rank of ``values``'s job, trained in fresh processes (module doc);
    ``allocator``: the allocator's peak of live tensor bytes instead (``peak_allocated_of_job``)."""
    ctx = rank_context()
    results: mp.Queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, world_size, port, values, SKIP_SAVE_ENV, results, allocator),
                         daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    peaks: dict[int, int] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(peaks) < world_size:
            try:
                rank, status, payload = results.get(timeout=1.0)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks {sorted(set(range(world_size)) - set(peaks))} did not finish "
                                       f"within {timeout:.0f}s") from None
                dead = [r for r, p in enumerate(procs) if r not in peaks and p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"rank(s) {dead} died (exit codes {[procs[r].exitcode for r in dead]})")
                continue
            if status == "err":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            peaks[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    return [peaks[r] for r in range(world_size)]


# ---- jobs to measure ---------------------------------------------------------------------------
def token_file(directory: str) -> str:
    """A random-token indexed dataset (no tokenizer to train): the prefix for ``data.paths``."""
    from parallel3d.data import write_indexed_dataset

    rng = np.random.default_rng(0)
    return write_indexed_dataset(os.path.join(directory, "tokens"), [rng.integers(0, VOCAB, 300) for _ in range(400)])


def job_values(tokens: str, out_dir: str, model: dict[str, Any], parallel: dict[str, Any],
               train: dict[str, Any]) -> dict[str, Any]:
    """A one-step GPT job on ``tokens`` (fp32, no dropout, no evaluation, blocking save: see SKIP_SAVE_ENV)."""
    gpt = dict(name="rss_gpt", arch="gpt", num_kv_heads=None, ffn_hidden_size=None, vocab_size=VOCAB,
               tie_embeddings=True, use_bias=True, dropout=0.0)
    return {"model": {**gpt, **model}, "parallel": parallel,
            "train": {"steps": 1, "seed": 3, "out_dir": out_dir, "save_every": 0, "async_save": False,
                      "device": "cpu", "eval_iters": 0, "precision": "fp32", **train},
            "optimizer": {"warmup_steps": 1},
            "data": {"source": "indexed", "paths": [tokens], "valid_fraction": 0.0},
            "logging": {"log_every": 1}}
