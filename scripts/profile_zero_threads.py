"""Per-thread CPU of ``bench_zero``'s methods: where a step's process CPU goes (main thread, gloo's threads).

    python scripts/profile_zero_threads.py [--dp 2] [--steps 30] [--reps 4] [--methods ddp zero0]

Runs ``bench_zero.Runner`` steps (forward, backward, norm, update, ``zero_grad``: the benchmark's timed work plus
its untimed memory accounting and barrier) in blocks of ``steps`` per method, ``reps`` blocks each, methods
alternating, and reads every thread's run time from ``/proc/self/task/*/schedstat`` (ns, Linux) before and after
each block. Prints rank 0's CPU ms per step per thread (name; the main thread marked) and the process total, per
method. Each process group has its own gloo threads (a TCP loop and two run loops), so the table shows which
group's collectives cost what; the barrier ``Runner.step`` runs before each step is on the default group.
"""

from __future__ import annotations

import datetime
import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_zero import profile_parser, warm_runners  # noqa: E402
from peer_env import rank_zero_item  # noqa: E402


def _threads() -> dict[tuple[int, str], int]:
    """(thread id, name) -> ns run so far, for every thread of this process."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        out[(int(tid), name)] = ns
    return out


def _worker(rank: int, n: int, port: int, steps: int, reps: int, methods: list[str], queue) -> None:
    runners = warm_runners(rank, n, port, methods, "/nonexistent")
    spent: dict[str, dict[tuple[int, str], int]] = {m: {} for m in methods}
    for _ in range(reps):
        for m, runner in runners.items():
            before = _threads()
            for _ in range(steps):
                runner.step()
            for key, ns in _threads().items():
                spent[m][key] = spent[m].get(key, 0) + ns - before.get(key, 0)
    if rank == 0:
        queue.put((os.getpid(), {m: {k: v / (reps * steps) / 1e6 for k, v in s.items()} for m, s in spent.items()}))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = profile_parser(__doc__)
    parser.add_argument("--reps", type=int, default=4)
    args = parser.parse_args()
    main_tid, ms = rank_zero_item(_worker, args.dp, args.steps, args.reps, args.methods)
    print(f"dp {args.dp}, {args.reps} x {args.steps} steps per method, rank 0, CPU ms per step per thread "
          f"({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, load {os.getloadavg()[0]:.1f})")
    keys = sorted(set().union(*(set(v) for v in ms.values())))
    print(f"{'thread':>8} {'name':<16} {'':5}" + "".join(f"{m:>10}" for m in args.methods))
    for key in keys:
        row = [ms[m].get(key, 0.0) for m in args.methods]
        if max(row) >= 0.005:
            print(f"{key[0]:>8} {key[1]:<16} {'main' if key[0] == main_tid else '':5}"
                  + "".join(f"{v:>10.3f}" for v in row))
    print(f"{'total':<31}" + "".join(f"{sum(ms[m].values()):>10.3f}" for m in args.methods))


if __name__ == "__main__":
    main()
