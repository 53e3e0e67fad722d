"""Micro-benchmarks of context-parallel attention (called on every rank of a cp group).

- ``bench_variants``: median forward + backward time of one attention layer per
  ``cp_comm`` variant, on this rank's share of a ``[batch, seq_len]`` sequence.
- ``bench_ring_overlap``: how much of the ring's K/V traffic hides behind compute, from
  three timings of the ring forward: communication alone (the ``cp - 1`` exchanges with no
  compute), compute alone (the same blocks against local K/V, no exchange) and the real,
  overlapped ring. ``hidden = (comm + compute - overlapped) / comm``, clipped to [0, 1]: the
  end-to-end gain, which also charges the compute any slow-down the background transfer
  causes (on CPU the transfer is itself CPU work of gloo's thread), but is the difference of
  two large noisy times when the transfer is small. ``hidden_waits = 1 - exposed / comm``,
  where ``exposed_wait_ms`` is the time the overlapped ring actually blocked in its waits: a
  direct, low-noise reading of the communication compute did not cover.
  ``ring_timeline`` splits that blocked time: ``late_wait_ms`` (a neighbour had not yet
  posted the exchange: it ran behind) and ``transfer_wait_ms`` (blocked after both
  neighbours had posted); ``hidden_transfer = 1 - transfer_wait / comm``. ``compute_cpu_ms``
  / ``compute_wall_ms`` ([least, most] over ranks) say why a neighbour ran behind, and
  ``cores_busy_*`` (CPU of every rank / (wall x cores)) whether a rank's blocked time left
  a core idle at all (on an oversubscribed machine another rank runs meanwhile).

Times are the median over ``steps`` repetitions (after ``warmup``) of each repetition's slowest
rank, each repetition started together (a barrier): the DeepSpeed peer's statistic. The caller owns process groups
and prints or stores the dicts (``scripts/bench_cp.py``).
"""

from __future__ import annotations

import os
import resource
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist

from kernels.attention_math import compute_dtype, default_scale
from parallel3d.context_parallel.attention import context_parallel_attention
from parallel3d.context_parallel.block_compute import BlockAttention, resolve_attention_backend
from parallel3d.context_parallel.blockwise import attend, heads_first, output_accumulators, plan_shares
from parallel3d.context_parallel.group_comm import CPGroup
from parallel3d.context_parallel.load_balance import rank_segments
from parallel3d.context_parallel.ring import RingAttention
from parallel3d.context_parallel.ring_timeline import TimedRing, gather_events, split_blocked


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process (every thread: compute, gloo's, the allocator's)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _slowest_median_ms(fn: Callable[[], None], group: CPGroup, steps: int, warmup: int,
                       cpu_ms: list[float] | None = None) -> float:
    """The median over steps of each step's slowest rank (wall ms); ``cpu_ms`` gets the median over steps
    of each step's CPU ms averaged over the ranks (time a rank spends descheduled or blocked in a
    collective is not CPU time, so on a shared machine it moves far less than wall time with other jobs).
    The same statistic as the DeepSpeed peer's (``scripts/peer_env.timed_steps``), so their ratio compares
    like with like: a median of per-rank medians would be lower than this whenever the ranks' slow steps
    differ."""
    times, cpu = [], []
    for i in range(warmup + steps):
        if group.size > 1:
            dist.barrier(group=group.group)
        cpu0 = _cpu_seconds()
        start = time.perf_counter()
        fn()
        step = torch.tensor([time.perf_counter() - start, _cpu_seconds() - cpu0], dtype=torch.float64)
        if group.size > 1:  # outside the timed region
            dist.all_reduce(step[:1], op=dist.ReduceOp.MAX, group=group.group)
            dist.all_reduce(step[1:], op=dist.ReduceOp.SUM, group=group.group)
        if i >= warmup:
            times.append(float(step[0]) * 1e3)
            cpu.append(float(step[1]) * 1e3 / group.size)
    if cpu_ms is not None:
        cpu_ms.append(statistics.median(cpu))
    return statistics.median(times)


