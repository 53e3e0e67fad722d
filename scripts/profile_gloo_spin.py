"""Where gloo's threads spend a step's CPU: the TCP loop's wake-ups and its busy-wait episodes, per method.

    python scripts/profile_gloo_spin.py [--dp 2] [--steps 30] [--reps 4] [--methods ddp zero0]

Needs Linux ``perf`` allowed to record tracepoints (root, or ``kernel.perf_event_paranoid`` <= 1) on x86-64 (the
syscall numbers below). It runs itself under ``perf record -k CLOCK_MONOTONIC -e raw_syscalls:sys_exit -e
sched:sched_switch``: the ranks run ``bench_zero.Runner`` steps in blocks of ``steps`` per method, methods
alternating, ``reps`` blocks each (as ``profile_zero_threads``), and write each block's CLOCK_MONOTONIC span and
their thread names; then every traced event is assigned to its rank, thread and method block.

Why: a gloo process group's ``gloo_tcp_loop`` thread waits in a level-triggered ``epoll_wait`` and handles a
socket's events under the pair's mutex, which it only *tries* to take (``Pair::handleEvents``); when another thread
holds it (a ``pt_gloo_runloop`` thread posting a send or receive notification) it returns and ``epoll_wait`` reports
the same event at once. If that holder has been preempted (a ``writev`` to the peer wakes the peer's thread on the
same core), the loop spins until the holder runs again: up to a scheduler slice, on a busy 2-core machine.
Printed per rank, method and thread: ``ready``, ``epoll_wait`` returns with events per step; ``spins``, episodes of
more than ``SPIN_RUN`` such returns with no read or write between them, their returns and milliseconds per step;
``recv`` / ``writev``, the data and notification syscalls per step; ``preempted``, switches away while runnable.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import MappingProxyType

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_zero import profile_parser, warm_runners  # noqa: E402
from peer_env import rank_zero_item  # noqa: E402

SYSCALLS = MappingProxyType({232: "epoll_wait", 281: "epoll_wait", 45: "recv", 20: "writev"})  # x86-64 numbers
SPIN_RUN = 3  # more consecutive ready returns than this, with no I/O between: a busy-wait episode
EVENT = re.compile(r"\s*(\d+)/(\d+)\s+([\d.]+):\s+(\S+):\s*(.*)")


def _worker(rank: int, n: int, port: int, steps: int, reps: int, methods: list[str], out_dir: str, queue) -> None:
    runners = warm_runners(rank, n, port, methods, "/nonexistent")
    blocks = []
    for _ in range(reps):
        for m, runner in runners.items():
            t0 = time.clock_gettime(time.CLOCK_MONOTONIC)
            for _ in range(steps):
                runner.step()
            blocks.append((m, t0, time.clock_gettime(time.CLOCK_MONOTONIC)))
    names = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            names[tid] = f.read().strip()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"pid": os.getpid(), "blocks": blocks, "names": names}, f)
    if rank == 0:
        queue.put(None)
    dist.barrier()
    dist.destroy_process_group()


class _Tally:
    """Per (rank, method, thread): counters, and the open run of ready ``epoll_wait`` returns per thread."""

    def __init__(self) -> None:
        self.count: dict[tuple, collections.Counter] = collections.defaultdict(collections.Counter)
        self.run: dict[str, tuple[int, float]] = {}

    def syscall(self, key: tuple, tid: str, t: float, name: str, ret: int) -> None:
        c = self.count[key]
        if name == "epoll_wait" and ret > 0:
            c["ready"] += 1
            n, start = self.run.get(tid, (0, t))
            self.run[tid] = (n + 1, start if n else t)
            return
        n, start = self.run.pop(tid, (0, t))
        if n > SPIN_RUN:
            c["spins"] += 1
            c["spin_calls"] += n
            c["spin_ms"] += 1e3 * (t - start)
        if name in ("recv", "writev") and ret >= 0:
            c[name] += 1


def _analyse(perf_data: str, ranks: list[dict]) -> _Tally:
    by_pid = {r["pid"]: (k, r) for k, r in enumerate(ranks)}
    tally = _Tally()
    script = subprocess.Popen(["perf", "script", "-i", perf_data, "-F", "pid,tid,time,event,trace"],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in script.stdout:
        m = EVENT.match(line)
        if not m or int(m[1]) not in by_pid:
            continue
        k, r = by_pid[int(m[1])]
        tid, t, event, trace = m[2], float(m[3]), m[4], m[5]
        method = next((b[0] for b in r["blocks"] if b[1] <= t <= b[2]), None)
        if method is None:
            continue
        key = (k, method, r["names"].get(tid, "?"), tid)
        if event == "raw_syscalls:sys_exit":
            nr = re.search(r"NR (\d+) = (-?\d+)", trace)
            if nr and int(nr[1]) in SYSCALLS:
                tally.syscall(key, tid, t, SYSCALLS[int(nr[1])], int(nr[2]))
        elif event == "sched:sched_switch" and "prev_state=R " in trace:
            tally.count[key]["preempted"] += 1
    script.wait()
    return tally


def main() -> None:
    parser = profile_parser(__doc__)
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_out:  # the traced run
        rank_zero_item(_worker, args.dp, args.steps, args.reps, args.methods, args.child_out)
        return
    if shutil.which("perf") is None:
        sys.exit("profile_gloo_spin: needs Linux perf (not found on PATH)")
    with tempfile.TemporaryDirectory(prefix="p3d-gloo-spin-") as tmp:
        data = os.path.join(tmp, "perf.data")
        child = [sys.executable, os.path.abspath(__file__), "--dp", str(args.dp), "--steps", str(args.steps),
                 "--reps", str(args.reps), "--methods", *args.methods, "--child-out", tmp]
        subprocess.run(["perf", "record", "-q", "-k", "CLOCK_MONOTONIC", "-e", "raw_syscalls:sys_exit",
                        "-e", "sched:sched_switch", "-o", data, "--", *child], check=True)
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(args.dp)]
        tally = _analyse(data, ranks)
    per_step = args.reps * args.steps
    print(f"dp {args.dp}, {args.reps} x {args.steps} steps per method, per step per thread "
          f"({time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, load {os.getloadavg()[0]:.1f})")
    cols = ("ready", "spins", "spin_calls", "spin_ms", "recv", "writev", "preempted")
    print(f"{'rank':>4} {'method':<8} {'thread':<16} {'tid':>8}" + "".join(f"{c:>11}" for c in cols))
    for (k, method, name, tid), c in sorted(tally.count.items()):
        if name.startswith(("gloo", "pt_gloo")) and c["ready"] + c["writev"] + c["recv"] >= per_step:
            print(f"{k:>4} {method:<8} {name:<16} {tid:>8}" + "".join(f"{c[x] / per_step:>11.2f}" for x in cols))
    for k in range(args.dp):
        for method in args.methods:
            loops = [c for (kk, m, name, _), c in tally.count.items() if kk == k and m == method
                     and name == "gloo_tcp_loop"]
            print(f"rank {k} {method}: every TCP loop, spin ms per step "
                  f"{sum(c['spin_ms'] for c in loops) / per_step:.3f}, ready returns {sum(c['ready'] for c in loops) / per_step:.1f}")


if __name__ == "__main__":
    main()
