"""Where the ring's blocked time goes: a late neighbour, or a transfer compute did not cover.

``TimedRing`` wraps a ring ``CPGroup``: every ``ring_exchange`` records, on this rank's
monotonic clock, when it was posted and when its ``wait`` started and returned. The ranks
of one machine share that clock (``time.perf_counter`` is ``CLOCK_MONOTONIC`` on Linux),
so after ``gather_events`` every rank can line its waits up with its neighbours' posts.

Every rank of a ring posts the same sequence of exchanges, so exchange ``e`` of rank ``i``
receives what exchange ``e`` of rank ``i - 1`` sends, and sends into the receive exchange
``e`` of rank ``i + 1`` posts. Neither can move a byte before both are posted: ``ready =
max(post[i-1][e], post[i+1][e])``. A wait on ``[start, end]`` then splits in two:

- ``transfer`` = ``max(0, end - max(start, ready))``: blocked after both neighbours had
  posted, the part of the transfer that this rank's compute did not cover (what the
  overlap target is about);
- ``late`` = the rest: blocked while a neighbour had not yet reached this exchange (it ran
  behind: on an oversubscribed machine, mostly because the OS had not scheduled it).

Invariant: ``late + transfer`` is exactly the time blocked in the waits.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from parallel3d.context_parallel.group_comm import CPGroup


class TimedRing:
    """A ring group whose exchanges record ``(posted, wait start, wait end)`` in ``events`` (and the
    blocked seconds in ``blocked_s``). Everything else is the wrapped ``CPGroup``."""

    def __init__(self, group: CPGroup) -> None:
        self._group, self.blocked_s = group, 0.0
        self.events: list[list[float]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._group, name)

    def ring_exchange(self, sends, recvs):
        work, timer = self._group.ring_exchange(sends, recvs), self
        # posted (every op of the batch in flight), wait start, wait end, then this thread's CPU seconds at
        # the post and at the wait: between them runs the compute the transfer hides behind.
        record = [time.perf_counter(), float("nan"), float("nan"), time.thread_time(), float("nan")]
        self.events.append(record)

        class _Handle:
            def wait(self, timeout=None):
                record[1], record[4] = time.perf_counter(), time.thread_time()
                try:
                    return work.wait()
                finally:
                    record[2] = time.perf_counter()
                    timer.blocked_s += record[2] - record[1]

        return _Handle()


def gather_events(group: CPGroup, events: list[list[float]]) -> torch.Tensor:
    """``[ranks, exchanges, 5]`` seconds: every member's events (all post the same number)."""
    mine = torch.tensor(events, dtype=torch.float64).reshape(-1, 5)
    if group.size == 1:
        return mine[None]
    every = [torch.empty_like(mine) for _ in range(group.size)]
    dist.all_gather(every, mine, group=group.group)
    return torch.stack(every)


def split_blocked(events: torch.Tensor, per_call: int, warmup: int) -> dict[str, float]:
    """``late_ms`` and ``transfer_ms`` per call (median over the calls after ``warmup``, the largest
    over ranks), from ``gather_events``' tensor; ``per_call`` exchanges make one call.

    Why a neighbour was late: ``compute_cpu_ms`` / ``compute_wall_ms`` are the CPU and wall time
    of the compute between each post and its wait, per call (median over calls), as
    ``[smallest, largest]`` over ranks. Equal CPU on every rank (the load balance) with unequal
    wall is a rank the OS did not run while its neighbour waited."""
    n, total, _ = events.shape
    posted, start, end, cpu_posted, cpu_start = events.unbind(-1)
    ready = torch.maximum(posted.roll(1, dims=0), posted.roll(-1, dims=0))  # members i-1 and i+1
    transfer = (end - torch.maximum(start, ready)).clamp(min=0)
    late = (end - start) - transfer
    calls = total // per_call

    def per_rank_medians(x: torch.Tensor) -> list[float]:
        sums = x[:, : calls * per_call].reshape(n, calls, per_call).sum(-1)[:, warmup:]
        return [statistics.median(row.tolist()) * 1e3 for row in sums]

    cpu, wall = per_rank_medians(cpu_start - cpu_posted), per_rank_medians(start - posted)
    return {"late_ms": max(per_rank_medians(late)), "transfer_ms": max(per_rank_medians(transfer)),
            "compute_cpu_ms": [min(cpu), max(cpu)], "compute_wall_ms": [min(wall), max(wall)]}