def _share(cp_group: CPGroup, batch: int, seq_len: int, heads: int, head_dim: int, dtype: torch.dtype,
           seed: int, grad: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + cp_group.index)
    x = torch.randn(batch, seq_len // cp_group.size, heads, head_dim, generator=g).to(dtype)
    return x.requires_grad_(grad)


def bench_variants(
    cp_group: CPGroup, *, batch: int, seq_len: int, q_heads: int, kv_heads: int, head_dim: int,
    variants: dict[str, dict], dtype: torch.dtype = torch.float32, backend: str = "auto",
    steps: int = 5, warmup: int = 1, document_ids: torch.Tensor | None = None,
    cpu_ms: dict[str, float] | None = None,
) -> dict[str, float]:
    """``{label: ms}`` per forward + backward step; ``variants`` maps a label to the keyword
    arguments of ``context_parallel_attention`` (``cp_comm`` and, for a2a+p2p, its sub-groups).
    ``cpu_ms`` (optional) gets ``{label: median CPU ms per step and rank}``."""
    q = _share(cp_group, batch, seq_len, q_heads, head_dim, dtype, 1, True)
    k = _share(cp_group, batch, seq_len, kv_heads, head_dim, dtype, 2, True)
    v = _share(cp_group, batch, seq_len, kv_heads, head_dim, dtype, 3, True)
    dout = torch.randn_like(q)
    results = {}
    for label, kwargs in variants.items():
        def step() -> None:
            out = context_parallel_attention(q, k, v, cp_group=cp_group, document_ids=document_ids,
                                             backend=backend, **kwargs)
            torch.autograd.grad(out, (q, k, v), dout)

        cpu: list[float] = []
        results[label] = _slowest_median_ms(step, cp_group, steps, warmup, cpu)
        if cpu_ms is not None:
            cpu_ms[label] = cpu[0]
    return results


def bench_ring_overlap(
    cp_group: CPGroup, *, batch: int, seq_len: int, q_heads: int, kv_heads: int, head_dim: int,
    dtype: torch.dtype = torch.float32, backend: str = "auto", steps: int = 5, warmup: int = 1,
) -> dict[str, float]:
    """``comm_ms``, ``compute_ms``, ``overlapped_ms``, ``hidden``, ``exposed_wait_ms`` and ``hidden_waits``
    of the ring forward; ``backward_comm_ms`` / ``backward_exposed_wait_ms`` / ``backward_hidden_waits``
    the same reading of its backward (K/V again and the dK/dV partials travelling back)."""
    n = cp_group.size
    q = _share(cp_group, batch, seq_len, q_heads, head_dim, dtype, 1, False)
    k = _share(cp_group, batch, seq_len, kv_heads, head_dim, dtype, 2, False)
    v = _share(cp_group, batch, seq_len, kv_heads, head_dim, dtype, 3, False)
    engine = BlockAttention(resolve_attention_backend(backend, q), default_scale(head_dim))
    members = [rank_segments(seq_len, n, j) for j in range(n)]
    plans = plan_shares(engine, members[cp_group.index], members)

    def comm_only() -> None:
        kv = [k, v]
        for t in range(n - 1):
            receive = [torch.empty_like(k), torch.empty_like(v)]
            cp_group.ring_exchange(kv, receive).wait()
            kv = receive

    def compute_only() -> None:
        acc_out, acc_lse = output_accumulators(q)
        merged: set[tuple[int, int]] = set()
        for t in range(n):  # the blocks of every step, against local K/V of the same shape
            attend(engine, heads_first(q), heads_first(k), heads_first(v), plans[(cp_group.index - t) % n],
                   acc_out, acc_lse, merged)

    timed = TimedRing(cp_group)
    blocked: list[float] = []

    def overlapped() -> None:
        timed.blocked_s = 0.0
        RingAttention.apply(q, k, v, timed, members[cp_group.index], members, engine)
        blocked.append(timed.blocked_s)

    def comm_only_backward() -> None:
        # What the backward moves: K/V again (n - 1 hops) and fp32 dK/dV partials (n hops),
        # posted together per step as the ring backward does.
        kv = [k, v]
        dkv = [torch.zeros(k.shape, dtype=compute_dtype(dtype)), torch.zeros(v.shape, dtype=compute_dtype(dtype))]
        for t in range(n):
            pending = []
            if t < n - 1:
                receive = [torch.empty_like(k), torch.empty_like(v)]
                pending.append(cp_group.ring_exchange(kv, receive))
            incoming = [torch.empty_like(b) for b in dkv]
            pending.append(cp_group.ring_exchange(dkv, incoming))
            for work in pending:
                work.wait()
            kv, dkv = (receive if t < n - 1 else kv), incoming

    grads_in = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    dout = torch.randn_like(q)
    blocked_backward: list[float] = []
    timed_bwd = TimedRing(cp_group)

    def overlapped_backward() -> None:
        forward_events = len(timed_bwd.events)
        out = RingAttention.apply(*grads_in, timed_bwd, members[cp_group.index], members, engine)
        del timed_bwd.events[forward_events:]  # only the backward's exchanges are split below
        timed_bwd.blocked_s = 0.0
        torch.autograd.grad(out, grads_in, dout)
        blocked_backward.append(timed_bwd.blocked_s)

    def slowest(values: list[float]) -> float:
        x = torch.tensor([statistics.median(values[warmup:]) * 1e3], dtype=torch.float64)
        if n > 1:
            dist.all_reduce(x, op=dist.ReduceOp.MAX, group=cp_group.group)
        return float(x)

    def fraction(exposed: float, comm: float) -> float:
        return min(1.0, max(0.0, 1.0 - exposed / comm)) if comm > 0 else 0.0

    comm = _slowest_median_ms(comm_only, cp_group, steps, warmup) if n > 1 else 0.0
    cpu_compute: list[float] = []
    compute = _slowest_median_ms(compute_only, cp_group, steps, warmup, cpu_compute)
    cpu_both: list[float] = []
    both = _slowest_median_ms(overlapped, cp_group, steps, warmup, cpu_both)
    exposed = slowest(blocked)
    split = split_blocked(gather_events(cp_group, timed.events), n - 1, warmup) if n > 1 else {}
    comm_bwd = _slowest_median_ms(comm_only_backward, cp_group, steps, warmup) if n > 1 else 0.0
    _slowest_median_ms(overlapped_backward, cp_group, steps, warmup)
    exposed_bwd = slowest(blocked_backward)
    split_bwd = split_blocked(gather_events(cp_group, timed_bwd.events), 2 * n - 1, warmup) if n > 1 else {}
    cores = _cores_in_use(cp_group)
    hidden = min(1.0, max(0.0, (comm + compute - both) / comm)) if comm > 0 else 0.0
    return {"comm_ms": comm, "compute_ms": compute, "overlapped_ms": both, "hidden": hidden,
            "exposed_wait_ms": exposed, "hidden_waits": fraction(exposed, comm),
            "late_wait_ms": split.get("late_ms", 0.0), "transfer_wait_ms": split.get("transfer_ms", 0.0),
            "hidden_transfer": fraction(split.get("transfer_ms", 0.0), comm),
            "compute_cpu_ms": split.get("compute_cpu_ms", [0.0, 0.0]),
            "compute_wall_ms": split.get("compute_wall_ms", [0.0, 0.0]),
            "cores": cores, "cores_busy_compute": cpu_compute[0] * n / (compute * cores),
            "cores_busy_overlapped": cpu_both[0] * n / (both * cores),
            "backward_comm_ms": comm_bwd, "backward_exposed_wait_ms": exposed_bwd,
            "backward_hidden_waits": fraction(exposed_bwd, comm_bwd),
            "backward_late_wait_ms": split_bwd.get("late_ms", 0.0),
            "backward_transfer_wait_ms": split_bwd.get("transfer_ms", 0.0),
            "backward_hidden_transfer": fraction(split_bwd.get("transfer_ms", 0.0), comm_bwd)}


def _cores_in_use(group: CPGroup) -> int:
    """How many cores the group's ranks may run on together (the union of their affinities)."""
    mask = torch.zeros(os.cpu_count() or 1, dtype=torch.float64)
    mask[sorted(os.sched_getaffinity(0))] = 1.0
    if group.size > 1:
        dist.all_reduce(mask, op=dist.ReduceOp.MAX, group=group.group)
    return int(mask.sum())
