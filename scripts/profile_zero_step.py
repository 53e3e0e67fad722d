"""Where one data-parallel step spends its CPU: ``bench_zero``'s methods phase by phase, on gloo ranks.

    python scripts/profile_zero_step.py [--dp 2] [--steps 30] [--methods ddp zero0]

Runs ``bench_zero.Runner`` (same model, batch, buckets, AdamW and grad-norm work as the benchmark)
and splits each step into forward, backward, ``norm`` (DDP: torch's ``get_total_norm``; ours:
``GradSync.finalize``, the wait for the last reductions: our norm is inside ``step``), ``step``
(the update; ours also the norm) and ``zero_grad``. Per phase, the median over ``steps`` of rank 0's
main-thread CPU ms (``time.thread_time``: what this rank's Python and kernels cost, whatever else
runs on the machine) and its process CPU ms (getrusage: gloo's threads included). Then the aten
and c10d calls per step by the torch profiler (counts only: its times are not load-robust).
"""

from __future__ import annotations

import datetime
import os
import statistics
import sys
import time
from collections import defaultdict

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_zero import Runner, _total_norm, profile_parser, warm_runners  # noqa: E402
from peer_env import cpu_seconds, rank_zero_item  # noqa: E402

PHASES = ("forward", "backward", "norm", "step", "zero_grad")
COUNTED = ("c10d::allreduce_", "aten::copy_", "aten::add_", "aten::mul_", "aten::mul", "aten::fill_", "aten::zero_",
           "aten::dot", "aten::linalg_vector_norm", "aten::_fused_adamw_", "aten::_foreach_mul_")


def _one_step(runner: Runner, thread: dict, proc: dict) -> None:
    marks = [(time.thread_time(), cpu_seconds())]

    def mark() -> None:
        marks.append((time.thread_time(), cpu_seconds()))

    loss = runner.model(runner.x).float().pow(2).mean()
    mark()
    loss.backward()
    mark()
    if runner.zero is None:
        _total_norm(runner.model)
        mark()
        runner.opt.step()
    else:
        runner.zero.grad_sync.finalize()
        mark()
        runner.opt.step()
    mark()
    runner.opt.zero_grad()
    mark()
    for k, phase in enumerate(PHASES):
        thread[phase].append(1e3 * (marks[k + 1][0] - marks[k][0]))
        proc[phase].append(1e3 * (marks[k + 1][1] - marks[k][1]))


def _worker(rank: int, n: int, port: int, steps: int, methods: list[str], queue) -> None:
    runners = warm_runners(rank, n, port, methods, "/nonexistent")
    thread = {m: defaultdict(list) for m in methods}
    proc = {m: defaultdict(list) for m in methods}
    for _ in range(steps):  # methods interleaved step by step
        for m, runner in runners.items():
            dist.barrier()
            _one_step(runner, thread[m], proc[m])
    counts = {}
    for m, runner in runners.items():
        dist.barrier()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            runner.step()
        counts[m] = {e.key: e.count for e in prof.key_averages()}
    if rank == 0:
        queue.put({m: {"thread": {p: statistics.median(v) for p, v in thread[m].items()},
                       "process": {p: statistics.median(v) for p, v in proc[m].items()},
                       "counts": counts[m]} for m in methods})
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = profile_parser(__doc__)
    args = parser.parse_args()
    out = rank_zero_item(_worker, args.dp, args.steps, args.methods)
    print(f"dp {args.dp}, {args.steps} steps per method, rank 0, median ms per step "
          f"({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, load {os.getloadavg()[0]:.1f})")
    print(f"{'phase':<12}" + "".join(f"{m + ' thread':>14}{m + ' process':>15}" for m in args.methods))
    for phase in PHASES:
        print(f"{phase:<12}" + "".join(f"{out[m]['thread'][phase]:>14.2f}{out[m]['process'][phase]:>15.2f}"
                                       for m in args.methods))
    totals = {m: (sum(out[m]["thread"].values()), sum(out[m]["process"].values())) for m in args.methods}
    print(f"{'sum':<12}" + "".join(f"{totals[m][0]:>14.2f}{totals[m][1]:>15.2f}" for m in args.methods))
    print(f"\n{'calls per step':<26}" + "".join(f"{m:>10}" for m in args.methods))
    for key in COUNTED:
        print(f"{key:<26}" + "".join(f"{out[m]['counts'].get(key, 0):>10}" for m in args.methods))


if __name__ == "__main__":
    main()
